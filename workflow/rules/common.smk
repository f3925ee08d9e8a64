# Config validation and small helpers only; stage logic lives in the sdpipe package.
import functools
import sys
from pathlib import Path

from snakemake_interface_executor_plugins.settings import ExecMode

from sdpipe.errors import UserError
from sdpipe.config import check_user_config, effective
from sdpipe.export.names import for_config as export_names
from sdpipe.parallel import detect_gpu_count, resolve_gpus
from sdpipe.prepare.files import fingerprint as folder_fingerprint
from sdpipe.stages.declared import settings as declared_settings
from sdpipe import io as sdpipe_io

# One effective config, the same as `sdpipe check-config --config FILE` gives: schema defaults, then the config
# file(s), then --config values. Snakemake itself merges --configfile over the Snakefile's config/config.yaml (the
# demo), so a user's own file would inherit the demo's settings; the files are read again here instead. A bad value
# stops here with one line naming the key, the value and what is allowed.
_USER_FILES = workflow.overwrite_configfiles or ["config/config.yaml"]
try:
    _cfg = effective(_USER_FILES, workflow.config_settings.config)
    check_user_config(_cfg)
    CFG = _cfg.raw
except UserError as exc:
    sys.stderr.write(f"sdpipe: {exc}\n")
    sys.exit(2)

# Stages read the config Snakemake resolved (config file plus any --config overrides, defaults filled in). The
# run that executes writes it once it holds the project's lock (onstart), never at parse time: a dry run, or a second
# run refused by the lock, must not change the file a running pipeline's stages read. A job Snakemake starts in a
# fresh process elsewhere (a Kubernetes pod without the project's files) parses the Snakefile again and writes its
# own copy there.
RESOLVED_CONFIG = "results/config.resolved.yaml"


def write_resolved_config():
    if not Path(RESOLVED_CONFIG).is_file() or sdpipe_io.read_yaml(RESOLVED_CONFIG) != CFG:
        sdpipe_io.write_yaml(RESOLVED_CONFIG, CFG)


if workflow.exec_mode != ExecMode.DEFAULT:
    write_resolved_config()


onstart:
    write_resolved_config()


# The local executor enforces the gpu resource only if a global limit exists; when the command line or the
# profile sets none, the limit is the number of GPUs this machine has (0 on a CPU-only machine).
if "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", detect_gpu_count())
_limit = workflow.global_resources["gpu"]
GPU_LIMIT = int(getattr(_limit, "value", _limit))


def settings_of(stage):
    """The config values a stage's outputs depend on (its module's READS): a rule's params.settings, so Snakemake
    reruns the stage when one of them changes, and only then."""
    return declared_settings(CFG, stage)


def gpus_for(section):
    """The GPUs a stage asks for: its config value ("auto" = all), never more than the global limit."""
    return min(resolve_gpus(CFG[section]["gpus"]), GPU_LIMIT)


def train_processes():
    """Training processes: train.num_processes, or every GPU the limit allows ("auto"). Where this machine sees no
    GPU (a CPU, or a cluster's login node), "auto" is left for `sdpipe train` to resolve where the job runs."""
    wanted = CFG["train"]["num_processes"]
    if wanted == "auto":
        gpus = min(detect_gpu_count(), GPU_LIMIT)
        return gpus if gpus else "auto"
    return int(wanted)


def train_gpus():
    """GPUs held for training (one per process), none where none is visible."""
    procs = train_processes()
    return 0 if procs == "auto" else min(procs, GPU_LIMIT)


# What the export writes, named by export.name (sdpipe/export/names.py is the one place that says it).
EXPORT_DIR = "results/export"
EXPORT_FILES = export_names(_cfg)


def export_weight_files():
    """The exported weight files beside the diffusers folder (single file, LoRA files), as rule outputs."""
    files = EXPORT_FILES.files()
    return {name: f"{EXPORT_DIR}/{path}" for name, path in files.items() if name != "diffusers"}


MODEL = CFG["model"]["pretrained"]
BUILD_PRESET = CFG["model"]["build_preset"]
RAW_DIR = CFG["data"]["raw_dir"]


# A raw folder's files as rule inputs cost Snakemake a stat, a metadata entry and memory per file per rule on every
# run: minutes and gigabytes at 10^6 images (issue 30). So prepare, the one rule that reads the folder as a whole,
# takes the folder's fingerprint (each file's path, size and times) as a param and reruns when it changes; the
# rules after it follow its manifest. Only where a storage provider must copy the files to each job are they
# listed as inputs.
STORAGE = workflow.storage_settings.default_storage_provider is not None


