"""The evaluate metrics: FID maths against scipy and torch-fidelity, FID from images through a small feature network,
the real InceptionV3 path with random weights, CLIP score with a tiny open_clip model, and null results with reasons
when weights are missing."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sdpipe.errors import UserError
from sdpipe.evaluate import clip_score, fetch, fid

INCEPTION_FILE = fid.WEIGHT_NAMES[0]


def scipy_fid(f1: np.ndarray, f2: np.ndarray) -> float:
    """The reference: pytorch-fid's formula with scipy's matrix square root."""
    linalg = pytest.importorskip("scipy.linalg", reason="scipy is the FID reference (a dev dependency)")
    mu1, mu2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    covmean = linalg.sqrtm(s1 @ s2).real
    return float((mu1 - mu2) @ (mu1 - mu2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def features(n: int, d: int, seed: int, shift: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) / np.sqrt(d) + shift


def images(n: int, seed: int, brightness: int = 0, sizes=((32, 32), (24, 40))) -> list:
    """RGB noise images, by default in two sizes, so feature extraction has to batch by size."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(
            np.clip(rng.integers(0, 200, (*sizes[i % len(sizes)], 3)) + brightness, 0, 255).astype(np.uint8)
        )
        for i in range(n)
    ]


def small_network(dims: int = 8, device: str = "cpu"):
    """A fixed random conv net standing in for InceptionV3: uint8 batch -> (n, dims)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = (
        nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2),
            nn.ReLU(),
            nn.Conv2d(16, dims, 3, stride=2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        .eval()
        .to(device)
    )
    return lambda batch: net(batch.float() / 255)


def one_by_one(feature_fn, imgs: list) -> np.ndarray:
    import torch

    with torch.no_grad():
        return np.stack(
            [feature_fn(torch.from_numpy(np.array(im)).permute(2, 0, 1)[None])[0].double().numpy() for im in imgs]
        )


# --- FID maths --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, d, shift", [(200, 8, 0.0), (300, 32, 0.5), (100, 64, -2.0)])
def test_frechet_distance_matches_scipy(n, d, shift):
    f1, f2 = features(n, d, 1), features(n, d, 2, shift)
    value = fid.frechet_distance(*fid.feature_stats(f1), *fid.feature_stats(f2))
    assert value == pytest.approx(scipy_fid(f1, f2), rel=1e-7, abs=1e-9)


@pytest.mark.parametrize("n", [200, 20])  # 20 images of 64-d features: singular covariances
def test_frechet_distance_matches_torch_fidelity(n):
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    f1, f2 = features(n, 64, 3), features(n, 64, 4, 0.3)
    stats = [dict(zip(("mu", "sigma"), fid.feature_stats(f))) for f in (f1, f2)]
    expected = fid_statistics_to_metric(*stats, verbose=False)["frechet_inception_distance"]
    value = fid.frechet_distance(stats[0]["mu"], stats[0]["sigma"], stats[1]["mu"], stats[1]["sigma"])
    assert value == pytest.approx(expected, rel=1e-6)


def test_identical_sets_give_zero_and_bad_inputs_raise():
    mu, sigma = fid.feature_stats(features(50, 16, 5))
    assert abs(fid.frechet_distance(mu, sigma, mu, sigma)) < 1e-9
    mu_s, sigma_s = fid.feature_stats(features(5, 16, 6))  # rank 4 of 16
    assert abs(fid.frechet_distance(mu_s, sigma_s, mu_s, sigma_s)) < 1e-9
    with pytest.raises(ValueError, match="shape"):
        fid.frechet_distance(mu, sigma, mu[:8], sigma[:8, :8])
    with pytest.raises(ValueError, match="NaN"):
        fid.frechet_distance(mu * np.nan, sigma, mu, sigma)
    with pytest.raises(ValueError, match="n >= 2"):
        fid.feature_stats(features(1, 16, 7))


# --- FID from images --------------------------------------------------------------------------------------------------


def test_fid_from_images_matches_scipy_on_the_same_features():
    net = small_network()
    real, fake = images(30, 1), images(30, 2, brightness=40)
    result = fid.fid_from_images(fake, real, net, batch_size=4)
    expected = scipy_fid(one_by_one(net, fake), one_by_one(net, real))
    assert result["value"] == pytest.approx(expected, rel=1e-5) and result["value"] > 0
    assert (result["reason"], result["n_real"], result["n_fake"], result["dims"]) == (None, 30, 30, 8)
    assert result["note"] is None  # 30 images of 8-d features: full rank
    same = fid.fid_from_images(real, real, net)
    assert abs(same["value"]) < 1e-6


def test_fid_against_reference_stats_file(tmp_path, monkeypatch):
    net = small_network()
    real, fake = images(30, 1), images(30, 2, brightness=40)
    mu, sigma = fid.feature_stats(one_by_one(net, real))
    np.savez(tmp_path / "ref.npz", mu=mu.astype(np.float32), sigma=sigma.astype(np.float32))  # as tools save them
    monkeypatch.setattr(fid, "find_inception", lambda configured: (tmp_path / "stand-in.pth", None))
    monkeypatch.setattr(fid, "load_inception", lambda path, device: net)
    result = fid.fid(fake, reference_stats=str(tmp_path / "ref.npz"))
    assert result["value"] == pytest.approx(fid.fid_from_images(fake, real, net)["value"], rel=1e-4)
    assert (result["reference"], result["n_real"], result["n_fake"]) == (str(tmp_path / "ref.npz"), None, 30)
    with pytest.raises(UserError, match="16-d but the features are 8-d"):
        fid.fid_from_features(fid.extract_features(fake, net), np.zeros(16), np.eye(16), n_real=None)
    np.savez(tmp_path / "bad.npz", mean=mu)
    with pytest.raises(UserError, match="evaluate.fid.reference_stats.*mu and sigma"):
        fid.fid(fake, reference_stats=str(tmp_path / "bad.npz"))


def test_too_small_split_is_a_clear_error_before_anything_runs(monkeypatch):
    with pytest.raises(UserError, match=r"at least 2 images.*1 held-out real.*prepare.eval_fraction.*more than 2048"):
        fid.check_fid_split(1, 10)
    with pytest.raises(UserError, match="0 generated"):
        fid.check_fid_split(None, 0)
    assert "needs more than 2048 images to be full rank" in fid.check_fid_split(10, 500)
    assert fid.check_fid_split(3000, 2049) is None and fid.check_fid_split(None, 5000) is None
    monkeypatch.setattr(fid, "find_inception", lambda *a: pytest.fail("looked for weights"))
    with pytest.raises(UserError, match="prepare.eval_fraction"):
        fid.fid(images(4, 1), real=images(1, 2))


def test_missing_inception_weights_give_null_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    result = fid.fid(images(3, 1), real=images(3, 2))
    expected = tmp_path / "torch" / "hub" / "checkpoints" / INCEPTION_FILE
    assert result["value"] is None and str(expected) in result["reason"]
    assert "sdpipe fetch-weights" in result["reason"] and fid.INCEPTION_KEY in result["reason"]
    assert (result["n_real"], result["n_fake"], result["reference"]) == (3, 3, "eval split")
    configured = fid.fid(images(3, 1), real=images(3, 2), inception_weights=str(tmp_path / "mine.pth"))
    assert configured["value"] is None and str(tmp_path / "mine.pth") in configured["reason"]


def test_standard_inception_found_in_torch_home_and_run(tmp_path, monkeypatch):
    """torch-fidelity's InceptionV3, found in $TORCH_HOME and run for real. Its random weights shrink every feature
    to ~1e-7, so this checks the path and shapes; the small-network tests check the values (and a 2048-d FID takes
    a minute on a busy 2-core CI machine)."""
    import torch
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    torch.save({}, tmp_path / "empty.pth")
    with monkeypatch.context() as m:  # build the network without weights, then save its random ones
        m.setattr(FeatureExtractorInceptionV3, "load_state_dict", lambda self, state_dict: None)
        net = FeatureExtractorInceptionV3("x", ["2048"], feature_extractor_weights_path=str(tmp_path / "empty.pth"))
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(net.state_dict(), folder / fid.WEIGHT_NAMES[1])  # pytorch-fid's name is found too
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    path, reason = fid.find_inception()
    assert (path, reason) == (folder / fid.WEIGHT_NAMES[1], None)
    out = fid.extract_features(images(3, 1), fid.load_inception(path), batch_size=2)
    assert out.shape == (3, fid.INCEPTION_DIMS) and out.dtype == np.float64 and np.isfinite(out).all()
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not the FID InceptionV3 weights file.*sdpipe fetch-weights"):
        fid.load_inception(path)


# --- CLIP score -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> SimpleNamespace:
    import open_clip
    import torch

    root = tmp_path_factory.mktemp("clip")
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    (root / "sdpipe-metrics-clip.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(root / "sdpipe-metrics-clip.json")
    torch.manual_seed(1)  # a seed whose random model gives both positive and negative cosines below
    torch.save(open_clip.create_model("sdpipe-metrics-clip").state_dict(), root / "clip.pt")
    return SimpleNamespace(
        model="sdpipe-metrics-clip",
        pretrained=str(root / "clip.pt"),
        model_config=str(root / "sdpipe-metrics-clip.json"),
    )


def manual_scores(settings, imgs: list, prompts: list[str]) -> list[float]:
    import open_clip
    import torch

    model, _, preprocess = open_clip.create_model_and_transforms(settings.model, pretrained=settings.pretrained)
    with torch.no_grad():
        a = model.eval().encode_image(torch.stack([preprocess(im) for im in imgs]))
        b = model.encode_text(open_clip.get_tokenizer(settings.model)(prompts))
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return [100 * max(c, 0.0) for c in cos.tolist()]


def test_clip_score_matches_a_manual_cosine(tiny_clip):
    imgs = images(5, 3)
    prompts = ["a red circle", "noise", "a red circle", "a blue square on white", "a red circle"]
    expected = manual_scores(tiny_clip, imgs, prompts)
    found, reason = clip_score.locate(tiny_clip)
    assert reason is None and found["weights"] == tiny_clip.pretrained
    assert clip_score.load(found)(imgs, prompts) == pytest.approx(expected, abs=1e-4)
    assert any(v > 0 for v in expected) and 0.0 in expected  # both sides of the clamp at 0 are checked
    result = clip_score.clip_score(imgs, prompts, tiny_clip, batch_size=2)
    assert 0 <= result["value"] <= 100 and result["value"] == pytest.approx(np.mean(expected), abs=1e-4)
    assert (result["reason"], result["n"], result["model"]) == (None, 5, "sdpipe-metrics-clip")
    with pytest.raises(ValueError, match="one prompt per image"):
        clip_score.clip_score(imgs, prompts[:2], tiny_clip)


def test_missing_clip_weights_give_null_with_the_fix(tmp_path, tiny_clip, monkeypatch):
    from huggingface_hub import constants

    gone = SimpleNamespace(**{**vars(tiny_clip), "pretrained": str(tmp_path / "gone.pt")})
    result = clip_score.clip_score(images(2, 1), ["a", "b"], gone)
    assert result["value"] is None and "gone.pt does not exist" in result["reason"]
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # an empty Hugging Face cache
    result = clip_score.clip_score(images(2, 1), ["a", "b"], clip_score.ClipSettings())
    assert result["value"] is None and result["pretrained"] == "laion2b_s34b_b79k"
    assert "hf download laion/CLIP-ViT-B-32-laion2B-s34B-b79K" in result["reason"]
    assert "sdpipe fetch-weights" in result["reason"]


def test_clip_config_mistakes_raise_with_this_metrics_keys():
    with pytest.raises(UserError, match="evaluate.clip_score.model = 'no-such-arch'"):
        clip_score.locate(clip_score.ClipSettings(model="no-such-arch"))
    with pytest.raises(UserError, match="evaluate.clip_score.pretrained = 'no-such-tag'"):
        clip_score.locate(clip_score.ClipSettings(pretrained="no-such-tag"))


@pytest.mark.gpu
def test_metrics_on_gpu_match_cpu(tiny_clip):
    imgs, prompts = images(5, 3), ["a red circle", "noise", "a red circle", "a blue square on white", "a red circle"]
    on_cpu = clip_score.clip_score(imgs, prompts, tiny_clip)
    on_gpu = clip_score.clip_score(imgs, prompts, tiny_clip, device="cuda", batch_size=2)
    assert on_gpu["value"] == pytest.approx(on_cpu["value"], abs=0.05)
    real, fake = images(30, 1), images(30, 2, brightness=40)
    expected = fid.fid_from_images(fake, real, small_network())["value"]
    got = fid.fid_from_images(fake, real, small_network(device="cuda"), device="cuda")["value"]
    assert got == pytest.approx(expected, rel=1e-2)  # cuDNN may use TF32 for the convolutions


# --- fetch-weights offline --------------------------------------------------------------------------------------------


def test_fetch_weights_offline_fails_with_one_line(tmp_path, monkeypatch):
    from urllib.error import URLError

    import torch.hub
    from huggingface_hub import constants

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(
        torch.hub, "download_url_to_file", lambda *a, **k: (_ for _ in ()).throw(URLError("Name or service not known"))
    )
    with pytest.raises(UserError) as err:
        fetch.fetch_inception()
    assert "\n" not in str(err.value) and "no internet" in str(err.value) and INCEPTION_FILE in str(err.value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(UserError) as err:  # HF_HUB_OFFLINE=1 (conftest) stands in for no network
        fetch.fetch_clip()
    assert "\n" not in str(err.value) and "no internet" in str(err.value)
    monkeypatch.setattr(torch.hub, "download_url_to_file", lambda url, dst, **k: Path(dst).write_bytes(b"w"))
    assert fetch.fetch_inception().endswith("(downloaded)") and fetch.fetch_inception().endswith("(already here)")
