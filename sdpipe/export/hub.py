"""Upload an export folder to the Hugging Face Hub (`sdpipe publish`), when export.hub.repo_id is set.

The repo is created if it does not exist (private unless export.hub.private is false; an existing repo keeps its
visibility), then the folder goes up in one upload_folder call, which skips files the repo already has unchanged,
so publishing again after a small change sends only that change. The token comes from the environment variable
export.hub.token_env, never from the config file (configs are committed and copied to pods). HF_ENDPOINT is
honoured, as everywhere in huggingface_hub.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

KEY = "export.hub"


def token(cfg: Config) -> str:
    name = cfg.export.hub.token_env
    value = os.environ.get(name, "").strip()
    if not value:
        raise UserError(
            f"{KEY}.token_env: the environment variable {name} is not set; export a Hugging Face write "
            f"token as {name} (https://huggingface.co/settings/tokens) before `sdpipe publish`"
        )
    return value


def staged(folder: Path, card: Path | None, stage: Path) -> Path:
    """`folder` with the model card's files (README.md, samples.png) beside its own, as links in `stage`: the card
    stage writes results/card (results/export belongs to the export stage), the Hub wants the card at the repo's
    root. Without a card, `folder` itself."""
    if card is None or not (card / "README.md").is_file():
        return folder
    for root in (folder, card):  # links to files, real folders: upload_folder does not follow linked folders
        for source in root.rglob("*"):
            if source.is_file():
                target = stage / source.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.unlink(missing_ok=True)  # the card's README.md wins over an export's own
                target.symlink_to(source.resolve())
    return stage


def upload(cfg: Config, folder: str | Path, card: str | Path | None = None) -> str:
    """Create export.hub.repo_id if needed and upload `folder` (with the model card in `card`, when there is one)
    to it in one commit; the commit URL."""
    import tempfile

    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    hub, folder = cfg.export.hub, Path(folder)
    if hub.repo_id is None:
        raise UserError(f"{KEY}.repo_id is null: set it to the model repo to publish to, e.g. your-name/my-model")
    if not folder.is_dir() or not any(folder.iterdir()):
        raise UserError(f"nothing to publish: {folder} is not a folder with files (run the export stage first)")
    api = HfApi(token=token(cfg))
    try:
        api.create_repo(hub.repo_id, private=hub.private, exist_ok=True)
        with tempfile.TemporaryDirectory() as stage:
            info = api.upload_folder(
                repo_id=hub.repo_id,
                folder_path=str(staged(folder, card and Path(card), Path(stage))),
                commit_message=f"sdpipe publish {folder.name}",
            )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        hint = f" (is the token in {hub.token_env} a write token for {hub.repo_id}?)" if status in (401, 403) else ""
        raise UserError(f"cannot publish to {hub.repo_id}: {str(exc).splitlines()[0]}{hint}") from None
    return info.commit_url
