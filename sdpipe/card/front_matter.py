"""The card's YAML front matter: the fields the Hugging Face Hub reads to list, filter and link a model.

base_model only when the base is a Hub id (a local folder means nothing on the Hub); base_model_relation says
whether the repository holds an adapter (LoRA only) or a fine-tune; instance_prompt is what DreamBooth repositories
show as the trigger words; widget shows the sample grid on the model page.
"""

from __future__ import annotations

import yaml


def tags(facts: dict) -> list[str]:
    found = [
        facts["hub_tag"],
        "stable-diffusion-diffusers",
        "text-to-image",
        "diffusers",
    ]
    if facts["lora"]:
        found.append("lora")
    if facts["dreambooth"]:
        found.append("dreambooth")
    return found + ["sdpipe"]


def fields(facts: dict, grid: str | None) -> dict:
    meta = {"license": facts["license"]}
    if facts["base_hub_id"]:
        meta["base_model"] = facts["base_hub_id"]
        only_adapters = set(facts["components"].values()) == {"lora"}
        meta["base_model_relation"] = "adapter" if only_adapters else "finetune"
    meta |= {"library_name": "diffusers", "pipeline_tag": "text-to-image", "tags": tags(facts)}
    if facts["instance_prompt"]:
        meta["instance_prompt"] = facts["instance_prompt"][0]
    if grid and facts["prompts"]:
        meta["widget"] = [{"text": facts["prompts"][0]["prompt"], "output": {"url": grid}}]
    return meta


def render(facts: dict, grid: str | None) -> str:
    # safe_dump quotes whatever YAML would misread (a prompt with a colon, "yes", a number-like name)
    text = yaml.safe_dump(fields(facts, grid), sort_keys=False, allow_unicode=True, width=1000)
    return f"---\n{text}---\n"
