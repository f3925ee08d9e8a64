"""The latent cache's domain code: the per-device encoding worker (stages/latents.py adapts it to the DAG)."""
