"""Quality metrics for the evaluate stage: FID (fid.py) and CLIP score (clip_score.py).

Each metric is a small JSON-ready dict: {"value": number, "reason": None, ...details} when it was measured, or
{"value": None, "reason": "why not, and how to fix it", ...details} when it could not be (weights missing on this
machine). A metric is never filled with a stand-in number. fetch.py downloads the weights where there is internet.
"""

from __future__ import annotations


def measured(value: float, **details) -> dict:
    return {"value": float(value), "reason": None, **details}


def unavailable(reason: str, **details) -> dict:
    return {"value": None, "reason": reason, **details}
