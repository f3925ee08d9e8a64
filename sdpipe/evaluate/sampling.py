"""How evaluation samples: its batch size and whether it compiles, from the settings and the images per device."""

from __future__ import annotations

# Sampling compiles the UNet's blocks (sdpipe.models.regions) only when it renders at least this many images per
# GPU. SD 1.5, 512 px, 20 steps on an H200 (NOTES v12): 4.55 images/s eager, 5.33 compiled after 38 s of warm-up,
# so the compile is repaid after about 1,200 images.
COMPILE_FROM_IMAGES = 1200


def batch_size(wanted: int | str, on_gpu: bool, height: int, width: int) -> int:
    """evaluate.batch_size, or auto: 8 on a CPU; on a GPU 16 up to 512x512 px and fewer as images grow (the UNet's
    activations grow with the pixels; the VAE decodes one image at a time)."""
    if wanted != "auto":
        return int(wanted)
    if not on_gpu:
        return 8
    return max(1, min(16, 16 * 512 * 512 // (height * width)))


def compile_mode(mode: str, on_gpu: bool, images_per_device: float) -> str:
    """evaluate.compile, or auto: the UNet's blocks compiled on a GPU that renders enough images to repay it."""
    if mode == "auto":
        return "blocks" if on_gpu and images_per_device >= COMPILE_FROM_IMAGES else "eager"
    return mode if on_gpu else "eager"
