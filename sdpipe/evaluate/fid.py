"""FID of generated images against the held-out real images (or a reference statistics file).

Features are the standard FID InceptionV3 pool3 features (2048-d) from torch-fidelity's FeatureExtractorInceptionV3
with the converted TensorFlow weights, fed uint8 images that it resizes to 299x299 the TF1 way, as torch-fidelity
does; torchmetrics downloads the same weights file. Nothing here downloads: the weights file is looked up in torch
hub's checkpoint folder (or a configured path) and, when absent, the metric is null with the reason and the fix.

The feature network is a parameter (any function from a uint8 N x 3 x H x W batch to N x d features), so tests
can check the maths with a small network.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

import numpy as np

from sdpipe.errors import UserError
from sdpipe.evaluate import measured, unavailable

INCEPTION_KEY = "evaluate.fid.inception_weights"
REFERENCE_KEY = "evaluate.fid.reference_stats"
INCEPTION_DIMS = 2048
# torch-fidelity's (and torchmetrics') download name first, then pytorch-fid's name for the same converted weights.
WEIGHT_NAMES = ("weights-inception-2015-12-05-6726825d.pth", "pt_inception-2015-12-05-6726825d.pth")

FeatureFn = Callable  # uint8 tensor (N, 3, H, W) -> float tensor (N, d)


# --- the maths -------------------------------------------------------------------------------------------------------


def feature_stats(features) -> tuple[np.ndarray, np.ndarray]:
    """(mean, covariance) of (n, d) features in float64; the covariance is unbiased (ddof=1), as everywhere."""
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need (n >= 2, d) features, got shape {f.shape}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def _sym(a: np.ndarray) -> np.ndarray:
    return (a + a.T) / 2


def _nonzero(w: np.ndarray) -> np.ndarray:
    """Eigenvalues of a PSD matrix, with those below numpy's matrix_rank tolerance (rounding noise, possibly
    negative) set to zero: the square root would blow that noise up from ~1e-16 to ~1e-8 each."""
    return np.where(w > w.max(initial=0.0) * len(w) * np.finfo(np.float64).eps, w, 0.0)


def _psd_sqrt(s: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh(_sym(s))
    return (v * np.sqrt(_nonzero(w))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """||mu1 - mu2||^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2)), in float64.

    tr((S1 S2)^(1/2)) is the sum of the square roots of the eigenvalues of S1 S2, which torch-fidelity and
    torchmetrics sum directly. Here they come from S1^(1/2) S2 S1^(1/2), which has the same eigenvalues but is
    symmetric, so they are real: no imaginary parts to drop (pytorch-fid drops them after scipy's sqrtm), and a
    singular covariance (fewer images than feature dims) needs no eps offset on the diagonal (pytorch-fid adds one
    when sqrtm fails). Eigenvalues at rounding level, negative ones included, count as zero (sqrt(x).real zeroes the
    negative ones there).
    """
    mu1, mu2 = (np.atleast_1d(np.asarray(m, dtype=np.float64)) for m in (mu1, mu2))
    s1, s2 = (np.atleast_2d(np.asarray(s, dtype=np.float64)) for s in (sigma1, sigma2))
    d = mu1.shape[0]
    if mu1.shape != (d,) or mu2.shape != (d,) or s1.shape != (d, d) or s2.shape != (d, d):
        raise ValueError(f"FID inputs disagree in shape: mu {mu1.shape}, {mu2.shape}; sigma {s1.shape}, {s2.shape}")
    if not all(np.isfinite(a).all() for a in (mu1, mu2, s1, s2)):
        raise ValueError("FID inputs contain NaN or infinity")
    root1 = _psd_sqrt(s1)
    eigenvalues = np.linalg.eigvalsh(_sym(root1 @ _sym(s2) @ root1))
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(_nonzero(eigenvalues)).sum())


def check_fid_split(n_real: int | None, n_fake: int, dims: int = INCEPTION_DIMS) -> str | None:
    """Raise a UserError when FID is undefined for these counts; return a note when it is defined but rank-deficient.

    n_real is None when a reference statistics file stands in for the real images. Call this before generating.
    """
    counts = {"generated": n_fake} if n_real is None else {"held-out real (eval split)": n_real, "generated": n_fake}
    few = {name: n for name, n in counts.items() if n < 2}
    if few:
        have = ", ".join(f"{n} {name}" for name, n in few.items())
        raise UserError(
            f"FID needs at least 2 images on each side (the covariance of one image is undefined) but "
            f"there are {have}; raise prepare.eval_fraction so prepare holds out more real images, or set "
            f"{REFERENCE_KEY} to a .npz with mu and sigma; a full-rank covariance of {dims}-d features "
            f"needs more than {dims} images"
        )
    n = min(counts.values())
    if n > dims:
        return None
    return (
        f"FID from {n} images: a covariance of {dims}-d features needs more than {dims} images to be full rank, "
        f"so this value is biased upward and only comparable with runs of the same size, not published FIDs"
    )


# --- the weights -----------------------------------------------------------------------------------------------------


def inception_paths(configured: str | None = None) -> list[Path]:
    """Where the weights are looked for: the configured file alone, else torch hub's checkpoint folder
    ($TORCH_HOME/hub/checkpoints; ~/.cache/torch/hub/checkpoints by default), where torch-fidelity downloads them."""
    if configured:
        return [Path(configured).expanduser()]
    import torch

    folder = Path(torch.hub.get_dir()) / "checkpoints"
    return [folder / name for name in WEIGHT_NAMES]


def find_inception(configured: str | None = None) -> tuple[Path | None, str | None]:
    """(the weights file, None) or (None, why it is missing and how to get it)."""
    paths = inception_paths(configured)
    found = next((p for p in paths if p.is_file()), None)
    if found:
        return found, None
    return None, (
        f"the FID InceptionV3 weights are not on this machine (looked for {' and '.join(map(str, paths))}); "
        f"run `sdpipe fetch-weights` on a machine with internet and copy {paths[0].name} to {paths[0]}, "
        f"or set {INCEPTION_KEY} to the file"
    )


def load_inception(path: str | Path, device: str = "cpu") -> FeatureFn:
    """The standard FID feature function: uint8 batch -> 2048-d pool3 features."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    from sdpipe import plain_data

    plain_data.check(path, "the FID weights")  # torch-fidelity unpickles it with weights_only=False
    try:
        net = FeatureExtractorInceptionV3(
            "inception-v3-compat", [str(INCEPTION_DIMS)], feature_extractor_weights_path=str(path)
        )
    except Exception as exc:  # a truncated download or another network's weights: unpickling or key errors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(
            f"{path} is not the FID InceptionV3 weights file ({first}); delete it and run `sdpipe fetch-weights` again"
        ) from None
    net.to(device)
    return lambda batch: net(batch)[0]  # batches arrive on `device` (extract_features); [0]: the one layer asked for


