"""Validate raw images, give each a content id, bucket it and hold out an eval split.

Every file under data.raw_dir (hidden ones aside) is an image candidate unless its extension is a caption
extension, in which case it is the sidecar caption of the image with the same stem in the same folder. Images are
fully decoded once (in a process pool for large folders); a file that fails goes to the rejected list with a
one-line reason instead of stopping the run. Raw files are only ever read.

Decoding is cached by content (see sdpipe/prepare/decode.py), so adding ten images to ten thousand decodes ten.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io
from sdpipe.errors import UserError
from sdpipe.prepare import memo
from sdpipe.prepare.decode import inspect_all
from sdpipe.prepare.files import extension_warning, kohya_folder, match_sidecars, scan, split_of, under
from sdpipe.records import MANIFEST_VERSION, ManifestRow

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
# Read only when dreambooth.enabled: the class images folder the class_images rule writes.
INPUTS = {"class_images": "results/class_images/images"}
OUTPUTS = {
    "manifest": "results/prepare/manifest.jsonl",
    "rejected": "results/prepare/rejected.jsonl",
    "summary": "results/prepare/summary.json",
}
# The config keys the outputs depend on (stages/declared.py).
READS = ("data", "prepare", "dreambooth.enabled")
DECODED_KEYS = ("width", "height", "format", "mode")
MAX_LOGGED_WARNINGS = 10


# --- validation parameters --------------------------------------------------------------------------------------


def validation_params(cfg: Config) -> dict:
    """Everything that decides a decode result; part of the cache key."""
    p = cfg.prepare
    return {"min_size": p.min_size, "max_pixels": p.max_pixels, "alpha_background": list(p.alpha_background)}


@dataclass
class Outcome:
    rows: list[dict] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)
    duplicates: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    decoded: int = 0
    reused: int = 0


def collect(cfg: Config, raw: Path, rels: list[str], results: list[dict], sidecar_of: dict[str, str]) -> Outcome:
    """Turn per-file results into manifest rows, rejections and duplicates (the first path by sort order wins)."""
    from sdpipe.buckets import make_buckets

    b = cfg.prepare.buckets
    buckets = make_buckets(b.resolution, b.step, b.max_aspect)
    out, first_path, path_of = Outcome(), {}, under(raw)
    wanted = [path_of(sidecar_of[rel]) for rel, res in zip(rels, results) if "reason" not in res and rel in sidecar_of]
    texts = memo.read_sidecars(wanted, cfg.cache_dir)
    for rel, res in zip(rels, results):
        if "reason" in res:
            out.rejected.append({"path": rel, "reason": res["reason"]})
        elif res["id"] in first_path:
            out.duplicates.append({"path": rel, "duplicate_of": first_path[res["id"]]})
        else:
            first_path[res["id"]] = rel
            out.reused += res["reused"]
            out.decoded += not res["reused"]
            side = sidecar_of.get(rel)
            text = texts[path_of(side)] if side else (None, None)
            out.rows.append(_row(cfg, path_of(rel), rel, res["id"], res, side, text, buckets, out))
    return out


def _row(
    cfg: Config,
    file: str,
    rel: str,
    image_id: str,
    info: dict,
    sidecar: str | None,
    read: tuple[str | None, str | None],
    buckets,
    out: Outcome,
) -> ManifestRow:
    """The manifest row of an accepted image; `read` is its sidecar's (text, reason it cannot be used)."""
    from sdpipe.buckets import assign_bucket

    text, reason = read
    if sidecar:
        if reason:
            if not any(r["path"] == sidecar for r in out.rejected):  # two images sharing a stem share a sidecar
                out.rejected.append({"path": sidecar, "reason": reason})
            sidecar = None
    if warning := extension_warning(rel, info["format"]):
        out.warnings.append(warning)
    repeats, folder = kohya_folder(rel)
    return {
        "version": MANIFEST_VERSION,
        "id": image_id,
        "path": rel,
        "file": file,
        "role": "instance",
        **{k: info[k] for k in DECODED_KEYS},
        "bucket": list(assign_bucket(info["width"], info["height"], buckets)),
        "split": split_of(image_id, cfg.prepare.eval_fraction),
        "repeats": repeats,
        "folder": folder,
        "sidecar": text,
        "sidecar_path": sidecar,
    }


