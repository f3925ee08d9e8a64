"""Download the evaluate metrics' weights into the caches the metrics read, on a machine with internet.

The FID InceptionV3 file goes where torch-fidelity itself would put it (torch hub's checkpoint folder, or the
configured path); open_clip weights go through open_clip's own download (the Hugging Face cache, or ~/.cache/clip
for URL-only tags). Offline, each fails with one line saying what to copy where instead.
"""

from __future__ import annotations

from sdpipe.captioners import one_line
from sdpipe.errors import UserError
from sdpipe.evaluate import clip_score, fid


def _failed(what: str, source: str, exc: BaseException, instead: str) -> UserError:
    return UserError(
        f"could not download {what} from {source} ({one_line(exc)}); this machine seems to have no "
        f"internet: run `sdpipe fetch-weights` on one that has, then {instead}"
    )


def fetch_inception(configured: str | None = None) -> str:
    """Fetch the FID InceptionV3 weights (a no-op when present); returns a line saying where they are."""
    from torch.hub import download_url_to_file
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    found, _ = fid.find_inception(configured)
    if found:
        return f"FID InceptionV3 weights: {found} (already here)"
    target = fid.inception_paths(configured)[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        download_url_to_file(URL_INCEPTION_V3, str(target), progress=False)  # via a temp file: never half a file
    except OSError as exc:  # URLError and HTTPError are OSErrors
        raise _failed("the FID InceptionV3 weights", URL_INCEPTION_V3, exc, f"copy {target.name} to {target}") from None
    return f"FID InceptionV3 weights: {target} (downloaded)"


def fetch_clip(c: clip_score.ClipSettings | None = None) -> str:
    """Fetch the CLIP score model's weights (a no-op when present); returns a line saying where they are."""
    c = c or clip_score.ClipSettings()
    import open_clip
    from huggingface_hub import snapshot_download

    what = f"open_clip weights {c.model}/{c.pretrained}"
    found, _ = clip_score.locate(c)  # config mistakes raise here, before any download
    if found:
        return f"{what}: {found['weights']} (already here)"
    kind, _, ident = c.model.partition(":")
    if kind != "hf-hub" and not open_clip.get_pretrained_cfg(c.model, c.pretrained):
        raise UserError(
            f"{clip_score.KEY}.pretrained = {c.pretrained} is a local file that does not exist; there "
            f"is nothing to download: copy the checkpoint there"
        )
    try:
        if kind == "hf-hub":
            snapshot_download(ident)
        else:
            open_clip.download_pretrained(open_clip.get_pretrained_cfg(c.model, c.pretrained))
    except Exception as exc:  # hub, HTTP and offline-mode errors share no base class
        raise _failed(
            what,
            "the Hugging Face Hub",
            exc,
            "copy its Hugging Face cache (~/.cache/huggingface/hub) or ~/.cache/clip here",
        ) from None
    found, reason = clip_score.locate(c)
    if found is None:  # the download landed somewhere the offline lookup does not read
        raise UserError(f"{what} downloaded, but the offline lookup still misses them: {reason}")
    return f"{what}: {found['weights']} (downloaded)"


def fetch_weights(inception_weights: str | None = None, clip: clip_score.ClipSettings | None = None) -> list[str]:
    """Fetch everything the evaluate metrics need; one line per weight set, saying where it is."""
    return [fetch_inception(inception_weights), fetch_clip(clip)]
