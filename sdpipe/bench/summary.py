"""`sdpipe bench --summarize`: one table from several `sdpipe bench` result files.

One device call rarely has time for every row (compiling the SD 1.5 step takes minutes), so a full benchmark is
often split over calls: training, parity, latents and loader. This puts their numbers in one table without
retyping them. Each line names the file it came from, and a provenance table lists each file's GPU, versions,
commit and command. Ratios stay within one file (a training row against the baseline of its own call); only the
loader, whose target is relative to the step, borrows a step rate from another file when its own call has none,
and says so.
"""

from __future__ import annotations

from pathlib import Path

from sdpipe.bench import report
from sdpipe.bench.report import LATENT_TARGET, LOADER_FACTOR, TARGETS, _f


def load(paths: list[Path]) -> list[dict]:
    """Each results file with its stem, oldest first (a later measurement of the same thing is listed later)."""
    from sdpipe import io
    from sdpipe.errors import UserError

    runs = []
    for path in paths:
        try:
            data = io.read_json(path)
        except (OSError, ValueError) as e:
            raise UserError(f"--summarize: cannot read {path}: {e}") from e
        if not isinstance(data, dict) or not {"meta", "presets"} <= data.keys():
            raise UserError(f"--summarize: {path} is not an `sdpipe bench` results file (no meta/presets)")
        runs.append({"stem": Path(path).stem, **data})
    return sorted(runs, key=lambda run: run["meta"].get("date", ""))


def _verdict(got: float | None, target: float | None) -> str:
    if target is None or got is None:
        return "-"
    return "met" if got >= target else "not met"


def _step_lines(preset: str, run: dict) -> list[dict]:
    rows = run["presets"][preset]["rows"]
    ours = [r for r in rows if r["kind"] == "sdpipe" and r.get("fits") is not False]
    if not ours:
        return []
    best = max(ours, key=lambda r: r["samples_per_s"])
    base = max((r for r in rows if r["kind"] == "baseline"), key=lambda r: r["samples_per_s"], default=None)
    target = TARGETS.get(preset)

    def cell(r):
        return (
            f"{r['samples_per_s']:.1f} samples/s at batch {r['batch']}, {_f(r.get('tflops'), '.0f')} TFLOP/s, "
            f"{_f(r.get('mfu'), '.0%')} MFU, {_f(r.get('peak_memory_gib'), '.1f')} GiB"
        )

    # report.write stored each row's ratio to its own call's best baseline
    ratio = f"{best['vs_baseline']:.2f}x the baseline" if best.get("vs_baseline") else "no baseline in this call"
    return [
        {
            "what": f"{preset} training step",
            "sdpipe": cell(best) + f", {_f(best.get('warmup_s'), '.0f')} s warm-up",
            "baseline": cell(base) if base else "-",
            "target": _f(target, "g"),
            "got": best["samples_per_s"],
            "verdict": f"{_verdict(best['samples_per_s'], target)}: {ratio}",
        }
    ]


def _latent_lines(preset: str, run: dict) -> list[dict]:
    res = run["presets"][preset]
    by_name = {r["name"]: r for r in res["latents"]}
    compiled, eager = by_name.get("torch.compile"), by_name.get("eager")
    ours = compiled or eager
    if not ours:
        return []
    target = LATENT_TARGET.get(preset)
    got = ours.get("images_per_s_after_warmup")

    def cell(r):
        return f"{_f(r.get('images_per_s_after_warmup'), '.1f')} images/s after warm-up ({r['name']})"

    batch = f", batch {ours['batch']}" if "batch" in ours else ""  # recorded since v10
    what = f"{preset} latent caching, {ours['encoded']} JPEGs at {res['resolution']} px{batch}, decode included"
    return [
        {
            "what": what,
            "sdpipe": cell(ours),
            "target": _f(target, "g"),
            # With --skip latents a call caches once (eager), for its training rows: nothing to compare.
            "baseline": cell(eager) if eager and compiled else "none: the cache for this call's training rows",
            "got": got,
            "verdict": _latent_verdict(got, target, ours["encoded"]),
        }
    ]


def _latent_verdict(got: float | None, target: float | None, images: int) -> str:
    if target is not None and got is not None and report.latent_verdict(got, target, images) is None:
        return f"no verdict: {images} images"
    return _verdict(got, target)


def _step_rate(preset: str, batch: int, run: dict) -> float | None:
    return max(
        (
            r["samples_per_s"]
            for r in run["presets"][preset]["rows"]
            if r["kind"] == "sdpipe" and r["batch"] == batch and r.get("fits") is not False
        ),
        default=None,
    )


