# Config validation and small helpers only; stage logic lives in the sdpipe package.
import sys
from pathlib import Path

from sdpipe.errors import UserError
from sdpipe.config import validate_dict
from sdpipe.parallel import detect_gpu_count, resolve_gpus
from sdpipe import io as sdpipe_io

# Validate against workflow/schemas/config.schema.yaml before any job is planned; a bad value stops here with
# one line naming the key, the value and what is allowed.
try:
    CFG = validate_dict(config)
except UserError as exc:
    sys.stderr.write(f"sdpipe: {exc}\n")
    sys.exit(2)

# Stages read the config Snakemake resolved (config file plus any --config overrides, defaults filled in).
RESOLVED_CONFIG = "results/config.resolved.yaml"
if not Path(RESOLVED_CONFIG).is_file() or sdpipe_io.read_yaml(RESOLVED_CONFIG) != CFG:
    sdpipe_io.write_yaml(RESOLVED_CONFIG, CFG)

# The local executor enforces the gpu resource only if a global limit exists; when the command line or the
# profile sets none, the limit is the number of GPUs this machine has (0 on a CPU-only machine).
if "gpu" not in workflow.global_resources:
    workflow.register_resource("gpu", detect_gpu_count())
_limit = workflow.global_resources["gpu"]
GPU_LIMIT = int(getattr(_limit, "value", _limit))


def gpus_for(section):
    """The GPUs a stage asks for: its config value ("auto" = all), never more than the global limit."""
    return min(resolve_gpus(CFG[section]["gpus"]), GPU_LIMIT)


def train_processes():
    """Training processes: train.num_processes, or every GPU the limit allows ("auto"; 1 on a CPU)."""
    wanted = CFG["train"]["num_processes"]
    if wanted == "auto":
        return max(1, min(detect_gpu_count(), GPU_LIMIT))
    return int(wanted)


def train_gpus():
    """GPUs held for training (one per process), none on a CPU-only machine."""
    return min(train_processes(), GPU_LIMIT)


MODEL = CFG["model"]["pretrained"]
BUILD_PRESET = CFG["model"]["build_preset"]
RAW_DIR = CFG["data"]["raw_dir"]


def raw_files(wildcards):
    """Every file under the raw folder, so adding or changing one image reruns prepare."""
    root = Path(RAW_DIR)
    if not root.is_dir():
        return []
    files = (p for p in root.rglob("*") if p.is_file())
    return sorted(str(p) for p in files if not any(s.startswith(".") for s in p.relative_to(root).parts))


def model_files(wildcards):
    """The base model folder when the workflow builds it from a preset; a real checkpoint is not a DAG file."""
    return [MODEL] if BUILD_PRESET else []
