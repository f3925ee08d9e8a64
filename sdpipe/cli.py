"""The `sdpipe` command: one subcommand per pipeline stage (each Snakemake rule calls one) plus tools.

A stage module exposes INPUTS and OUTPUTS (name -> default path) and run(cfg, inputs, outputs); this file turns
those names into --flags. A UserError ends the command with one line on stderr and exit code 2; anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from sdpipe.errors import UserError, disk_full
from sdpipe.models.presets import PRESETS

STAGES = {
    "prepare": "sdpipe.stages.prepare",
    "class-images": "sdpipe.stages.class_images",
    "caption": "sdpipe.stages.caption",
    "latents": "sdpipe.stages.latents",
    "train-vae": "sdpipe.stages.train_vae",
    "train": "sdpipe.stages.train",
    "export": "sdpipe.stages.export",
    "evaluate": "sdpipe.stages.evaluate",
    "benchmark": "sdpipe.stages.benchmark",
    "report": "sdpipe.stages.report",
    "card": "sdpipe.stages.card",
}
TOOLS = (
    "demo",
    "build-model",
    "doctor",
    "fetch-weights",
    "fetch-model",
    "publish",
    "bench",
    "bench-dag",
    "bench-bookkeeping",
    "pod",
    "runpod",
    "check-config",
    "init",
    "dvc-yaml",
)
DEFAULT_CONFIG = "config/config.yaml"


def load_config(path: str, overrides: list[str]):
    from sdpipe import config

    return config.load(path, overrides)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"config file (default: {DEFAULT_CONFIG})")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set latents.gpus=2 (repeatable)",
    )


def _add_stage(sub, name: str, module_name: str) -> None:
    module = importlib.import_module(module_name)
    p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
    _add_config_flags(p)
    for kind, paths in (("input", module.INPUTS), ("output", module.OUTPUTS)):
        for key, default in paths.items():
            p.add_argument(
                f"--{key.replace('_', '-')}",
                dest=f"{kind}__{key}",
                default=default,
                help=f"{kind} path (default: {default})",
            )
    p.set_defaults(handler=_run_stage, module=module)


def _run_stage(args) -> int:
    cfg = load_config(args.config, args.set)
    picked = lambda kind: {k.split("__", 1)[1]: Path(v) for k, v in vars(args).items() if k.startswith(kind + "__")}
    args.module.run(cfg, picked("input"), picked("output"))
    return 0


def _cmd_demo(args) -> int:
    from sdpipe import demo

    demo.generate(Path(args.out), count=args.count, seed=args.seed)
    return 0


def _cmd_build_model(args) -> int:
    from sdpipe.models import presets

    presets.build_and_save(args.preset, Path(args.out), seed=args.seed)
    return 0


def _cmd_doctor(args) -> int:
    from sdpipe.ops import doctor

    return doctor.run(load_config(args.config, args.set), strict=args.strict)


def _cmd_fetch_weights(args) -> int:
    from sdpipe.evaluate.fetch import fetch_weights

    cfg = load_config(args.config, args.set)
    for line in fetch_weights(cfg.evaluate.fid.inception_weights, cfg.evaluate.clip_score):
        print(line)
    return 0


def _cmd_fetch_model(args) -> int:
    from sdpipe.fetch_model import fetch_model

    for line in fetch_model(load_config(args.config, args.set)):
        print(line)
    return 0


def _cmd_publish(args) -> int:
    from sdpipe.export.hub import upload

    print(upload(load_config(args.config, args.set), Path(args.folder), Path(args.card)))
    return 0


def _cmd_check_config(args) -> int:
    from sdpipe import plan
    from sdpipe.config import check_user_config

    cfg = load_config(args.config, args.set)
    check_user_config(cfg)
    print(f"{args.config}: ok")
    for line in plan.lines(cfg):
        print(f"  {line}")
    if args.print:
        import yaml

        print(yaml.safe_dump(cfg.raw, sort_keys=False), end="")
    return 0


def _stages_for(command: str | None) -> dict:
    if command in STAGES:
        return {command: STAGES[command]}
    return {} if command in TOOLS else STAGES  # no command or a wrong one: all, for the help and the error


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; for a known `command`, stage modules other than its own are not imported (they pull in torch
    and diffusers, seconds of start-up for every `sdpipe` call)."""
    parser = argparse.ArgumentParser(prog="sdpipe", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in _stages_for(command).items():
        _add_stage(sub, name, module_name)

    p = sub.add_parser("demo", help="write the embedded demo dataset (coloured shapes, deterministic, offline)")
    p.add_argument("--out", default="data/raw")
    p.add_argument("--count", type=int, default=480)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_cmd_demo)

    p = sub.add_parser("build-model", help="build a randomly initialised model preset and save it in diffusers format")
    p.add_argument("--preset", required=True, choices=PRESETS)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_cmd_build_model)

    p = sub.add_parser("doctor", help="report Python/torch/CUDA/GPUs/NCCL and whether the configured weights are found")
    _add_config_flags(p)
    p.add_argument("--strict", action="store_true", help="exit 1 if a needed weight is missing")
    p.set_defaults(handler=_cmd_doctor)

    p = sub.add_parser("fetch-weights", help="download the FID InceptionV3 and CLIP-score weights (needs internet)")
    _add_config_flags(p)
    p.set_defaults(handler=_cmd_fetch_weights)

    p = sub.add_parser(
        "fetch-model",
        help="download only the base-model files this config loads into the Hugging "
        "Face cache (needs internet): one weight variant, or for a single-file "
        "model its configs and tokenizers",
    )
    _add_config_flags(p)
    p.set_defaults(handler=_cmd_fetch_model)

    p = sub.add_parser(
        "publish",
        help="upload an export folder to the Hub repo export.hub.repo_id (token from the "
        "environment variable export.hub.token_env)",
    )
    _add_config_flags(p)
    p.add_argument("--folder", default="results/export", help="the folder to upload (default: results/export)")
    p.add_argument(
        "--card",
        default="results/card",
        help="the model card's folder, uploaded beside it as the "
        "repo's README.md (default: results/card; skipped if absent)",
    )
    p.set_defaults(handler=_cmd_publish)

    p = sub.add_parser(
        "bench",
        help="GPU speed: the training step against the diffusers-example loop, latent "
        "caching and the data loader, measured in one run (see benchmarks/)",
    )
    from sdpipe.bench.cli import add_arguments

    add_arguments(p)
    p.set_defaults(handler=_cmd_bench)

    p = sub.add_parser(
        "bench-dag",
        help="the whole DAG through `snakemake --profile runpod` on a random-init preset "
        "and synthetic JPEGs, timed stage by stage (see benchmarks/)",
    )
    from sdpipe.bench.dag import add_arguments as dag_arguments

    dag_arguments(p)
    p.set_defaults(handler=_cmd_bench_dag)

    p = sub.add_parser(
        "bench-bookkeeping",
        help="what the bookkeeping costs as the dataset grows (CPU, tiny preset): first run, no-op and "
        "incremental reruns, peak memory, cache files; extrapolated to 1e6 and 1e7 images",
    )
    from sdpipe.bench.bookkeeping import add_arguments as bookkeeping_arguments

    bookkeeping_arguments(p)
    p.set_defaults(handler=_cmd_bench_bookkeeping)

    p = sub.add_parser(
        "pod",
        help="a pod's start-up (the container entrypoint): detect GPUs, put state on the "
        "volume, run snakemake --profile runpod",
    )
    from sdpipe.ops import pod

    pod.add_arguments(p)
    p.set_defaults(handler=pod.run)

    p = sub.add_parser("runpod", help="create, watch, sync and stop a Runpod pod running the pipeline")
    from sdpipe.ops import runpod_api

    runpod_api.add_arguments(p)
    p.set_defaults(handler=runpod_api.run)

    p = sub.add_parser("check-config", help="validate a config file, print what it will do, and exit")
    _add_config_flags(p)
    p.add_argument("--print", action="store_true", help="also print the effective config (every key, defaults filled)")
    p.set_defaults(handler=_cmd_check_config)

    p = sub.add_parser(
        "init",
        help="a project for one job from a template: sdpipe init FOLDER --template sd15-lora "
        "--images PHOTOS --model BASE",
    )
    from sdpipe import project

    project.add_arguments(p)
    p.set_defaults(handler=project.run)

    p = sub.add_parser("dvc-yaml", help="write dvc.yaml from the config (the stages, and the model files it uses)")
    _add_config_flags(p)
    p.set_defaults(handler=_cmd_dvc_yaml)
    return parser


def _cmd_dvc_yaml(args) -> int:
    from sdpipe import dvc_file

    return dvc_file.main(args)


def _cmd_bench_dag(args) -> int:
    from sdpipe.bench.dag import run

    return run(args)


def _cmd_bench_bookkeeping(args) -> int:
    from sdpipe.bench.bookkeeping import run

    return run(args)


def _cmd_bench(args) -> int:
    from sdpipe.bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    from sdpipe.log import setup_logging

    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.handler(args)
    except UserError as exc:
        print(f"sdpipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not disk_full(exc):
            raise
        # Every write is atomic and every cache entry checksummed, so what was finished is kept and a rerun goes on.
        where = f" writing {exc.filename}" if getattr(exc, "filename", None) else ""
        print(
            f"sdpipe {args.command}: error: the disk is full{where}; free space, then rerun: finished work is kept "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        logging.getLogger("sdpipe").error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
