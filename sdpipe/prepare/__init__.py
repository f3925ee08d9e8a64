"""Prepare's domain code: reading, hashing and decoding raw images (stages/prepare.py adapts it to the DAG)."""
