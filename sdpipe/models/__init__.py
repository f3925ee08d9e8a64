"""Models: random-init presets built from config (presets), the CLIP tokenizer (tokenizer), and loading of any
diffusers SD 1.x/2.x/SDXL folder or cached hub id (loading). Submodules import torch/diffusers; import them lazily."""
