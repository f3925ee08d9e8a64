"""`sdpipe bench-dag`'s data at scale (issue 30): the images as webdataset tar shards instead of loose files, in an
S3 bucket that prepare mirrors (data.raw_remote), and training again on a node that has no latent cache, its shards
coming from latents.remote."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from sdpipe import io

SHARD = 256  # images per tar shard


def pack_tar(raw: Path, per_shard: int = SHARD) -> int:
    """Move raw's JPEGs and their caption sidecars into webdataset shards (raw/NNNNNN.tar, `key.jpg` + `key.txt`),
    as a dataset downloaded with img2dataset arrives; return the number of shards."""
    images = sorted(raw.glob("*.jpg"))
    groups = [images[i : i + per_shard] for i in range(0, len(images), per_shard)]
    for n, group in enumerate(groups):
        tmp = raw / f"{n:06d}.tar.tmp"
        with tarfile.open(tmp, "w") as tf:
            for image in group:
                for member in (image, image.with_suffix(".txt")):
                    if member.is_file():
                        tf.add(member, arcname=member.name)
        tmp.rename(raw / f"{n:06d}.tar")
        for image in group:
            image.unlink()
            image.with_suffix(".txt").unlink(missing_ok=True)
    return len(groups)


def upload_raw(raw: Path, url: str) -> int:
    """Move raw's files to the S3 prefix (data.raw_remote), leaving raw empty: the dataset lives in a bucket and
    prepare mirrors it; how many objects."""
    from sdpipe import remote_store

    bucket, prefix = remote_store.split(url, "--raw-remote")
    files = sorted(p for p in raw.rglob("*") if p.is_file())
    for path in files:
        remote_store.client().upload_file(str(path), bucket, prefix + path.relative_to(raw).as_posix())
    shutil.rmtree(raw)
    raw.mkdir()
    return len(files)


def train_again(project: Path, name: str, steps: int) -> dict:
    """A short training run of the project's resolved config into results/<name>, from the index the DAG wrote;
    its start and steady rate, from its summary."""
    out = project / "results" / name
    shutil.rmtree(out, ignore_errors=True)
    settings = {
        "train.max_steps": steps,
        "train.resume": "null",
        "train.checkpoint_every": 0,
        "train.validation.every": 0,
        "train.save_final": "false",
        "train.log_every": 5,
    }
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    cmd = [sys.executable, "-m", "sdpipe", "train", "--config", "results/config.resolved.yaml", *sets]
    cmd += ["--index", "results/latents/index.json", "--out", str(out), "--summary", str(out / "summary.json")]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise RuntimeError(f"sdpipe train ({name}) failed with exit {proc.returncode} in {project}")
    summary = io.read_json(out / "summary.json")
    return {
        "steps": steps,
        "stage_s": round(time.perf_counter() - start, 3),
        **{k: summary.get(k) for k in ("time_to_first_step_s", "compile_s", "warmup_s", "samples_per_s")},
    }


def train_from_remote(project: Path, steps: int) -> dict:
    """Training as on a second node: the latent and text stores are moved aside, so every shard (and each store's
    index.json) is fetched from latents.remote on first use. Reports the run and what it fetched."""
    index = io.read_json(project / "results" / "latents" / "index.json")
    if not index.get("remote_stores"):
        raise RuntimeError("results/latents/index.json names no remote stores: was latents.remote set?")
    roots = [project / index[key] for key in ("latent_store", "text_store")]
    local = {str(root): _files(root) for root in roots}
    for root in roots:
        shutil.rmtree(root.with_name(root.name + ".local"), ignore_errors=True)
        root.rename(root.with_name(root.name + ".local"))
    result = train_again(project, "from-remote", steps)
    fetched = {str(root): _files(root) for root in roots}
    result["fetched_files"] = sum(len(names) for names in fetched.values())
    result["fetched_mb"] = round(sum(_size(root) for root in roots) / 1e6, 3)
    result["local_files"] = sum(len(names) for names in local.values())
    result["fetched_a_subset_of_local"] = all(fetched[k] <= local[k] for k in local)
    return result


def _files(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_file() and not p.name.startswith(".")} if root.is_dir() else set()


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file()) if root.is_dir() else 0
