"""What verifying the cache's checksums costs: write shards of SD 1.5-sized latents, then time reading them plain
and verifying them (the latents stage verifies every shard before reuse; training's rank 0 verifies each shard it
opens). Prints MB/s of each and the share verification adds to a plain read.

    python scripts/bench_cache_verify.py --shards 4 --shard-mb 256 --dir /tmp/cache-bench
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from sdpipe.cache_store import ShardStore, problem


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--shard-mb", type=int, default=256)
    p.add_argument("--dir", type=Path, default=Path("/tmp/sdpipe-cache-bench"))
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    store = ShardStore(args.dir)
    per_entry = 4 * 64 * 64 * 2  # one 512 px SD 1.5 latent in fp16
    entries = args.shard_mb * (1 << 20) // per_entry
    from safetensors.torch import save_file

    write_s = plain_write_s = 0.0
    for s in range(args.shards):
        shard = {f"s{s}e{i}": {"latent": torch.randn(4, 64, 64).half()} for i in range(entries)}
        start = time.perf_counter()
        save_file({f"{k}/latent": v["latent"] for k, v in shard.items()}, str(args.dir / f".plain-{s}"))
        plain_write_s += time.perf_counter() - start
        (args.dir / f".plain-{s}").unlink()
        start = time.perf_counter()
        store.write_shard(shard)
        write_s += time.perf_counter() - start
    mb = sum(f.stat().st_size for f in store.shards()) / (1 << 20)
    start = time.perf_counter()
    for f in store.shards():
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    bad = [f for f in store.shards() if problem(f)]
    verify_s = time.perf_counter() - start
    assert not bad
    print(f"{args.shards} shards, {mb:.0f} MB, {entries} latents each (page cache warm after writing)")
    print(f"write: plain safetensors {mb / plain_write_s:.0f} MB/s, with checksum {mb / write_s:.0f} MB/s")
    print(
        f"plain read: {mb / read_s:.0f} MB/s; "
        f"verify: {mb / verify_s:.0f} MB/s ({verify_s:.2f} s, {verify_s / read_s:.1f}x a plain read)"
    )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
