"""The latent cache's shards on an S3-compatible store (latents.remote), for training on nodes that do not share
a disk with the one that encoded (issue 30).

The latents stage publishes each shard store (cache/latents, cache/text) under the remote prefix: only the shards
the prefix lacks are uploaded, so a rerun that added images uploads the shard it wrote, and the store's index.json.
Shards are written once and never changed (sdpipe/cache_store.py), so a name is enough to know a shard is there.

Training reads the index that the latents stage wrote (moved by Snakemake storage or DVC like any output). A shard
it needs and does not find in the local store is downloaded there whole, the first time a sample needs it, then
memory-mapped and verified like a local one. Every rank and every node fetches only what its samples read.

The endpoint and the keys come from the environment, as for the aws CLI: AWS_ENDPOINT_URL (MinIO, R2, a pod
provider's S3 API), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION.
"""

from __future__ import annotations

import functools
import logging
import os
import uuid
from pathlib import Path

from sdpipe.errors import UserError

log = logging.getLogger(__name__)


def split(url: str, key: str = "latents.remote") -> tuple[str, str]:
    """("bucket", "prefix/") of s3://bucket/prefix; `key` names the setting in the error."""
    if not url.startswith("s3://") or len(url) <= 5:
        raise UserError(f"{key} {url!r}: expected s3://bucket/prefix")
    bucket, _, prefix = url[5:].partition("/")
    return bucket, prefix.strip("/") + "/" if prefix.strip("/") else ""


def client():
    """An S3 client for the environment's endpoint and keys (one per endpoint in a process)."""
    return _client(os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_ACCESS_KEY_ID"))


@functools.cache
def _client(endpoint: str | None, key_id: str | None):
    try:
        import boto3
    except ImportError as exc:
        raise UserError("an s3:// store needs boto3: pip install 'sdpipe[workflow]'") from exc
    return boto3.client("s3", endpoint_url=endpoint)


def _names(bucket: str, prefix: str) -> set[str]:
    pages = client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {obj["Key"][len(prefix) :] for page in pages for obj in page.get("Contents", [])}


def publish(root: Path, url: str) -> dict:
    """Upload the store's shards that `url` lacks, then its index.json; {"uploaded", "present"} shard counts."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split(url)
    shards = sorted(root.glob("shard-*.safetensors"))
    try:
        there = _names(bucket, prefix)
        new = [s for s in shards if s.name not in there]
        for shard in new:
            client().upload_file(str(shard), bucket, prefix + shard.name)
        client().upload_file(str(root / "index.json"), bucket, prefix + "index.json")
    except (BotoCoreError, ClientError) as exc:
        raise UserError(f"cannot publish {root} to {url}: {exc}") from exc
    log.info("latents: %s: %d shard(s) uploaded, %d already there", url, len(new), len(shards) - len(new))
    return {"uploaded": len(new), "present": len(shards) - len(new)}


def fetch(url: str, name: str, root: Path) -> Path:
    """Download `name` (a shard or index.json) from `url` into `root` whole, under a temporary name first, so a
    reader never sees half a file; two ranks fetching the same shard each write their own and the last rename wins."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split(url)
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    tmp = root / f".fetch-{uuid.uuid4().hex[:12]}-{name}"
    try:
        client().download_file(bucket, prefix + name, str(tmp))
    except (BotoCoreError, ClientError) as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot fetch {name} from {url}: {exc}; rerun `snakemake latents` to publish it") from exc
    os.replace(tmp, target)
    return target