def sidecar_warnings(
    sidecars: list[str], sidecar_of: dict[str, str], out: Outcome, shadowed: dict[str, str]
) -> list[str]:
    """One line per sidecar that captions nothing in the manifest, saying why."""
    used = {r["sidecar_path"] for r in out.rows} | {r["path"] for r in out.rejected}
    status = {r["path"]: "was rejected" for r in out.rejected} | {d["path"]: "is a duplicate" for d in out.duplicates}
    owners: dict[str, list[str]] = {}
    for image, side in sidecar_of.items():
        owners.setdefault(side, []).append(image)
    lines = []
    for rel in sidecars:
        if rel in used:
            continue
        if rel in shadowed:
            lines.append(f"sidecar {rel} ignored: {shadowed[rel]} captions the same image")
        elif rel in owners:
            image = owners[rel][0]
            lines.append(f"orphan sidecar {rel}: its image {image} {status.get(image, 'is not in the manifest')}")
        else:
            lines.append(f"orphan sidecar {rel}: no image with the same name in its folder")
    return lines


# --- the stage ---------------------------------------------------------------------------------------------------


def _candidates(cfg: Config, broken: list[dict]) -> tuple[Path, list[str], list[str]]:
    """(raw_dir, images, sidecars); tar shards that cannot be read whole are added to `broken`."""
    raw = Path(cfg.data.raw_dir)
    hint = f"put images there or run `sdpipe demo --out {cfg.data.raw_dir}`"
    if not raw.exists():
        raise UserError(f"data.raw_dir: folder {cfg.data.raw_dir} does not exist; {hint}")
    if not raw.is_dir():
        raise UserError(f"data.raw_dir: {cfg.data.raw_dir} is a file, not a folder; {hint}")
    skipped: list[str] = []
    images, sidecars = scan(raw, cfg.data.caption_extensions, skipped, broken)
    if cfg.data.masks.source == "file":  # loss masks beside their images (the latents stage reads them)
        from sdpipe.latents.masks import is_mask_file

        found = [rel for rel in images if is_mask_file(rel, cfg.data.masks.suffix)]
        images = [rel for rel in images if not is_mask_file(rel, cfg.data.masks.suffix)]
        log.info("%d mask files (data.masks.suffix %s) set aside from the images", len(found), cfg.data.masks.suffix)
    if skipped:
        log.info(
            "%d hidden or special entries skipped (names starting with '.', FIFOs, broken links): %s%s",
            len(skipped),
            ", ".join(skipped[:3]),
            ", ..." if len(skipped) > 3 else "",
        )
    if not images:
        raise UserError(
            f"data.raw_dir: folder {cfg.data.raw_dir} holds no image files "
            f"({len(sidecars)} captions, hidden files skipped); {hint}"
        )
    return raw, images, sidecars


def _check_usable(cfg: Config, out: Outcome, n_images: int) -> None:
    if not out.rows:
        first = out.rejected[0]
        raise UserError(
            f"data.raw_dir: none of the {n_images} image files in {cfg.data.raw_dir} is usable "
            f"(first: {first['path']}: {first['reason']})"
        )
    if not any(r["split"] == "train" for r in out.rows):
        raise UserError(
            f"prepare.eval_fraction = {cfg.prepare.eval_fraction} puts all {len(out.rows)} images in "
            "the eval split; lower it or add images"
        )


def summarize(cfg: Config, out: Outcome, scanned: int, params: dict) -> dict:
    splits = Counter(r["split"] for r in out.rows)
    return {
        "raw_dir": cfg.data.raw_dir,
        "scanned": scanned,
        "accepted": len(out.rows),
        "rejected": len(out.rejected),
        "decoded": out.decoded,
        "reused": out.reused,
        "train": splits["train"],
        "eval": splits["eval"],
        "duplicates": out.duplicates,
        "warnings": out.warnings,
        "params": params,
        "buckets": dict(sorted(Counter(f"{r['bucket'][0]}x{r['bucket'][1]}" for r in out.rows).items())),
    }


