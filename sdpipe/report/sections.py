"""The report's table sections: provenance, quality metrics, data and cache statistics, export checks.

Figures (and the assets they write) are in figures.py. Each function turns parsed inputs into a document.Section;
a missing optional input becomes a "not available" note with the command that makes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdpipe.report import sources
from sdpipe.report.document import Cell, Note, Section, Table, fmt, is_timing, kv_table, label, missing
from sdpipe.report.sources import Sources

if TYPE_CHECKING:
    from sdpipe.config import Config

KNOWN_METRICS = ("fid", "clip_score", "colour_accuracy")
KNOWN_SCALARS = (
    "train_samples_per_s",
    "train_warmup_s",
    "train_compile_s",
    "train_time_to_first_step_s",
    "inference_samples_per_s",
    "inference_load_s",
    "inference_warmup_s",
)
NOT_METRICS = ("scaling", "timings", "provenance")
PACKAGES = ("sdpipe", "torch", "diffusers", "transformers", "accelerate", "peft", "open-clip-torch", "torchmetrics")
PREPARE_KEYS = ["scanned", "accepted", "rejected", "duplicates", "train", "eval", "decoded", "reused", "warnings"]
CAPTION_KEYS = ["total", "captioned", "reused", "failed", "errors", "chain", "seconds"]
LATENT_KEYS = [
    "items",
    "encoded",
    "reused",
    "failed",
    "text_encoded",
    "text_reused",
    "devices",
    "dtype",
    "flip",
    "seconds",
    "images_per_s",
]
COUNTED = ("duplicates", "warnings")  # lists in the prepare summary (one entry each); the report shows how many
BREAKDOWNS = {"prepare": ("buckets", "bucket (WxH)", "images"), "captions": ("by_source", "source", "captions")}


def timings_of(src: Sources) -> frozenset[str]:
    return frozenset(src.data["metrics"].get("timings") or [])


def provenance(src: Sources, cfg: Config, generated: str) -> Section:
    prov = src.data["metrics"].get("provenance") or {}
    commit, origin = sources.git_commit(prov.get("git_commit"))
    dirty = ", with uncommitted changes" if prov.get("git_dirty") else ""
    rows = [
        ["git commit", f"{commit} ({origin}{dirty})"],
        ["config hash", f"{sources.config_hash(src.data['resolved_config'])} (of {src.paths['resolved_config']})"],
        ["dataset hash", _dataset(src)],
        ["raw data, DVC md5", _dvc(cfg)],
        ["GPU", _gpu(prov.get("gpu"), src.data["train_summary"].get("device"))],
        ["seeds", _seeds(prov.get("seeds"), cfg)],
    ]
    table = Table(["", "value"], [[Cell(k), Cell(v)] for k, v in rows] + [[Cell("generated"), Cell(generated, True)]])
    return Section("Provenance", [table, _packages(prov.get("packages"))])


def _dataset(src: Sources) -> str:
    if "manifest" in src.missing:
        return f"not available ({src.missing['manifest']})"
    rows = src.data["manifest"]
    return f"{sources.dataset_hash(rows)} (sorted image ids of {len(rows)} images in {src.paths['manifest']})"


def _dvc(cfg: Config) -> str:
    md5 = sources.dvc_md5(cfg.data.raw_dir)
    where = f"{cfg.data.raw_dir.rstrip('/')}.dvc"
    if md5:
        return f"{md5} (from {where})"
    return f"not available ({where} not found or without an md5; `dvc add {cfg.data.raw_dir}` writes it)"


def _gpu(gpu, device) -> str:
    if not gpu or not gpu.get("name"):
        return f"none recorded (training device: {fmt(device)})"
    cuda = f", CUDA {gpu['cuda']}" if gpu.get("cuda") else ""
    return f"{gpu['name']} × {fmt(gpu.get('count'))}, driver {fmt(gpu.get('driver'))}{cuda}"


def _seeds(seeds, cfg: Config) -> str:
    seeds = seeds or {"seed": cfg.seed, "validation": cfg.train.validation.seeds}
    return "; ".join(f"{k}: {fmt(v)}" for k, v in sorted(seeds.items()))


def _packages(recorded: dict | None) -> Table:
    if recorded:
        rows = sorted(recorded.items())
        return Table(["package", "version"], [[Cell(k), Cell(fmt(v))] for k, v in rows], "as recorded by evaluate")
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return Table(
        ["package", "version"],
        [[Cell(p), Cell(version(p))] for p in PACKAGES],
        "not recorded by evaluate: versions installed where the report was made",
    )


def metrics(src: Sources) -> Section:
    m, timings = src.data["metrics"], timings_of(src)
    found = [k for k in m if isinstance(m[k], dict) and "value" in m[k] and k not in KNOWN_METRICS]
    rows = [_metric_row(k, m.get(k)) for k in (*KNOWN_METRICS, *sorted(found))]
    order = {k: i for i, k in enumerate(KNOWN_SCALARS)}  # the known ones first, in this order, then the rest
    scalars = sorted(
        (k for k, v in m.items() if k not in NOT_METRICS and not isinstance(v, (dict, list))),
        key=lambda k: (order.get(k, len(order)), k),
    )
    rows += [[Cell(label(k)), Cell(fmt(m[k]), is_timing(k, timings)), Cell("")] for k in scalars]
    return Section("Metrics", [Table(["metric", "value", "details"], rows)])


def _metric_row(key: str, metric: dict | None) -> list[Cell]:
    if metric is None:
        return [Cell(label(key)), Cell("not available"), Cell("not in metrics.json")]
    value = fmt(metric["value"]) if metric.get("value") is not None else f"null — {metric.get('reason') or '?'}"
    details = "; ".join(f"{k}: {fmt(v)}" for k, v in sorted(metric.items()) if k not in ("value", "reason"))
    return [Cell(label(key)), Cell(value), Cell(details)]


def data(src: Sources) -> Section:
    section = Section("Data, captions and caches")
    for name, title, keys in (
        ("prepare", "prepare", PREPARE_KEYS),
        ("captions", "captions", CAPTION_KEYS),
        ("latents", "latent cache", LATENT_KEYS),
    ):
        if name in src.missing:
            section.blocks.append(missing(title, src.missing[name]))
            continue
        summary = src.data[name]
        counts = {k: len(v) for k, v in summary.items() if k in COUNTED and isinstance(v, list)}
        section.blocks.append(kv_table(summary | counts, keys, caption=title))
        if name in BREAKDOWNS and summary.get(BREAKDOWNS[name][0]):
            key, column, count = BREAKDOWNS[name]
            rows = [[Cell(k), Cell(fmt(v))] for k, v in sorted(summary[key].items())]
            section.blocks.append(Table([column, count], rows, f"{title}: {label(key)}"))
    return section


def export(src: Sources) -> Section:
    if "export" in src.missing:
        return Section("Export", [missing("export checks", src.missing["export"])])
    summary = src.data["export"]
    # The export stage nests its formats under "formats"; a flat {format: {...}} summary is read the same way.
    nested = isinstance(summary.get("formats"), dict)
    formats = summary["formats"] if nested else {k: v for k, v in summary.items() if isinstance(v, dict)}
    formats = {k: v for k, v in sorted(formats.items()) if isinstance(v, dict)}
    others = {k: v for k, v in summary.items() if (k != "formats" if nested else not isinstance(v, dict))}
    # Whatever keys the export stage writes become columns; path and verified first, because they matter most.
    keys = sorted({k for v in formats.values() for k in v}, key=lambda k: (k != "path", k != "verified", k))
    rows = [[Cell(name)] + [Cell(fmt(info.get(k)), is_timing(k)) for k in keys] for name, info in formats.items()]
    blocks = [Table(["format", *map(label, keys)], rows)] if formats else []
    blocks += [kv_table(others)] if others else []
    return Section("Export", blocks or [Note("the export summary lists no formats")])
