"""The card's Markdown body: what was trained, how, on what, the files and how to load them, and how it scored.

Every number comes from the facts (facts.py); code blocks use the exported files' real names and paths, so they
run as written next to the results folder.
"""

from __future__ import annotations

import json
from pathlib import Path

METRIC_LABELS = {
    "fid": "FID (lower is better)",
    "clip_score": "CLIP score (higher is better)",
    "colour_accuracy": "colour accuracy (the demo's colour prompts)",
}
FORMAT_LABELS = {
    "diffusers": "diffusers pipeline folder",
    "single_file": "single file, original SD layout",
    "lora": "LoRA, diffusers/peft format",
    "lora_kohya": "LoRA, kohya format (A1111, ComfyUI)",
}


def cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def q(text: str) -> str:
    """A Python string literal (double-quoted, escaped) for the code blocks."""
    return json.dumps(str(text), ensure_ascii=False)


def adapter(facts: dict) -> str:
    """The adapter's name for the reader: LoRA, DoRA, or LyCORIS' LoHa or LoKr (train.lora)."""
    lora = facts.get("lora_settings") or {}
    kind = lora.get("type", "lora")
    return {"loha": "LoHa (LyCORIS)", "lokr": "LoKr (LyCORIS)"}.get(kind, "DoRA" if lora.get("dora") else "LoRA")


def title(facts: dict) -> str:
    what = adapter(facts) if facts["lora"] else "fine-tune"
    return facts["name"] or f"{Path(facts['base']).name} {what}"


def intro(facts: dict) -> str:
    kind = "DreamBooth " if facts["dreambooth"] else ""
    kind += adapter(facts) if facts["lora"] else "full fine-tune"
    text = f"A {kind} of `{facts['base']}` ({facts['family']}), trained and exported with sdpipe."
    if facts["license"] == "other":
        text += (
            "\n\nThe license is `other` because sdpipe does not know the base model's license: set it in the "
            "front matter (and respect the base model's terms) before publishing."
        )
    return text


def model_section(facts: dict) -> str:
    lora = facts["lora_settings"]
    rows = [["base model", f"`{facts['base']}`"], ["family", facts["family"]]]
    for component, mode in facts["components"].items():
        detail = f"{adapter(facts)}, rank {lora['rank']}, alpha {lora['alpha']}" if mode == "lora" else "full fine-tune"
        rows.append([component.replace("_", " "), detail])
    if facts["lora"]:
        denoiser = next(iter(facts["components"]), "unet")  # the denoiser comes first: unet or transformer
        rows.append([f"adapter target modules ({denoiser})", ", ".join(lora["target_modules"])])
    if "text_encoder" not in facts["components"]:
        rows.append(["text encoder", "frozen (not trained)"])
    return "## Model\n\n" + table(["", ""], rows)


def training_section(facts: dict) -> str:
    t, s = facts["train"], facts["settings"]
    batch = (
        f"{t.get('global_batch_size')} (per device {t.get('per_device_batch_size')} x "
        f"{t.get('world_size')} process(es) x {t.get('grad_accum_steps')} accumulation step(s))"
    )
    rows = [
        [
            "optimizer steps",
            f"{t.get('optimizer_steps')} ({t.get('samples_seen')} samples seen, "
            f"{t.get('epochs_started')} epoch(s) started)",
        ],
        ["batch size", batch],
        ["learning rate", f"{s['learning_rate']} ({s['lr_scheduler']} schedule)"],
        ["resolution", f"{s['resolution']} px (aspect-ratio buckets of about {s['resolution']}² pixels)"],
        ["precision", f"{_precision(t.get('mixed_precision'))}; weights exported in {facts['export_dtype']}"],
        ["prediction type", t.get("prediction_type")],
        ["min-SNR gamma", s["snr_gamma"] if s["snr_gamma"] is not None else "off"],
        ["caption dropout", s["caption_dropout"]],
        ["EMA", "yes" if s["ema"] else "no"],
        ["seed", s["seed"]],
        ["device", t.get("device")],
    ]
    return "## Training\n\n" + table(["setting", "value"], rows)


def _precision(mixed: str | None) -> str:
    return "fp32 (no mixed precision)" if mixed in ("fp32", "no", None) else f"{mixed} mixed precision"


def dataset_section(facts: dict) -> str:
    d = facts["data"]
    text = (
        f"## Dataset\n\n{d.get('accepted')} images accepted ({d.get('train')} for training, {d.get('eval')} held "
        f"out for evaluation); {d.get('rejected')} rejected, {len(d.get('duplicates') or [])} duplicates."
    )
    if d.get("buckets"):
        text += "\n\n" + table(["bucket (W x H)", "images"], sorted(d["buckets"].items()))
    db = facts["dreambooth"]
    if db:
        text += f"\n\nDreamBooth with prior preservation: class prompt {q(db['class_prompt'])}"
        text += (
            f" ({d.get('class', {}).get('accepted', '?')} class images, prior loss weight {db['prior_loss_weight']})."
        )
        if facts["instance_prompt"]:
            prompt, shared, total = facts["instance_prompt"]
            text += f" Instance prompt {q(prompt)} (the caption of {shared} of {total} instance images)."
    return text


def files_section(facts: dict) -> str:
    rows = []
    for name, result in facts["formats"].items():
        check = "yes" if result.get("verified") else "NO"
        rows.append(
            [
                f"`{result['path']}`",
                FORMAT_LABELS.get(name, name),
                f"`{result.get('loader')}`",
                f"{check} (max difference {result.get('max_abs_diff')} RGB levels)",
            ]
        )
    note = (
        "Each file was reloaded with the loader shown and rendered a fixed-seed image, compared with the trained "
        "model's own."
    )
    return "## Files\n\n" + table(["file", "format", "loads with", "verified"], rows) + "\n\n" + note


