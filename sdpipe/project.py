"""`sdpipe init`: a project folder for one job, from a template, the images and the base model.

The project gets the workflow (Snakefile, workflow/, profiles/, copied from the image or the checkout this package
runs from), a config/config.yaml holding the template's settings with the user's images, model and prompts filled
in, and a dvc.yaml that follows that config. Then `snakemake --profile runpod` in the folder runs the job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from sdpipe import templates
from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

SOURCE_CHECKOUT = Path(__file__).resolve().parent.parent  # a clone of sdpipe (an editable install), if it is one
MAX_PROMPTS = 4


def workflow_source() -> Path:
    """Where the workflow files come from: the Docker image's project, else the checkout of this package."""
    from sdpipe.ops import pod

    for place in (pod.IMAGE_PROJECT, SOURCE_CHECKOUT):
        if (place / "Snakefile").is_file():
            return place
    raise UserError(
        "no workflow to copy (no Snakefile in the Docker image's project or beside the sdpipe package); "
        "run `sdpipe init` from a clone of sdpipe or in the sdpipe image"
    )


def prompts_from(images: Path, given: list[str], instance_prompt: str | None) -> list[str]:
    """Validation and evaluation prompts: the user's, else DreamBooth's instance prompt, else the first sidecar
    captions in the image folder, else captions made from the first file names (what training will see)."""
    if given:
        return given
    if instance_prompt:
        return [instance_prompt]
    from sdpipe.captioners.free import clean_stem
    from sdpipe.prepare.files import scan

    files, sidecars = scan(images, [".txt", ".caption"])
    texts = [(images / s).read_text(encoding="utf-8", errors="replace").strip() for s in sidecars[:MAX_PROMPTS]]
    texts = [t for t in texts if t] or [clean_stem(Path(f).stem) for f in files[:MAX_PROMPTS]]
    texts = [t for t in texts if t]
    if not texts:
        raise UserError(f'no images in {images} to take prompts from; give --prompt "..." (repeatable)')
    return texts


def job_settings(
    template: str,
    images: Path,
    model: str,
    prompts: list[str],
    revision: str | None = None,
    variant: str | None = None,
    instance_prompt: str | None = None,
    class_prompt: str | None = None,
) -> dict:
    """The project's config: the template's settings plus what only the user knows."""
    from sdpipe.config import merge

    base = templates.settings(template)
    dreambooth = base.get("dreambooth", {}).get("enabled", False)
    if dreambooth and not (instance_prompt and class_prompt):
        raise UserError(
            f'template {template} trains a subject: give --instance-prompt (e.g. "a photo of sks dog") '
            f'and --class-prompt (e.g. "a photo of a dog")'
        )
    mine = {
        "data": {"raw_dir": str(images)},
        "model": {"pretrained": model, "revision": revision, "variant": variant},
        "train": {"validation": {"prompts": prompts}},
        "export": {"verify": {"prompt": prompts[0]}},
        "evaluate": {"prompts": prompts},
    }
    if dreambooth:
        mine["caption"] = {"chain": ["template"], "template": instance_prompt}
        mine["dreambooth"] = {"class_prompt": class_prompt}
    return merge(base, mine)


def _dump(value) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True)
        .strip()
        .removesuffix("...")
        .strip()
    )


def render(settings: dict, notes: dict[tuple[str, ...], str], header: list[str]) -> str:
    """YAML with each key's comment beside it, sections in the schema's order."""
    from sdpipe.config import load_schema

    order = list(load_schema()["properties"])
    lines = [f"# {h}" if h else "#" for h in header]

    def emit(node: dict, path: tuple[str, ...]) -> None:
        for key, value in node.items():
            where = path + (key,)
            note = f"  # {notes[where]}" if where in notes else ""
            pad = "  " * len(path)
            if isinstance(value, dict) and value:
                lines.append(f"{pad}{key}:{note}")
                emit(value, where)
            else:
                lines.append(f"{pad}{key}: {_dump(value)}{note}")

    emit({k: settings[k] for k in sorted(settings, key=order.index)}, ())
    return "\n".join(lines) + "\n"


def _absolute(name: str) -> str:
    """A local model path made absolute (the project may run from elsewhere); a hub id as it is."""
    from sdpipe import weights

    return str(Path(name).expanduser().resolve()) if weights.is_local(name) else name