def _log_outcome(out: Outcome, summary: dict, manifest: Path) -> None:
    if out.duplicates:
        shown = ", ".join(f"{d['path']} (same as {d['duplicate_of']})" for d in out.duplicates[:3])
        log.info(
            "%d duplicate files (identical bytes) skipped: %s%s",
            len(out.duplicates),
            shown,
            ", ..." if len(out.duplicates) > 3 else "",
        )
    for row in out.rejected[:MAX_LOGGED_WARNINGS]:
        log.warning("rejected %s: %s", row["path"], row["reason"])
    if len(out.rejected) > MAX_LOGGED_WARNINGS:
        log.warning(
            "... and %d more rejected; the rejected list names each with its reason",
            len(out.rejected) - MAX_LOGGED_WARNINGS,
        )
    for line in out.warnings[:MAX_LOGGED_WARNINGS]:
        log.warning("%s", line)
    if len(out.warnings) > MAX_LOGGED_WARNINGS:
        log.warning("... and %d more warnings in the summary", len(out.warnings) - MAX_LOGGED_WARNINGS)
    log.info(
        "prepare: %d files scanned, %d images accepted (%d train, %d eval), %d rejected, %d duplicates; "
        "%d decoded, %d reused -> %s",
        summary["scanned"],
        summary["accepted"],
        summary["train"],
        summary["eval"],
        summary["rejected"],
        len(out.duplicates),
        summary["decoded"],
        summary["reused"],
        manifest,
    )


def class_rows(cfg: Config, folder: Path, instance_samples: int) -> tuple[list[dict], Outcome]:
    """DreamBooth class images: always trained on, captioned by their sidecar (the class prompt), and repeated so
    that an epoch holds about as many class samples as instance samples (kohya's regularisation-image balance)."""
    if not folder.is_dir():
        raise UserError(f"class images folder {folder} not found; run `snakemake class_images` first")
    images, sidecars = scan(folder, [".txt"])
    results = inspect_all(folder, images, validation_params(cfg), cfg.cache_dir, 1)
    out = collect(cfg, folder, images, results, match_sidecars(images, sidecars, [".txt"])[0])
    if not out.rows:
        raise UserError(f"no usable class images in {folder}; rerun `snakemake class_images`")
    repeats = max(1, round(instance_samples / len(out.rows)))
    for row in out.rows:
        row.update(role="class", split="train", repeats=repeats, folder="")
    return out.rows, out


def also_at_rows(cfg: Config, train_rows: list[dict]) -> list[dict]:
    """prepare.buckets.also_at: each training row again at each further resolution, in that resolution's bucket
    for the image's aspect ratio (the rows share the image's id; their buckets, so their latents, differ)."""
    from sdpipe.buckets import assign_bucket, make_buckets

    b, extra = cfg.prepare.buckets, []
    for resolution in b.also_at:
        buckets = make_buckets(resolution, b.step, b.max_aspect)
        extra += [r | {"bucket": list(assign_bucket(r["width"], r["height"], buckets))} for r in train_rows]
    return extra


def apply_concepts(cfg: Config, rows: list[dict]) -> dict:
    """data.concepts: each row under an entry's folder (the deepest entry that matches) takes that entry's repeats,
    loss weight, caption, caption prefix and bucket resolution; returns the images per entry. An entry whose folder
    does not exist or holds no usable image is a one-line error."""
    from sdpipe.buckets import assign_bucket, make_buckets

    b, counts = cfg.prepare.buckets, {}
    entries = sorted(cfg.data.concepts, key=lambda c: -len(Path(c.folder).parts))  # deepest first
    for entry in entries:
        if not (Path(cfg.data.raw_dir) / entry.folder).is_dir():
            raise UserError(
                f"data.concepts: folder {entry.folder} does not exist under data.raw_dir {cfg.data.raw_dir}"
            )
        counts[entry.folder] = 0
    for row in rows:
        parents = Path(row["path"]).parents
        entry = next((c for c in entries if Path(c.folder) in parents), None)
        if entry is None:
            continue
        counts[entry.folder] += 1
        if entry.repeats is not None:
            row["repeats"] = entry.repeats
        if entry.weight != 1.0:
            row["loss_weight"] = entry.weight
        if entry.caption:
            row.update(sidecar=entry.caption, fixed_caption=True)
        if entry.caption_prefix:
            row["caption_prefix"] = entry.caption_prefix
        if entry.resolution:
            buckets = make_buckets(entry.resolution, b.step, b.max_aspect)
            row["bucket"] = list(assign_bucket(row["width"], row["height"], buckets))
    empty = [folder for folder, n in counts.items() if n == 0]
    if empty:
        raise UserError(f"data.concepts: folder {empty[0]} holds no usable image")
    return counts