def raw_files(wildcards):
    """The raw folder's files, as inputs of the rules that read images, where a storage provider copies them. Not
    with data.raw_remote: prepare writes that folder, and the data stages read it on their shared volume."""
    return list(_raw_listing()) if STORAGE and not CFG["data"]["raw_remote"] else []


@functools.cache
def _raw_listing():
    """The raw folder's files, listed once per Snakemake run (only with a storage provider)."""
    root = Path(RAW_DIR)
    if not root.is_dir():
        return ()
    files = (p for p in root.rglob("*") if p.is_file())
    return tuple(sorted(str(p) for p in files if not any(s.startswith(".") for s in p.relative_to(root).parts)))


def raw_state(wildcards):
    """The fingerprint of data.raw_dir (or data.raw_remote's listing) and data.regularisation's folders: prepare
    reruns when it changes."""
    return _raw_state()


@functools.cache
def _raw_state():
    folders = [spec["dir"] for spec in CFG["data"]["regularisation"]]
    if CFG["data"]["raw_remote"]:  # prepare mirrors it into raw_dir: the listing decides, not the mirror
        from sdpipe import raw_remote

        remote = raw_remote.fingerprint(CFG["data"]["raw_remote"])
        return " ".join([remote] + [folder_fingerprint(Path(f)) for f in folders])
    return " ".join(folder_fingerprint(Path(folder)) for folder in [RAW_DIR] + folders)


def regularisation_files(wildcards):
    """data.regularisation's files, as prepare's inputs where a storage provider copies them."""
    if not STORAGE:
        return []
    found = []
    for spec in CFG["data"]["regularisation"]:
        root = Path(spec["dir"])
        if root.is_dir():
            found += sorted(str(p) for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    return found


# With model.train_vae, every stage after it uses the base pipeline with the trained VAE (rule train_vae).
TRAIN_VAE = CFG["model"]["train_vae"]["enabled"]
STAGE_MODEL = "results/vae/model" if TRAIN_VAE else MODEL


# Where a job sees its files. With a storage provider (`--default-storage-provider s3`, as profiles/kubernetes
# runs) Snakemake hands a job local copies under .snakemake/storage, not the paths the config names, so a stage
# whose config names an input is pointed at the copy. Arguments, a list: the rules quote each word
# ({params.model:q}), so no config value reaches a shell unquoted.
def use_model(wildcards, input):
    """The model the workflow made (a built preset, a trained VAE) or a single file, where the job sees it."""
    given = [str(f) for f in input.get("model", [])]
    return ["--set", f"model.pretrained={given[0]}"] if given and given[0] != MODEL else []


def use_raw_dir(wildcards, input):
    """data.raw_dir where the job sees it: the local copy's root, found from one raw file's copy (storage)."""
    given, listed = [str(f) for f in input.get("raw", [])], raw_files(wildcards)
    if not given or given[0] == listed[0]:
        return []
    return ["--set", f"data.raw_dir={given[0][: len(given[0]) - len(listed[0])]}{RAW_DIR}"]


def model_files(wildcards):
    """The model stages load when the workflow makes it (a built preset, a trained VAE), or a single-file checkpoint
    (replacing it reruns what used it); a real model folder or hub id is not a DAG file (its content hashes key the
    caches)."""
    if BUILD_PRESET or TRAIN_VAE:
        return [STAGE_MODEL]
    return [MODEL] if Path(MODEL).suffix in (".safetensors", ".ckpt") and Path(MODEL).is_file() else []


def base_model_files(wildcards):
    return [MODEL] if BUILD_PRESET else []


DREAMBOOTH = CFG["dreambooth"]["enabled"]
CLASS_IMAGES = "results/class_images/images"


def class_images(wildcards):
    """DreamBooth runs prepare the generated class images too."""
    return {"class_images": "results/class_images/summary.json"} if DREAMBOOTH else {}


def scaling_input(wildcards):
    """The scaling benchmark feeds evaluation only when benchmark.gpu_counts lists counts to time."""
    return {"scaling": "results/benchmark/scaling.json"} if CFG["benchmark"]["gpu_counts"] else {}


def benchmark_gpus():
    return min(max(CFG["benchmark"]["gpu_counts"] or [1]), GPU_LIMIT)
