"""`sdpipe bench-bookkeeping`: what sdpipe's bookkeeping costs as a dataset grows (issue 30), on the CPU.

Per size, a project made as users make one (`sdpipe init`, template sd15-lora, the tiny preset with its fixed VAE,
48x40 PNGs with sidecar captions), run to `latents` through `snakemake --profile runpod`:
- the first run;
- the no-op reruns: `snakemake latents` and `snakemake -n` (each the median of three) and, after `git init`,
  `dvc init` and `dvc add data/raw` (timed too), `dvc repro latents`;
- the rerun after adding 10 images;
- each command's peak memory (the largest resident set among the processes it ran);
- the files and bytes under cache/ and results/.

A line fitted through the two largest sizes extrapolates each figure to 10^6 and 10^7 images. The targets are
issue 30's, at 10^6 images: a no-op rerun within 10 s, at most 10 s fixed cost around an incremental rerun, 4 GB of
peak memory, and a few thousand cache files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("sdpipe.bench")
SIZE = (48, 40)
ADDED = 10
SHARD = 1000  # images per tar shard (--layout tar)
EXTRAPOLATE = (10**6, 10**7)
TARGETS = {"noop_s": 10.0, "dry_run_s": 10.0, "add_fixed_s": 10.0, "peak_gb": 4.0, "cache_files": 5000}
SETTINGS = {
    "prepare": {"min_size": 32, "eval_fraction": 0.0, "buckets": {"resolution": 32, "step": 8}},
    "caption": {"chain": ["sidecar"], "gpus": 0},
    "latents": {"dtype": "fp32", "gpus": 0},
}
# Run the command, then print the largest resident set among the processes it waited for (Linux: KiB).
PEAK = "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); " + (
    "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(rc)"
)


def add_arguments(p) -> None:
    p.add_argument("--images", type=int, nargs="+", default=[1000, 10000], help="dataset sizes (default 1e3 1e4)")
    p.add_argument("--work", default="/tmp/sdpipe-bookkeeping", help="scratch: one project per size")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="bookkeeping")
    p.add_argument(
        "--layout",
        choices=["files", "tar"],
        default="files",
        help="files: an image and its sidecar per image; tar: webdataset shards of 1000 images (10 added: a shard)",
    )


def image_bytes(i: int) -> tuple[bytes, bytes]:
    """Image i, a small PNG (a flat colour with a square, unique by content), and its caption."""
    import io as bytes_io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", SIZE, ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256))
    ImageDraw.Draw(img).rectangle([i % 20, (i // 20) % 16, i % 20 + 8, (i // 20) % 16 + 8], fill=(i % 256, 0, 255))
    ImageDraw.Draw(img).point([(i // 320) % SIZE[0], (i // 15360) % SIZE[1]], fill=((i // 7) % 256, 1, 2))
    buf = bytes_io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), f"a square, picture {i}\n".encode()


def write_images(raw: Path, start: int, count: int, layout: str = "files") -> None:
    """Images start..start+count with their captions: as files, or as tar shards of SHARD images."""
    raw.mkdir(parents=True, exist_ok=True)
    if layout == "tar":
        firsts = range(start, start + count, SHARD)
        with ThreadPoolExecutor() as pool:
            list(pool.map(lambda first: _write_shard(raw, first, min(SHARD, start + count - first)), firsts))
        return

    def one(i: int) -> None:
        image, caption = image_bytes(i)
        (raw / f"img{i:08d}.png").write_bytes(image)
        (raw / f"img{i:08d}.txt").write_bytes(caption)

    with ThreadPoolExecutor() as pool:
        list(pool.map(one, range(start, start + count)))


def _write_shard(raw: Path, first: int, count: int) -> None:
    import io as bytes_io
    import tarfile

    with tarfile.open(raw / f"{first:09d}.tar", "w") as tf:
        for i in range(first, first + count):
            for name, data in zip((f"img{i:08d}.png", f"img{i:08d}.txt"), image_bytes(i)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, bytes_io.BytesIO(data))


def timed(cmd: list[str], cwd: Path, logfile: Path) -> dict:
    """Wall seconds and peak memory of one command; a failure is one line naming its log."""
    from sdpipe.errors import UserError

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    start = time.perf_counter()
    with open(logfile, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-c", PEAK, *cmd], cwd=cwd, stdout=f, stderr=subprocess.PIPE, env=env, text=True
        )
    seconds = time.perf_counter() - start
    f_err = proc.stderr.splitlines()
    peak = next((int(line.split()[1]) for line in reversed(f_err) if line.startswith("peak_kib")), 0)
    with open(logfile, "a") as f:
        f.write("\n".join(line for line in f_err if not line.startswith("peak_kib")))
    if proc.returncode:
        raise UserError(f"{' '.join(cmd[:4])} failed (exit {proc.returncode}) in {cwd}; log: {logfile}")
    return {"s": round(seconds, 2), "peak_gb": round(peak * 1024 / 1e9, 3)}


def median_of(runs: int, cmd: list[str], cwd: Path, logfile: Path) -> dict:
    """The run of median wall time among `runs`: a few seconds' figure moves by a second with the page cache and the
    machine's load, and a line fitted through two sizes turns that into tens of seconds at 10^6."""
    results = sorted((timed(cmd, cwd, logfile) for _ in range(runs)), key=lambda r: r["s"])
    return results[runs // 2] | {"runs_s": [r["s"] for r in results]}


def tree(folder: Path) -> dict:
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def measure(size: int, work: Path, model: Path, layout: str = "files") -> dict:
    from sdpipe import config, dvc_file, io, project

    folder = work / f"n{size}"
    shutil.rmtree(folder, ignore_errors=True)
    raw = folder / "data" / "raw"
    write_images(raw, 0, size, layout)
    project.init(folder, "sd15-lora", raw, str(model), ["a square"])
    # In the project's own config, so that `dvc repro` (whose stages run plain `snakemake`) sees them too.
    # raw_dir relative, as a project that moves between machines has it: DVC tracks data/raw in the project.
    user = folder / "config" / "config.yaml"
    settings = config.merge(io.read_yaml(user), SETTINGS | {"data": {"raw_dir": "data/raw"}})
    io.write_yaml(user, settings)
    dvc_file.write(folder, config.from_dict(settings))
    snake = [sys.executable, "-m", "snakemake", "--profile", "runpod", "--cores", "2"]
    logs = folder / "bench-logs"
    logs.mkdir()
    out = {"images": size}
    log.info("bookkeeping %d: first run to latents", size)
    out["first"] = timed([*snake, "latents"], folder, logs / "first.log")
    out["noop"] = median_of(3, [*snake, "latents"], folder, logs / "noop.log")
    out["dry_run"] = median_of(3, [*snake, "-n", "latents"], folder, logs / "dry.log")
    out |= dvc_noop(folder, logs)
    write_images(raw, size, ADDED, layout)
    out["add"] = timed([*snake, "latents"], folder, logs / "add.log")
    summary = json.loads((folder / "results" / "latents" / "summary.json").read_text())
    out["add"]["encoded"] = summary.get("encoded")
    out["add"]["rules"] = rule_seconds(folder)
    out["cache"], out["results"] = tree(folder / "cache"), tree(folder / "results")
    log.info("bookkeeping %d: %s", size, json.dumps(out))
    return out


def rule_seconds(folder: Path) -> dict:
    """Each data rule's wall seconds in the last run, from its Snakemake `benchmark:` file (the last line)."""
    out = {}
    for rule in ("prepare", "caption", "latents"):
        lines = (folder / "benchmarks" / f"{rule}.tsv").read_text().splitlines()
        out[rule] = float(lines[-1].split("\t")[0])
    return out


def dvc_noop(folder: Path, logs: Path) -> dict:
    """`dvc add data/raw`, then `dvc repro latents` once to record the stages (each reruns its rule: the caches
    answer), then the no-op `dvc repro latents` that is timed as the figure."""
    dvc = [str(Path(sys.executable).parent / "dvc")]
    for cmd in (["git", "init", "-q"], [*dvc, "init", "-q"]):
        subprocess.run(cmd, cwd=folder, check=True, capture_output=True)
    out = {"dvc_add": timed([*dvc, "add", "-q", "data/raw"], folder, logs / "dvc-add.log")}
    out["dvc_first"] = timed([*dvc, "repro", "latents"], folder, logs / "dvc-first.log")
    out["dvc_noop"] = timed([*dvc, "repro", "latents"], folder, logs / "dvc-noop.log")
    return out


def _rule_figure(rule: str):
    return lambda r: r["add"].get("rules", {}).get(rule, float("nan"))  # nan: a row measured before rules were


TIMED = ("first", "noop", "dry_run", "dvc_add", "dvc_first", "dvc_noop", "add")
FIGURES = {
    "first run s": lambda r: r["first"]["s"],
    "no-op `snakemake latents` s": lambda r: r["noop"]["s"],
    "`snakemake -n` s": lambda r: r["dry_run"]["s"],
    "`dvc add data/raw` s": lambda r: r["dvc_add"]["s"],
    "no-op `dvc repro latents` s": lambda r: r["dvc_noop"]["s"],
    f"rerun after adding {ADDED} s": lambda r: r["add"]["s"],
    **{f"  of which `{rule}` s": _rule_figure(rule) for rule in ("prepare", "caption", "latents")},
    "peak memory GB (any command)": lambda r: max(r[k]["peak_gb"] for k in TIMED if k in r),
    f"  of which the rerun after adding {ADDED} GB": lambda r: r["add"]["peak_gb"],
    "cache files": lambda r: r["cache"]["files"],
    "cache GB": lambda r: r["cache"]["bytes"] / 1e9,
    "results files": lambda r: r["results"]["files"],
}


def extrapolate(rows: list[dict]) -> dict:
    """Each figure as a + b n through the two largest sizes, evaluated at 10^6 and 10^7."""
    if len(rows) < 2:
        return {}
    (small, large) = sorted(rows, key=lambda r: r["images"])[-2:]
    fits = {}
    for name, get in FIGURES.items():
        slope = (get(large) - get(small)) / (large["images"] - small["images"])
        base = get(large) - slope * large["images"]
        fits[name] = {"a": base, "b": slope, **{f"{n:.0e}": base + slope * n for n in EXTRAPOLATE}}
    return fits


def _cell(value: float) -> str:
    if abs(value) >= 1e6:
        return f"{value:.3g}"
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.4g}"


