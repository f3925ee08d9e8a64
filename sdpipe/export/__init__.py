"""Export: trained weights in the formats other tools load. single_file writes one original-layout (CompVis/SGM,
"A1111/ComfyUI") checkpoint from a diffusers folder; lora turns a diffusers/peft LoRA (UNet and text encoders) into
kohya format. Submodules import torch/diffusers; import them lazily."""