def _loader_lines(preset: str, run: dict, runs: list[dict]) -> list[dict]:
    loader = run["presets"][preset].get("loader")
    if not loader:
        return []
    batch, source = loader["batch"], run["stem"]
    step = _step_rate(preset, batch, run)
    if step is None:  # its own call trained nothing at this batch: the latest call that did
        source, step = next(
            (
                (r["stem"], s)
                for r in reversed(runs)
                if preset in r["presets"]
                for s in [_step_rate(preset, batch, r)]
                if s is not None
            ),
            (None, None),
        )
    ratio = loader["samples_per_s"] / step if step else None
    if step is None:
        against = f"no sdpipe train row at batch {batch} in any file"
    else:
        against = f"the step consumed {step:.1f}" + ("" if source == run["stem"] else f" ({source})")
    return [
        {
            "what": f"{preset} training data loader, batch {batch}",
            "sdpipe": f"{loader['samples_per_s']:.0f} samples/s",
            "baseline": against,
            "target": f"{LOADER_FACTOR:g}x",
            "got": ratio,
            "verdict": f"{_verdict(ratio, LOADER_FACTOR)}: {ratio:.0f}x" if ratio else "-",
        }
    ]


def _parity_lines(preset: str, run: dict) -> list[dict]:
    p = run["presets"][preset].get("parity")
    if not p:
        return []
    diff, dev = p["loss_max_rel_diff"], p["weight_deviation"]
    return [
        {
            "what": f"{preset} parity, batch {p['batch']}, {p['steps']} steps",
            "sdpipe": f"loss within {diff['sdpipe']:.1e} of the baseline's; weights {dev['sdpipe']:.3f} of an "
            f"update away",
            "baseline": f"fp32 run: {diff['fp32']:.1e} and {dev['fp32']:.3f}",
            "target": "bf16 tolerance",
            "got": p["passed"],
            "verdict": "passed" if p["passed"] else "FAILED",
        }
    ]


def summarize(runs: list[dict]) -> dict:
    """Per preset, the training step, latent caching, loader and parity lines of every file, in that order."""
    kinds = (_step_lines, _latent_lines, lambda preset, run: _loader_lines(preset, run, runs), _parity_lines)
    lines = []
    for preset in dict.fromkeys(p for run in runs for p in run["presets"]):
        for lines_of in kinds:
            for run in (r for r in runs if preset in r["presets"]):
                lines += [{**line, "source": run["stem"]} for line in lines_of(preset, run)]
    sources = [
        {
            "file": run["stem"],
            "date": run["meta"]["date"],
            "commit": run["meta"]["git_commit"],
            "gpu": run["meta"]["gpu"],
            "packages": run["meta"]["packages"],
            "peak_tflops": run["meta"]["peak_tflops"],
            "command": run["meta"]["command"],
        }
        for run in runs
    ]
    return {"lines": lines, "sources": sources}


def markdown(summary: dict) -> str:
    out = ["| what (per GPU) | sdpipe | compared with | target | | from |", "|---|---|---|---|---|---|"]
    for line in summary["lines"]:
        out.append(
            f"| {line['what']} | {line['sdpipe']} | {line['baseline']} | {line['target']} "
            f"| {line['verdict']} | {line['source']} |"
        )
    out += [
        "",
        "| from | date (UTC) | commit | GPU (driver) | torch | diffusers | bf16 matmul peak | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary["sources"]:
        command = _measuring_flags(s["command"])
        out.append(
            f"| {s['file']} | {s['date'][:16].replace('T', ' ')} | {s['commit']} "
            f"| {s['gpu']['name'] or 'CPU'} ({s['gpu']['driver']}) | {s['packages']['torch']} "
            f"| {s['packages']['diffusers']} | {_f(s['peak_tflops'], '.0f')} TFLOP/s | `bench {command}` |"
        )
    return "\n".join(out) + "\n"


def _measuring_flags(command: str) -> str:
    """The bench flags that chose what was measured: without the program path and where results went."""
    words = command.split(" bench ", 1)[-1].split()
    dropped = {"--out", "--name", "--commit", "--work"}
    return " ".join(w for i, w in enumerate(words) if w not in dropped and (i == 0 or words[i - 1] not in dropped))


def write(paths: list[Path], out: Path, stem: str) -> str:
    from sdpipe import io

    summary = summarize(load(paths))
    table = markdown(summary)
    out.mkdir(parents=True, exist_ok=True)
    io.write_json(out / f"{stem}.json", summary)
    io.write_text(out / f"{stem}.md", table)
    return table
