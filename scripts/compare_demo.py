"""Compare the non-timing outputs of two demo runs (`make demo` in two checkouts): a refactor must leave them equal.

    python scripts/compare_demo.py BEFORE_PROJECT AFTER_PROJECT

Compares the manifest and caption rows, the latent index, the train, export and evaluate summaries (each without
its timings, paths and record versions), the trained weights and the evaluation images, byte for byte. Exits 1 when
anything differs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

# Keys that measure time or name where and from which commit something ran, not what was computed.
SKIPPED = ("seconds", "_s", "per_s", "time", "rendered_on", "elapsed", "peak_memory", "date", "path", "image", "commit")
ROWS = ("results/prepare/manifest.jsonl", "results/captions/captions.jsonl")
SUMMARIES = (
    "results/latents/index.json",
    "results/train/summary.json",
    "results/export/summary.json",
    "results/evaluate/metrics.json",
)


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "version" and not any(s in k for s in SKIPPED)}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def differences(before: Path, after: Path) -> list[str]:
    found = []
    for rel in ROWS:
        rows = [[_strip(json.loads(line)) for line in (p / rel).read_text().splitlines()] for p in (before, after)]
        if rows[0] != rows[1]:
            found.append(rel)
    for rel in SUMMARIES:
        a, b = (_strip(json.loads((p / rel).read_text())) for p in (before, after))
        found += [f"{rel}: {k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    for folder in ("results/train/final", "results/evaluate/samples"):
        for path in sorted((before / folder).rglob("*")):
            twin = after / path.relative_to(before)
            if path.is_file() and path.suffix in (".safetensors", ".png"):
                if not twin.is_file() or _digest(path) != _digest(twin):
                    found.append(str(path.relative_to(before)))
    return found


def main() -> int:
    before, after = Path(sys.argv[1]), Path(sys.argv[2])
    found = differences(before, after)
    for line in found:
        print("differs:", line)
    accuracy = json.loads((after / "results/evaluate/metrics.json").read_text()).get("colour_accuracy")
    print(f"colour accuracy after: {accuracy}")
    print("the same" if not found else f"{len(found)} differences")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