def _model_family(cfg: Config) -> str | None:
    """The base model's family from its config files, or a single file's keys; None where it is not here yet."""
    from sdpipe import model_facts, single_file

    if single_file.is_checkpoint(cfg.model.pretrained):
        return single_file.family(cfg.model.pretrained, single_file.tensor_info(cfg.model.pretrained))
    found = model_facts.configs(cfg)
    return model_facts.family(found[0]) if found else None


def _check_family(template: str, cfg: Config) -> None:
    from sdpipe.models import families

    family, wanted = _model_family(cfg), templates.family(template)
    if family and family != wanted:
        title = families.named(family).title
        article = "an" if title[0] in "AEIOS" else "a"  # "an SDXL model" (letters), "a Flux.1 model" (a word)
        raise UserError(
            f"{cfg.model.pretrained} is {article} {title} model and template {template} is for "
            f"{families.named(wanted).title}; pick another template (sdpipe init --list)"
        )


def init(
    folder: Path,
    template: str,
    images: Path,
    model: str,
    prompts: list[str],
    force: bool = False,
    source: Path | None = None,
    **extra,
) -> Path:
    """Write the project (the workflow copied from `source`, default workflow_source()); return its config file.
    Nothing is written when any check fails."""
    from sdpipe import config, dvc_file, io
    from sdpipe.ops import pod

    images = images.expanduser().resolve()
    if not images.is_dir():
        raise UserError(f"--images {images}: no such folder")
    target = folder / "config" / "config.yaml"
    if (folder / "Snakefile").is_file() and target.is_file() and not force:
        raise UserError(f"{target} exists; use another folder, or --force to replace it")
    settings = job_settings(
        template, images, _absolute(model), prompts_from(images, prompts, extra.get("instance_prompt")), **extra
    )
    cfg = config.from_dict(settings)
    config.check_user_config(cfg)
    _check_family(template, cfg)
    header = [
        f"sdpipe job from template {template}: {templates.summary(template)}",
        "Keys not listed take the schema's defaults; `sdpipe check-config --print` shows every effective value.",
        f"Written by: sdpipe init --template {template} (edit freely)",
        "",
    ]
    pod.seed_project(folder, source or workflow_source())
    target.parent.mkdir(parents=True, exist_ok=True)
    io.write_text(target, render(settings, templates.comments(template), header))
    dvc_file.write(folder, cfg)
    return target


def add_arguments(p) -> None:
    p.add_argument("folder", nargs="?", default=".", help="the project folder (made if missing; default: here)")
    p.add_argument("--template", "-t", help="the job: " + ", ".join(templates.names()))
    p.add_argument("--images", help="the folder of your images (nested folders and sidecar captions are fine)")
    p.add_argument("--model", help="the base model: a hub id, a local diffusers folder or a .safetensors/.ckpt file")
    p.add_argument("--revision", help="hub revision (branch, tag or commit) of the model")
    p.add_argument("--variant", help="weight variant, e.g. fp16")
    p.add_argument("--prompt", action="append", default=[], help="a validation/evaluation prompt (repeatable)")
    p.add_argument("--instance-prompt", help='DreamBooth: the caption of your subject\'s photos ("a photo of sks dog")')
    p.add_argument("--class-prompt", help='DreamBooth: its class ("a photo of a dog")')
    p.add_argument("--force", action="store_true", help="replace an existing config/config.yaml")
    p.add_argument("--list", action="store_true", help="list the templates and exit")


def run(args) -> int:
    if args.list:
        for name in templates.names():
            print(f"{name:24} {templates.summary(name)}")
        return 0
    missing = [flag for flag in ("template", "images", "model") if not getattr(args, flag)]
    if missing:
        raise UserError(f"init needs --{', --'.join(missing)} (sdpipe init --list shows the templates)")
    folder = Path(args.folder)
    target = init(
        folder,
        args.template,
        Path(args.images),
        args.model,
        args.prompt,
        args.force,
        revision=args.revision,
        variant=args.variant,
        instance_prompt=args.instance_prompt,
        class_prompt=args.class_prompt,
    )
    print(f"wrote {target}")
    from sdpipe import plan
    from sdpipe.config import load

    previous = os.getcwd()
    os.chdir(folder)  # the plan counts images and finds models as the workflow will, from the project
    try:
        for line in plan.lines(load("config/config.yaml")):
            print(f"  {line}")
    finally:
        os.chdir(previous)
    where = (
        "" if folder.resolve() == Path.cwd() else f"cd {json.dumps(str(folder)) if ' ' in str(folder) else folder} && "
    )
    print(f"next: {where}snakemake --profile runpod")
    return 0