def regularisation_rows(cfg: Config, instance_samples: int) -> tuple[list[dict], dict]:
    """data.regularisation's folders: training rows with their folder's loss weight, repeats and caption; and a
    summary per folder. A folder that is missing or holds no usable image is a one-line error."""
    rows, summary = [], {}
    for spec in cfg.data.regularisation:
        folder = Path(spec.dir)
        if not folder.is_dir():
            raise UserError(f"data.regularisation: folder {spec.dir} does not exist")
        images, sidecars = scan(folder, cfg.data.caption_extensions)
        results = inspect_all(folder, images, validation_params(cfg), cfg.cache_dir, 1)
        out = collect(cfg, folder, images, results, match_sidecars(images, sidecars, cfg.data.caption_extensions)[0])
        if not out.rows:
            raise UserError(f"data.regularisation: no usable image in {spec.dir} ({len(out.rejected)} rejected)")
        balance = max(1, round(instance_samples / len(out.rows)))
        repeats = balance if spec.repeats == "balance" else spec.repeats
        for row in out.rows:
            row.update(role="regularisation", split="train", repeats=repeats, folder="", loss_weight=spec.weight)
            if spec.caption:
                row.update(sidecar=spec.caption, fixed_caption=True)
        rows += out.rows
        summary[spec.dir] = {"accepted": len(out.rows), "rejected": len(out.rejected), "repeats": repeats}
    return rows, summary


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> None:
    broken: list[dict] = []
    mirrored = None
    if cfg.data.raw_remote:
        from sdpipe import raw_remote

        mirrored = raw_remote.mirror(cfg.data.raw_remote, Path(cfg.data.raw_dir), cfg.cache_dir)
    seeded = memo.seed_containers(cfg.cache_dir)
    raw, images, sidecars = _candidates(cfg, broken)
    params = validation_params(cfg)
    workers = cfg.prepare.workers or os.cpu_count() or 1
    results = inspect_all(raw, images, params, cfg.cache_dir, workers)
    sidecar_of, shadowed = match_sidecars(images, sidecars, cfg.data.caption_extensions)
    out = collect(cfg, raw, images, results, sidecar_of)
    out.warnings += sidecar_warnings(sidecars, sidecar_of, out, shadowed)
    out.rejected += broken
    out.rejected.sort(key=lambda r: r["path"])
    _check_usable(cfg, out, len(images))
    summary = summarize(cfg, out, len(images) + len(sidecars), params)
    if mirrored:
        summary["raw_remote"] = {"url": cfg.data.raw_remote, **mirrored}
    if cfg.data.concepts:
        summary["concepts"] = apply_concepts(cfg, out.rows)
    rows = out.rows
    if cfg.dreambooth.enabled:
        instance_samples = sum(r["repeats"] for r in rows if r["split"] == "train")
        extra, class_out = class_rows(cfg, Path(inputs["class_images"]), instance_samples)
        known = {r["id"] for r in rows}
        rows = rows + [r for r in extra if r["id"] not in known]  # an instance image wins over an equal class one
        summary["class"] = {
            "accepted": len(extra),
            "rejected": len(class_out.rejected),
            "repeats": extra[0]["repeats"],
            "instance_samples": instance_samples,
        }
    if cfg.data.regularisation:
        instance_samples = sum(r["repeats"] for r in out.rows if r["split"] == "train")
        extra, summary["regularisation"] = regularisation_rows(cfg, instance_samples)
        known = {r["id"] for r in rows}
        rows = rows + [r for r in extra if r["id"] not in known]  # a raw image wins over an equal one
    if cfg.prepare.buckets.also_at:
        extra = also_at_rows(cfg, [r for r in rows if r["split"] == "train"])
        summary["also_at"] = {"resolutions": cfg.prepare.buckets.also_at, "rows": len(extra)}
        rows = rows + extra
    io.write_jsonl(outputs["manifest"], rows)
    io.write_jsonl(outputs["rejected"], out.rejected)
    io.write_json(outputs["summary"], summary)
    memo.save_containers(cfg.cache_dir, seeded)
    _log_outcome(out, summary, Path(outputs["manifest"]))
