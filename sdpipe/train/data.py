"""Training data: the latent cache written by the latents stage, read a batch at a time.

Only cached tensors are read: the VAE and the text encoders never load for training (unless the text encoder is
trained). Shards are memory-mapped safetensors files, so a batch costs a few page reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sdpipe import io
from sdpipe.cache_store import SEP, ShardStore
from sdpipe.errors import UserError
from sdpipe.latent_index import VERSION as INDEX_VERSION
from sdpipe.models import families
from sdpipe.records import LatentIndex


class LatentData:
    def __init__(
        self, index_path: str | Path, prior_loss_weight: float = 1.0, verify: bool = True, split: str = "train"
    ):
        """`split`: "train", or "eval" for the held-out images the latents stage cached (index "eval_items")."""
        index_path = Path(index_path)
        if not index_path.is_file():
            raise UserError(f"latent cache index {index_path} not found; run `snakemake latents` first")
        self.index: LatentIndex = io.read_json(index_path)
        if self.index.get("version") != INDEX_VERSION:
            raise UserError(f"{index_path} was written by another sdpipe version; rerun `snakemake latents`")
        self.items = self.index["items"] if split == "train" else self.index.get("eval_items", [])
        if not self.items and split == "eval":
            raise UserError(
                f"{index_path} holds no held-out images: prepare.eval_fraction put none in the eval split, or "
                f"they could not be encoded (see results/latents/summary.json)"
            )
        if not self.items:
            raise UserError(f"{index_path} lists no training images; see results/latents/summary.json")
        stores = {"latent": Path(self.index["latent_store"]), "text": Path(self.index["text_store"])}
        self.remotes = self.index.get("remote_stores") or {}  # latents.remote: shards this node lacks come from there
        self.roots = stores
        self.where = {kind: io.read_json(self._local(kind, "index.json"))["keys"] for kind in stores}
        self.stores = {kind: ShardStore(root) for kind, root in stores.items()} if verify else {}
        self._handles: dict[Path, Any] = {}  # shard -> safetensors' safe_open handle
        # Kohya-style repeats: an image with repeats=3 is three samples of an epoch.
        self.sample_items = [i for i, item in enumerate(self.items) for _ in range(item["repeats"])]
        # DreamBooth prior preservation: a class image's loss counts prior_loss_weight times an instance image's.
        # A data.regularisation folder's images count their folder's weight.
        self.loss_weight = [
            item["loss_weight"]
            if item.get("loss_weight") is not None
            else prior_loss_weight
            if item.get("role") == "class"
            else 1.0
            for item in self.items
        ]
        self.latent_channels = self._tensor("latent", self.items[0]["latent_key"], "latent").shape[0]
        # The cache holds the VAE posterior means as encoded; diffusion works on (mean - shift) * scaling_factor,
        # the convention every diffusers pipeline decodes with (latents / scaling_factor + shift).
        model = self.index["model"]
        self.latent_shift, self.latent_scale = model.get("shift_factor") or 0.0, model["scaling_factor"]
        self.family = families.named(model["family"])
        self.empty = {f: self._tensor("text", self.index["empty_text_key"], f) for f in self.family.text_fields}

    def captions(self, samples: list[int], drop_caption: list[bool], variants: list[int] | None = None) -> list[str]:
        """The caption text of each sample ("" where dropped), for a text encoder being trained."""
        items = [self.items[self.sample_items[s]] for s in samples]
        chosen = variants or [0] * len(samples)
        return [
            "" if drop else (it.get("caption_variants") or [it["caption"]])[v]
            for it, drop, v in zip(items, drop_caption, chosen)
        ]

    def variant_counts(self, samples: list[int]) -> list[int]:
        """How many cached caption variants each sample has (latents.tags; 1 without)."""
        return [len(self.items[self.sample_items[s]].get("text_keys") or [None]) for s in samples]

    def latent_shape(self, sample: int) -> tuple[int, int, int]:
        """(C, H, W) of a sample's latent, from its bucket and the VAE's downsampling."""
        w, h = self.items[self.sample_items[sample]]["bucket"]
        f = self.index["model"]["vae_downsample"]
        return self.latent_channels, h // f, w // f

    def sample_buckets(self) -> list[tuple[int, int]]:
        return [tuple(self.items[i]["bucket"]) for i in self.sample_items]

    def _tensor(self, kind: str, key: str, field: str) -> torch.Tensor:
        from safetensors import safe_open

        shard = self.roots[kind] / self.where[kind][key]
        if shard not in self._handles:
            shard = self._local(kind, shard.name)
            if kind in self.stores:
                self.stores[kind].check(shard)
            self._handles[shard] = safe_open(str(shard), framework="pt")
        return self._handles[shard].get_tensor(f"{key}{SEP}{field}")

    def _local(self, kind: str, name: str) -> Path:
        """The store's file `name` on this node: fetched whole from latents.remote the first time it is missing."""
        path = self.roots[kind] / name
        if path.is_file():
            return path
        if kind not in self.remotes:
            raise UserError(f"{path} is missing from the latent cache; run `snakemake --forcerun latents`")
        from sdpipe import remote_store

        return remote_store.fetch(self.remotes[kind], name, self.roots[kind])

    def batch(
        self, samples: list[int], flips: list[bool], drop_caption: list[bool], variants: list[int] | None = None
    ) -> dict:
        """Scaled latents [B,C,H,W], text hidden states [B,77,D] (and pooled, SDXL) for these sample indices;
        `variants` picks each sample's caption variant (latents.tags)."""
        items = [self.items[self.sample_items[s]] for s in samples]
        text_keys = [(it.get("text_keys") or [it["text_key"]])[v] for it, v in zip(items, variants or [0] * len(items))]
        keys = [it["flip_key"] if flip and it["flip_key"] else it["latent_key"] for it, flip in zip(items, flips)]
        raw = torch.stack([self._tensor("latent", k, "latent") for k in keys]).float()
        out = {
            "latents": (raw - self.latent_shift) * self.latent_scale,
            "weight": torch.tensor([self.loss_weight[self.sample_items[s]] for s in samples]),
        }
        texts = [
            self.empty if drop else {f: self._tensor("text", key, f) for f in self.empty}
            for key, drop in zip(text_keys, drop_caption)
        ]
        for field in self.empty:
            out[field] = torch.stack([t[field] for t in texts]).float()
        if self.family.size_conditioning:
            out["time_ids"] = self._size_ids(items, flips)
        if items[0].get("mask_key"):  # data.masks: every item has one (all ones where the image has none)
            masks = [
                it["flip_mask_key"] if flip and it["flip_key"] else it["mask_key"] for it, flip in zip(items, flips)
            ]
            out["mask"] = torch.stack([self._tensor("latent", k, "mask") for k in masks]).float()
        return out

    def _size_ids(self, items: list, flips: list[bool]) -> torch.Tensor:
        """SDXL's micro-conditioning per sample: original (h, w), the crop's top-left corner, the target (h, w)."""
        crops = [
            it["flip_crop_top_left"] if flip and it["flip_key"] else it["crop_top_left"]
            for it, flip in zip(items, flips)
        ]
        return torch.tensor(
            [[*it["original_size"], *crop, it["bucket"][1], it["bucket"][0]] for it, crop in zip(items, crops)],
            dtype=torch.float32,
        )
