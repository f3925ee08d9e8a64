"""sdpipe: a declarative, reproducible pipeline for fine-tuning Stable Diffusion on one or many GPUs."""

__version__ = "0.1.0"
