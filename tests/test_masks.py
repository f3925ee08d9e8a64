"""Loss masks (data.masks, train.masked_loss): the loss ignores what the mask hides, the mask follows its image's
crop and flip onto the latent grid, masks join the cache without re-encoding a latent, and a template job trains
with mask files through the whole DAG (tests/test_features_dag.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from sdpipe import config, io
from sdpipe.latents import masks
from sdpipe.preprocess import Preprocess
from sdpipe.stages import latents
from sdpipe.train.data import LatentData
from sdpipe.train.objective import masked_mean
from tests.conftest import small_config
from tests.test_latents import make_inputs


def test_the_loss_and_its_gradient_are_zero_outside_the_mask():
    torch.manual_seed(0)
    pred, target = torch.randn(2, 4, 8, 8, requires_grad=True), torch.randn(2, 4, 8, 8)
    mask = torch.zeros(2, 1, 8, 8)
    mask[..., :4] = 1.0  # the left half counts
    elsewhere = target.clone()
    elsewhere[..., 4:] += 5.0  # a different target outside the mask only
    loss = masked_mean((pred - target).pow(2), mask, 0.0)
    assert torch.equal(loss, masked_mean((pred - elsewhere).pow(2), mask, 0.0))
    loss.sum().backward()
    assert pred.grad is not None
    assert (pred.grad[..., 4:] == 0).all() and (pred.grad[..., :4] != 0).all()

    err = (pred.detach() - elsewhere).pow(2)
    torch.testing.assert_close(masked_mean(err, torch.ones_like(mask), 0.0), err.mean(dim=(1, 2, 3)))
    inside = err[..., :4].mean(dim=(1, 2, 3))
    torch.testing.assert_close(masked_mean(err, mask, 0.0), inside)  # a weighted mean: the area does not shrink it
    assert (masked_mean(err, mask, 0.1) > inside).all()  # some weight outside, where the error is larger
    assert torch.equal(masked_mean(err, torch.zeros_like(mask), 0.0), torch.zeros(2))  # all black: 0, not NaN


def _job(tmp: Path, source: str, image: Path, mask_file: Path | None = None, flip: bool = False) -> dict:
    pre = Preprocess(bucket=(32, 32), flip=flip).as_key()
    return {"source": source, "file": str(image), "mask_file": mask_file and str(mask_file), "pre": pre}


def _half_opaque(path: Path, size=(64, 32)) -> Path:
    """An RGBA image whose left half is opaque."""
    img = Image.new("RGBA", size, (200, 30, 30, 0))
    img.paste((200, 30, 30, 255), (0, 0, size[0] // 2, size[1]))
    img.save(path)
    return path


def _compute(job: dict, size=(64, 32)) -> torch.Tensor:
    return masks.compute(job | {"id": "x", "size": list(size), "downsample": 4})


def test_a_mask_follows_its_images_crop_and_flip_onto_the_latent_grid(tmp_path):
    # 64 x 32 covers the 32 x 32 bucket at scale 1 and is cut at x 16..48: the opaque x < 32 becomes the crop's
    # left half, on the 8 x 8 latent grid columns 0-3.
    image = _half_opaque(tmp_path / "cat.png")
    want = torch.zeros(1, 8, 8, dtype=torch.float16)
    want[..., :4] = 1.0
    assert torch.equal(_compute(_job(tmp_path, "alpha", image)), want)
    assert torch.equal(_compute(_job(tmp_path, "alpha", image, flip=True)), want.flip(-1))
    # the same mask as a file, drawn at twice the image's size
    drawn = Image.new("L", (128, 64), 0)
    drawn.paste(255, (0, 0, 64, 64))
    drawn.save(tmp_path / "cat_mask.png")
    rgb = tmp_path / "cat.jpg"
    Image.new("RGB", (64, 32), (1, 2, 3)).save(rgb)
    assert masks.mask_file(rgb, "_mask") == tmp_path / "cat_mask.png"
    scaled = _compute(_job(tmp_path, "file", rgb, tmp_path / "cat_mask.png"))
    torch.testing.assert_close(scaled, want, atol=0.05, rtol=0)  # resizing softens the edge cells a little
    # no mask file, or no alpha channel: every pixel counts
    assert torch.equal(_compute(_job(tmp_path, "file", rgb)), torch.ones(1, 8, 8, dtype=torch.float16))
    assert torch.equal(_compute(_job(tmp_path, "alpha", rgb)), torch.ones(1, 8, 8, dtype=torch.float16))


def _latents(tmp: Path, raw: Path, model: Path, out: str, masks_source: str) -> dict:
    raw_cfg = small_config(tmp, raw, model, data={"masks": {"source": masks_source}}, latents={"flip": True})
    outputs = {"index": tmp / out / "index.json", "summary": tmp / out / "summary.json"}
    inputs = {"manifest": tmp / "manifest.jsonl", "captions": tmp / "captions.jsonl"}
    latents.run(config.from_dict(raw_cfg), inputs, outputs)
    return io.read_json(outputs["summary"])


def test_masks_join_the_cache_without_re_encoding_a_latent(tmp_path, tiny_model):
    raw, _, _ = make_inputs(tmp_path, 4)
    assert _latents(tmp_path, raw, tiny_model, "plain", "none")["encoded"] == 4
    with_masks = _latents(tmp_path, raw, tiny_model, "masked", "alpha")
    assert (with_masks["encoded"], with_masks["reused"]) == (0, 4), "a latent does not depend on its mask"
    assert with_masks["masks"] == {"source": "alpha", "masks": 8, "computed": 8}  # flipped and not
    again = _latents(tmp_path, raw, tiny_model, "again", "alpha")
    assert again["masks"]["computed"] == 0 and again["encoded"] == 0
    data = LatentData(tmp_path / "masked" / "index.json")
    batch = data.batch([0, 2], flips=[False, True], drop_caption=[False, False])  # one bucket
    assert batch["mask"].shape == (2, 1, *batch["latents"].shape[-2:])
    assert torch.equal(batch["mask"], torch.ones_like(batch["mask"]))  # the test images are opaque
