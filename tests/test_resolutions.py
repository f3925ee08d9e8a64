"""prepare.buckets.also_at: several resolutions in one run. Every training image is bucketed again at each further
resolution (a sample per epoch each); held-out images stay at the main resolution."""

from __future__ import annotations

from collections import Counter

from sdpipe import config, io
from sdpipe.stages import prepare
from tests.conftest import small_config


def test_each_training_image_is_also_bucketed_at_each_further_resolution(tmp_path, tiny_model, demo_source):
    buckets = {"resolution": 32, "step": 8, "also_at": [48, 64]}
    raw_cfg = small_config(tmp_path, demo_source, tiny_model, prepare={"buckets": buckets, "eval_fraction": 0.25})
    outputs = {"manifest": tmp_path / "m.jsonl", "rejected": tmp_path / "r.jsonl", "summary": tmp_path / "p.json"}
    prepare.run(config.from_dict(raw_cfg), {}, outputs)
    rows = io.read_jsonl(outputs["manifest"])
    train_ids = {r["id"] for r in rows if r["split"] == "train"}
    per_id = Counter(r["id"] for r in rows)
    assert all(per_id[i] == 3 for i in train_ids) and all(per_id[r["id"]] == 1 for r in rows if r["split"] == "eval")
    for image_id in train_ids:
        sides = sorted((r["bucket"][0] * r["bucket"][1]) ** 0.5 for r in rows if r["id"] == image_id)
        assert all(abs(s - want) <= 0.2 * want for s, want in zip(sides, (32, 48, 64))), sides  # ~resolution² px
    assert io.read_json(outputs["summary"])["also_at"] == {"resolutions": [48, 64], "rows": 2 * len(train_ids)}