def usage_section(facts: dict) -> str:
    formats, sampling = facts["formats"], facts["sampling"]
    pipeline = formats["diffusers"]["loader"].split(".")[0]
    prompt = (facts["instance_prompt"] or [None])[0] or next((p["prompt"] for p in facts["prompts"]), "a photo")
    call = (
        f"image = pipe({q(prompt)}, num_inference_steps={sampling['steps']}, "
        f"guidance_scale={sampling['guidance']}).images[0]"
    )
    head = ["```python", "import torch", f"from diffusers import {pipeline}", ""]
    lycoris = (facts.get("lora_settings") or {}).get("type", "lora") != "lora"
    if facts["lora"] and lycoris:  # diffusers reads no LoHa/LoKr: the folder with the adapter merged in
        code = [
            f"pipe = {pipeline}.from_pretrained({q(formats['diffusers']['path'])}, "
            f'torch_dtype=torch.float16).to("cuda")'
        ]
        kohya = formats.get("lora_kohya")
        alt = (
            f"\n\nThe LyCORIS file `{kohya['path']}` goes into A1111's, Forge's or ComfyUI's LoRA folder (A1111 "
            f"prompt: `<lora:{Path(kohya['path']).stem}:1>`). diffusers reads no {adapter(facts)} file, which is "
            "why the pipeline folder holds the adapter merged in."
            if kohya
            else ""
        )
        text = f"The pipeline with the {adapter(facts)} merged in:"
    elif facts["lora"]:
        weight = Path(formats["lora"]["path"])
        base = facts["base_hub_id"] or facts["base"]
        # A single-file base (A1111/ComfyUI checkpoint) loads with from_single_file; its configs are the export's.
        load = (
            f"from_single_file({q(base)}, config={q(formats['diffusers']['path'])}, "
            if str(base).endswith((".safetensors", ".ckpt"))
            else f"from_pretrained({q(base)}, "
        )
        code = [
            f'pipe = {pipeline}.{load}torch_dtype=torch.float16).to("cuda")',
            f"pipe.load_lora_weights({q(weight.parent)}, weight_name={q(weight.name)})",
        ]
        kohya = formats.get("lora_kohya")
        dora = (facts.get("lora_settings") or {}).get("dora")
        alt = (
            (
                f"\n\nThe kohya file `{kohya['path']}` goes into ComfyUI's or Forge's LoRA folder (A1111 reads DoRA "
                "only along the input axis and renders it differently); diffusers drops its `dora_scale`, so load "
                "the peft file above."
            )
            if kohya and dora
            else (
                f"\n\nThe kohya file `{kohya['path']}` goes into A1111's or ComfyUI's LoRA folder (A1111 prompt: "
                f"`<lora:{Path(kohya['path']).stem}:1>`); diffusers loads it too: "
                f"`pipe.load_lora_weights({q(kohya['path'])})`."
            )
            if kohya
            else ""
        )
        text = f"The {adapter(facts)} on its base model:"
    else:
        code = [
            f"pipe = {pipeline}.from_pretrained({q(formats['diffusers']['path'])}, "
            f'torch_dtype=torch.float16).to("cuda")'
        ]
        alt, text = "", "The whole pipeline:"
    single = formats.get("single_file")
    if single:
        alt += (
            f"\n\nThe single file `{single['path']}` loads in A1111 and ComfyUI, and in diffusers with "
            f"`{pipeline}.from_single_file({q(single['path'])}, config={q(formats['diffusers']['path'])})`"
            f"{' (the LoRA merged in)' if facts['lora'] else ''}."
        )
    return f"## Use it with diffusers\n\n{text}\n\n" + "\n".join(head + code + [call, "```"]) + alt


def metric_value(metric: dict) -> str:
    if metric.get("value") is None:
        return f"not measured: {metric.get('reason') or 'no reason given'}"
    return f"{metric['value']:.4g}"


def evaluation_section(facts: dict, grid: str | None) -> str:
    order = {k: i for i, k in enumerate(METRIC_LABELS)}  # FID and CLIP score first, then whatever else was measured
    metrics = sorted(facts["metrics"].items(), key=lambda km: (order.get(km[0], len(order)), km[0]))
    rows = [[METRIC_LABELS.get(k, k.replace("_", " ")), metric_value(m)] for k, m in metrics]
    s = facts["sampling"]
    text = "## Evaluation\n\n" + table(["metric", "value"], rows)
    if grid:
        prompts = list(dict.fromkeys(p["prompt"] for p in facts["prompts"]))
        seeds = list(dict.fromkeys(p["seed"] for p in facts["prompts"]))
        text += (
            f"\n\n![samples]({grid})\n\nRows: {'; '.join(q(p) for p in prompts)}. Columns: seeds "
            f"{', '.join(str(x) for x in seeds)}. {s['steps']} sampler steps, guidance {s['guidance']}."
        )
    return text


def render(facts: dict, grid: str | None) -> str:
    parts = [
        f"# {title(facts)}",
        intro(facts),
        model_section(facts),
        training_section(facts),
        dataset_section(facts),
        files_section(facts),
        usage_section(facts),
        evaluation_section(facts, grid),
    ]
    return "\n\n".join(parts) + "\n"
