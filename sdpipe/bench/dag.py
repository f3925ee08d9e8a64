"""`sdpipe bench-dag`: the whole DAG as a user runs it on a pod, timed stage by stage.

Each job gets a project folder seeded the way `sdpipe pod` seeds one (the workflow files only, no sdpipe/ source:
the commands come from the installed package), a complete config written where a user writes theirs
(config/config.yaml), synthetic photo-like JPEGs with sidecar captions in data/raw and a random-init preset saved
like a user's checkpoint in models/. Then `snakemake --profile runpod` runs every stage. The preset and the images
are made before the clock starts: a user has both already.

Per-stage wall times come from the rules' Snakemake benchmark files; the DAG's own wall time from the command.
Training's steady rate, warm-up, compile and first-step times come from its summary; a second, short training run
in the same project then shows the start with the compile caches warm (they live in the project's cache/).
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sdpipe import config, io
from sdpipe.bench import dag_data
from sdpipe.errors import UserError

log = logging.getLogger("sdpipe.bench")
PROMPTS = [
    "a photo of a red balloon over a lake",
    "a watercolour painting of a lighthouse",
    "a close-up photo of a green apple on a table",
    "an oil painting of mountains at sunset",
]


@dataclass(frozen=True)
class Job:
    template: str  # the `sdpipe init` template the project is made from (the user's path)
    preset: str
    resolution: int
    images: int
    batch: int
    steps: int
    eval_images: int


JOBS = {
    "sd15-full": Job("sd15-full", "sd15", 512, 2048, 32, 1000, 64),
    "sd15-lora": Job("sd15-lora", "sd15", 512, 2048, 32, 1000, 64),
    "sdxl-lora": Job("sdxl-lora", "sdxl", 1024, 512, 8, 300, 16),
    "tiny": Job("sd15-full", "tiny", 32, 48, 8, 12, 4),  # a CPU smoke run of the same path (tests)
}
BENCH_CONFIG = "bench.yaml"
SHORT_RUN_STEPS = 20  # the warm start's and the run from latents.remote's


@dataclass(frozen=True)
class DataSetup:
    layout: str = "files"  # files: a JPEG and its .txt each; tar: webdataset shards (dag_data.pack_tar)
    latents_remote: str | None = None  # latents.remote: publish the latent cache there, then train from it
    raw_remote: str | None = None  # data.raw_remote: the images are moved to this S3 prefix, and prepare mirrors it


def bench_config(job: Job) -> dict:
    """What the benchmark changes in the template's config, a second config file over the project's: its size
    (batch, steps, images to render) and no warm-up or early checkpoints, so runs compare. Everything else (learning
    rate, precision, min-SNR, validation settings, text encoder) is the template's, as a user runs it."""
    seeds = max(1, job.eval_images // len(PROMPTS))
    tiny = job.preset == "tiny"
    train = {
        "per_device_batch_size": job.batch,
        "grad_accum_steps": 1,
        "max_steps": job.steps,
        "lr_warmup_steps": 0,
        "checkpoint_every": 500,
        "keep_checkpoints": 1,
        "log_every": 10,
        "validation": {"every": job.steps, "prompts": PROMPTS[:2], "seeds": [0]},
    }
    out = {
        "prepare": {"min_size": min(256, job.resolution), "eval_fraction": 0.05},
        "train": train,
        "evaluate": {"seeds": list(range(seeds)), "batch_size": "auto"},
    }
    if tiny:
        out["prepare"]["buckets"] = {"resolution": 32, "step": 8}
        out["latents"] = {"dtype": "fp32"}
        train.update(mixed_precision="fp32", validation={"every": 0})
    return out


def make_project(
    job: Job, folder: Path, source: Path, images: int, single_file: bool = False, data: DataSetup | None = None
) -> dict:
    """Write the images and captions and save the model as a user has them (a diffusers folder, or one .safetensors
    in the original SD layout, as from Civitai), then `sdpipe init` the project from the job's template; return the
    seconds each took. A single file's configs come from the preset's folder, as `sdpipe fetch-model` would fetch
    them; its conversion happens in the DAG, on the clock."""
    from sdpipe import project
    from sdpipe.bench.pipeline import sdpipe, write_jpegs

    if folder.exists():
        shutil.rmtree(folder)
    start = time.perf_counter()
    raw = write_jpegs(folder / "data" / "raw", images, job.resolution)
    for i, image in enumerate(sorted(raw.glob("*.jpg"))):
        image.with_suffix(".txt").write_text(f"a photo of coloured circles, picture {i}\n")
    data = data or DataSetup()
    if data.layout == "tar":
        dag_data.pack_tar(raw)
    made_images = time.perf_counter()
    preset = folder / "models" / job.preset
    sdpipe("build-model", "--preset", job.preset, "--out", str(preset))
    model, extra = preset, {}
    if single_file:
        from sdpipe.export.single_file import export_single_file

        model = export_single_file(preset, folder / "models" / f"{job.preset}.safetensors", dtype="fp16")
        extra = {"model": {"single_file_config": str(preset)}}
    made_model = time.perf_counter()
    project.init(folder, job.template, raw, str(model), PROMPTS, source=source)
    if data.latents_remote:
        extra = config.merge(extra, {"latents": {"remote": data.latents_remote}})
    if data.raw_remote:
        dag_data.upload_raw(raw, data.raw_remote)
        extra = config.merge(extra, {"data": {"raw_remote": data.raw_remote}})
    io.write_yaml(folder / BENCH_CONFIG, config.merge(bench_config(job), extra))
    return {"images_s": round(made_images - start, 3), "model_s": round(made_model - made_images, 3)}


def run_snakemake(project: Path, logfile: Path, extra: list[str]) -> float:
    """`snakemake --profile runpod` in the project; its wall seconds. A failure is one line naming the log."""
    # extra (targets, --config ...) before --configfile, whose list would swallow a target
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--profile",
        "runpod",
        *extra,
        "--configfile",
        "config/config.yaml",
        BENCH_CONFIG,
    ]
    # the rules call `sdpipe`: this interpreter's scripts first, as in a venv the user activated
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    start = time.perf_counter()
    with open(logfile, "w") as f:
        rc = subprocess.run(cmd, cwd=project, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - start
    if rc:
        tail = "".join(logfile.read_text().splitlines(keepends=True)[-40:])
        sys.stderr.write(tail)
        raise UserError(f"snakemake --profile runpod failed (exit {rc}) in {project}; log: {logfile}")
    return wall


def stage_seconds(project: Path) -> dict[str, float]:
    """Wall seconds of each rule that ran, from its Snakemake benchmark file (benchmarks/<rule>.tsv)."""
    out = {}
    for tsv in sorted((project / "benchmarks").glob("*.tsv")):
        with open(tsv, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        if rows:
            out[tsv.stem] = round(float(rows[-1]["s"]), 3)
    return out


def collect(project: Path, wall: float) -> dict:
    """The numbers of one finished DAG."""
    stages = stage_seconds(project)
    train = io.read_json(project / "results" / "train" / "summary.json")
    metrics = io.read_json(project / "results" / "evaluate" / "metrics.json")
    export = io.read_json(project / "results" / "export" / "summary.json")
    latents = io.read_json(project / "results" / "latents" / "summary.json")
    prepared = io.read_json(project / "results" / "prepare" / "summary.json")
    other = sum(v for k, v in stages.items() if k != "train")
    return {
        "dag_s": round(wall, 3),
        "stages_s": stages,
        "snakemake_overhead_s": round(wall - sum(stages.values()), 3),
        "non_training_share": round((wall - stages.get("train", 0.0)) / wall, 4),
        "other_stages_s": round(other, 3),
        "train": {
            k: train.get(k)
            for k in (
                "optimizer_steps",
                "global_batch_size",
                "compile",
                "samples_per_s",
                "warmup_s",
                "compile_s",
                "time_to_first_step_s",
                "validation_and_checkpoint_s",
                "seconds",
                "peak_memory_mb",
            )
        },
        "prepare": {k: prepared.get(k) for k in ("accepted", "rejected", "raw_remote")},
        "latents": {
            k: latents.get(k)
            for k in ("items", "encoded", "images_per_s", "images_per_s_after_warmup", "batch_sizes", "seconds")
        },
        "export": {
            name: {k: f[k] for k in ("verified", "mean_abs_diff", "max_abs_diff")}
            for name, f in export["formats"].items()
        }
        | {"rendered_on": export["verify"].get("rendered_on")},
        "evaluate": {
            "images": metrics.get("images"),
            "images_per_s": metrics.get("inference_samples_per_s"),
            "load_s": metrics.get("inference_load_s"),
            "warmup_s": metrics.get("inference_warmup_s"),
            "fid": metrics["fid"],
            "clip_score": metrics["clip_score"],
        },
    }


def run_job(name: str, job: Job, work: Path, source: Path, args, data: DataSetup, single_file: bool = False) -> dict:
    folder = work / name
    project = folder / "project"
    folder.mkdir(parents=True, exist_ok=True)
    log.info(
        "bench-dag %s: making the project (%d images at %d px, preset %s, %s layout)",
        name,
        job.images,
        job.resolution,
        job.preset,
        data.layout,
    )
    setup = make_project(job, project, source, job.images, single_file, data)
    log.info("bench-dag %s: snakemake --profile runpod", name)
    wall = run_snakemake(project, folder / "snakemake.log", args.snakemake_arg)
    result = {
        "job": asdict(job),
        "model_format": "single file" if single_file else "diffusers folder",
        "data": asdict(data),
        "setup_s": setup,
        **collect(project, wall),
    }
    if not args.no_warm_start:
        # a second, short run: its first step with the compile caches the first run left in the project's cache/
        result["warm_start"] = dag_data.train_again(project, "warm-start", SHORT_RUN_STEPS)
    if data.latents_remote:
        log.info("bench-dag %s: training again with the latent cache only on %s", name, data.latents_remote)
        result["from_remote"] = dag_data.train_from_remote(project, SHORT_RUN_STEPS)
    log.info("bench result: %s %s", name, result)
    return result


def add_arguments(p) -> None:
    p.add_argument(
        "--job",
        action="append",
        choices=sorted(JOBS),
        help="sd15-full (default), sd15-lora, sdxl-lora, tiny (a CPU smoke run); repeatable",
    )
    p.add_argument("--steps", type=int, help="optimizer steps (default: the job's)")
    p.add_argument("--images", type=int, help="JPEGs to make (default: the job's)")
    p.add_argument(
        "--source",
        help="the workflow files to seed projects from: a checkout or the image's project "
        "(default: $SDPIPE_IMAGE_PROJECT, else the current folder)",
    )
    p.add_argument("--work", default="/tmp/sdpipe-dag", help="scratch: one project folder per job")
    p.add_argument("--no-warm-start", action="store_true", help="skip the second, short training run")
    p.add_argument(
        "--model-format",
        choices=["folder", "single-file"],
        default="folder",
        help="the base model as a diffusers folder or as one .safetensors file (converted in the DAG)",
    )
    p.add_argument("--skip-dag", action="store_true", help="make the projects and run only --baseline-script")
    p.add_argument(
        "--baseline-script",
        type=Path,
        help="diffusers' train_text_to_image.py, to run on each sd15 job's images and model after its DAG",
    )
    p.add_argument("--baseline-steps", type=int, help="steps of that run (default: the job's; fewer are projected)")
    p.add_argument(
        "--layout",
        choices=["files", "tar"],
        default="files",
        help="the images as loose files with sidecar captions, or as webdataset tar shards of 256",
    )
    p.add_argument(
        "--latents-remote",
        metavar="S3_URL",
        help="set latents.remote (s3://bucket/prefix; endpoint and keys from AWS_*), then train once more with the "
        "local latent cache moved aside, as a second node would",
    )
    p.add_argument(
        "--raw-remote",
        metavar="S3_URL",
        help="move the images to this S3 prefix (after --layout packs them) and set data.raw_remote, so prepare "
        "mirrors them from there",
    )
    p.add_argument("--snakemake-arg", action="append", default=[], help="passed on to snakemake; repeatable")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="dag", help="results file stem")
    p.add_argument("--commit", help="the code's git commit, when the tree has no .git")


def _jobs(args) -> dict[str, Job]:
    from dataclasses import replace

    jobs = {}
    for name in args.job or ["sd15-full"]:
        job = JOBS[name]
        jobs[name] = replace(job, steps=args.steps or job.steps, images=args.images or job.images)
    return jobs


def _source(args) -> Path:
    source = Path(args.source or os.environ.get("SDPIPE_IMAGE_PROJECT") or ".")
    if not (source / "Snakefile").is_file():
        raise UserError(f"{source} has no Snakefile: pass --source, the folder holding the workflow files")
    return source.resolve()


def run(args) -> int:
    from sdpipe.bench import dag_report, peer
    from sdpipe.bench.report import provenance

    logging.getLogger("sdpipe").setLevel(logging.INFO)
    work, source = Path(args.work), _source(args)
    results = {"meta": provenance(args.commit), "jobs": {}}
    for name, job in _jobs(args).items():
        if args.skip_dag:
            res = {
                "job": asdict(job),
                "setup_s": make_project(
                    job,
                    work / name / "project",
                    source,
                    job.images,
                    args.model_format == "single-file",
                    DataSetup(args.layout, args.latents_remote, args.raw_remote),
                ),
            }
        else:
            data = DataSetup(args.layout, args.latents_remote, args.raw_remote)
            res = run_job(name, job, work, source, args, data, args.model_format == "single-file")
        if args.baseline_script and job.preset == "sd15":
            res["baseline"] = peer.run(
                args.baseline_script.resolve(),
                work / name / "project",
                job,
                work / name,
                args.baseline_steps or job.steps,
            )
            log.info("bench result: %s baseline %s", name, res["baseline"])
        results["jobs"][name] = res
        _save(results, Path(args.out), args.name, dag_report)
    print(_save(results, Path(args.out), args.name, dag_report))
    return 0


def _save(results: dict, out: Path, stem: str, dag_report) -> str:
    """JSON and Markdown after every job: a later job's failure keeps the earlier ones' numbers."""
    text = dag_report.markdown(results) if all("dag_s" in r for r in results["jobs"].values()) else ""
    io.write_json(out / f"{stem}.json", results)
    if text:
        io.write_text(out / f"{stem}.md", text + "\n")
    return text
