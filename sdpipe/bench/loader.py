"""Time the training data loader alone: `loop.load_batch` (cache read, draws, pinned copy) for N batches.

python -m sdpipe.bench.loader TRAIN_CONFIG INDEX BATCHES   -> one JSON line on stdout
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def measure(config_path: str, index: str, batches: int) -> dict:
    import torch

    from sdpipe import config
    from sdpipe.train import loop

    cfg = config.load(config_path, [])
    with tempfile.TemporaryDirectory() as out:
        run = loop.build(cfg, Path(index), Path(out))
        loop.resume(run)  # train.resume is None in the bench config: a fresh sampler state
        chunks = run.sampler.remaining(run.state)
        picked = [chunks[i % len(chunks)] for i in range(batches + 2)]
        for chunk in picked[:2]:  # page the shards in, as the first steps of training do
            loop.load_batch(run, chunk, 0)
        samples, start = 0, time.perf_counter()
        for chunk in picked[2:]:
            loop.load_batch(run, chunk, 0)
            samples += len(chunk)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
