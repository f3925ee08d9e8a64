"""The model card's parts that need no run: DreamBooth's instance prompt, the front matter's YAML, Hub ids.
(A card rendered from a real run's outputs, its code executed: tests/test_export_evaluate.py.)"""

from __future__ import annotations

import yaml

from sdpipe import io
from sdpipe.card import facts, front_matter


def test_the_instance_prompt_is_the_caption_most_instance_images_share(tmp_path):
    io.write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "a", "role": "instance"},
            {"id": "b", "role": "instance"},
            {"id": "c", "role": "instance"},
            {"id": "k1", "role": "class"},
            {"id": "k2", "role": "class"},
            {"id": "k3", "role": "class"},
        ],
    )
    io.write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"id": "a", "caption": "a photo of sks: dog"},
            {"id": "b", "caption": "a photo of sks: dog"},
            {"id": "c", "caption": "sks dog on grass"},
            *({"id": k, "caption": "a photo of a dog"} for k in ("k1", "k2", "k3")),
        ],
    )
    found = facts.instance_prompt(tmp_path / "m.jsonl", tmp_path / "c.jsonl")
    assert found == ("a photo of sks: dog", 2, 3)  # the class images' caption is more common, and not counted
    assert facts.instance_prompt(tmp_path / "m.jsonl", tmp_path / "none.jsonl") is None

    known = {
        "license": "other",
        "base_hub_id": "stabilityai/stable-diffusion-xl-base-1.0",
        "components": {"unet": "lora", "text_encoder": "lora", "text_encoder_2": "lora"},
        "family": "Stable Diffusion XL",
        "hub_tag": "stable-diffusion-xl",
        "lora": True,
        "dreambooth": {"class_prompt": "a photo of a dog"},
        "instance_prompt": found,
        "prompts": [{"prompt": "yes", "seed": 0}],
    }
    text = front_matter.render(known, "samples.png")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["instance_prompt"] == "a photo of sks: dog"  # a colon in a prompt stays a string
    assert meta["widget"][0]["text"] == "yes"  # not YAML 1.1's true
    assert (meta["base_model"], meta["base_model_relation"]) == ("stabilityai/stable-diffusion-xl-base-1.0", "adapter")
    assert meta["tags"][:1] == ["stable-diffusion-xl"] and {"lora", "dreambooth"} <= set(meta["tags"])


def test_only_a_hub_id_becomes_base_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert facts.hub_id("stable-diffusion-v1-5/stable-diffusion-v1-5") == "stable-diffusion-v1-5/stable-diffusion-v1-5"
    assert facts.hub_id("models/tiny") is None  # a folder here, though it looks like org/name
    assert facts.hub_id("/abs/path/model") is None and facts.hub_id("./sd15") is None
    assert facts.hub_id("results/vae/model") is None  # three parts: no Hub id


def test_a_single_file_base_is_loaded_with_from_single_file_in_the_cards_code():
    """A LoRA trained on an A1111/ComfyUI checkpoint: the card's code loads that base as users must, with
    from_single_file and the exported configs (from_pretrained cannot read a single file)."""
    from sdpipe.card import body

    formats = {
        "diffusers": {"loader": "StableDiffusionPipeline.from_pretrained", "path": "results/export/diffusers"},
        "lora": {"path": "results/export/lora/pytorch_lora_weights.safetensors"},
    }
    facts = {
        "formats": formats,
        "sampling": {"steps": 25, "guidance": 7.5},
        "instance_prompt": None,
        "prompts": [{"prompt": "a cat"}],
        "lora": True,
        "base_hub_id": None,
        "base": "/models/dreamshaper.safetensors",
    }
    text = body.usage_section(facts)
    assert (
        'StableDiffusionPipeline.from_single_file("/models/dreamshaper.safetensors", '
        'config="results/export/diffusers", torch_dtype=torch.float16)'
    ) in text
    facts["base"] = "/models/sd15-folder"
    assert 'from_pretrained("/models/sd15-folder", torch_dtype' in body.usage_section(facts)