def markdown(results: dict) -> str:
    rows, fits = results["rows"], results["fits"]
    fitted = EXTRAPOLATE if fits else ()
    head = ["figure", *[f"{r['images']:,}" for r in rows], *[f"{n:.0e} (fit)" for n in fitted]]
    lines = [
        f"## Bookkeeping as the dataset grows ({results.get('layout', 'files')} layout, {results['machine']}, "
        f"commit {results['commit']})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, get in FIGURES.items():
        cells = [_cell(get(r)) for r in rows] + [_cell(fits[name][f"{n:.0e}"]) for n in fitted]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if fits:
        terms = [f"{name}: {f['a']:.4g} + {f['b']:.3g}·n" for name, f in fits.items()]
        lines += ["", "Fits (a + b·n through the two largest sizes): " + "; ".join(terms) + "."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import platform

    from sdpipe import io
    from sdpipe.models import presets
    from sdpipe.provenance import git_state

    logging.getLogger("sdpipe").setLevel(logging.INFO)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "tiny", ignore_errors=True)  # the bench's own scratch: a model from an earlier run goes
    model = presets.build_and_save("tiny", work / "tiny", seed=0)
    rows = [measure(n, work, model, args.layout) for n in sorted(args.images)]
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "layout": args.layout,
        "commit": git_state()[0],
        "rows": rows,
        "fits": extrapolate(rows),
        "targets_at_1e6": TARGETS,
    }
    out = Path(args.out)
    io.write_json(out / f"{args.name}.json", results)
    text = markdown(results)
    (out / f"{args.name}.md").write_text(text)
    print(text)
    return 0