# --- from images -----------------------------------------------------------------------------------------------------


def _uint8(image):
    import torch

    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)


def extract_features(images: list, feature_fn: FeatureFn, batch_size: int = 32, device: str = "cpu") -> np.ndarray:
    """(n, d) float64 features of RGB PIL images, in no particular order (only their statistics are used).

    Images are batched by size, so each batch stacks and the network resizes them from their own size, as
    torch-fidelity does for a folder of same-sized images. Callers composite any alpha first (sdpipe.images).
    """
    import torch

    order = sorted(range(len(images)), key=lambda i: images[i].size)
    out = []
    for _, same_size in itertools.groupby(order, key=lambda i: images[i].size):
        same_size = list(same_size)
        for start in range(0, len(same_size), batch_size):
            batch = torch.stack([_uint8(images[i]) for i in same_size[start : start + batch_size]]).to(device)
            with torch.inference_mode():
                out.append(feature_fn(batch).to(torch.float64).cpu())
    return torch.cat(out).numpy()


def load_reference_stats(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) from a .npz written by pytorch-fid (--save-stats) or torch-fidelity: arrays `mu` and `sigma`."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{REFERENCE_KEY}: {path} not found")
    try:
        with np.load(path) as data:
            mu, sigma = np.asarray(data["mu"], np.float64), np.asarray(data["sigma"], np.float64)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{REFERENCE_KEY}: {path} is not a .npz with arrays mu and sigma ({exc})") from None
    if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
        raise UserError(f"{REFERENCE_KEY}: {path} has mu {mu.shape} and sigma {sigma.shape}; need (d,) and (d, d)")
    return mu, sigma


def fid_from_features(fake: np.ndarray, mu_real, sigma_real, n_real: int | None) -> dict:
    """The FID result from generated features and the real side's statistics."""
    dims = fake.shape[1]
    if len(mu_real) != dims:
        raise UserError(
            f"the reference statistics are {len(mu_real)}-d but the features are {dims}-d: they were made "
            f"with another network or layer; use the {INCEPTION_DIMS}-d InceptionV3 pool3 statistics"
        )
    note = check_fid_split(n_real, len(fake), dims)
    value = frechet_distance(*feature_stats(fake), mu_real, sigma_real)
    return measured(value, n_real=n_real, n_fake=len(fake), dims=dims, note=note)


def fid_from_images(fake: list, real: list, feature_fn: FeatureFn, batch_size: int = 32, device: str = "cpu") -> dict:
    check_fid_split(len(real), len(fake))
    real_features = extract_features(real, feature_fn, batch_size, device)
    fake_features = extract_features(fake, feature_fn, batch_size, device)
    return fid_from_features(fake_features, *feature_stats(real_features), n_real=len(real))


def fid(
    fake: list,
    real: list | None = None,
    reference_stats: str | None = None,
    inception_weights: str | None = None,
    batch_size: int = 32,
    device: str = "cpu",
) -> dict:
    """FID with the standard InceptionV3 against the real images, or against reference_stats when it is set."""
    reference = load_reference_stats(reference_stats) if reference_stats else None
    n_real = None if reference else len(real or [])
    check_fid_split(n_real, len(fake))
    details = {"reference": str(reference_stats) if reference else "eval split", "n_real": n_real, "n_fake": len(fake)}
    path, reason = find_inception(inception_weights)
    if path is None:
        return unavailable(reason, **details)
    feature_fn = load_inception(path, device)
    if reference:
        result = fid_from_features(extract_features(fake, feature_fn, batch_size, device), *reference, None)
    else:
        result = fid_from_images(fake, real, feature_fn, batch_size, device)
    return {**result, **details, "weights": str(path)}
