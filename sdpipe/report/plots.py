"""The report's plots, drawn with matplotlib's object API (no pyplot: no global backend or figure state).

PNGs are byte-stable for equal data: no "Software" metadata (it carries the matplotlib version) and fixed sizes.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

STYLE = {"svg.hashsalt": "sdpipe-report", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3}


def _figure(panels: int, height: float = 3.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * panels, height), dpi=100, layout="constrained")
    return fig, fig.subplots(1, panels)


def _y(values) -> list[float]:
    # A missing number is a gap in the line, not an error.
    return [float("nan") if v is None else float(v) for v in values]


def _save(fig, path: Path) -> None:
    fig.savefig(path, format="png", metadata={"Software": None})


def loss_lr(rows: list[dict], path: Path) -> None:
    """Loss and learning rate against the optimizer step, side by side."""
    steps = [r["step"] for r in rows]
    with matplotlib.rc_context(STYLE):
        fig, (loss, lr) = _figure(2)
        loss.plot(steps, _y(r["loss"] for r in rows), marker=".", color="C0", label="training")
        held = [(r["step"], r["heldout_loss"]) for r in rows if r.get("heldout_loss") is not None]
        if held:  # train.validation.heldout_every: the eval split at fixed timesteps and noise
            loss.plot(*zip(*held), marker="o", color="C3", label="held-out")
            loss.legend()
        loss.set(title="loss", xlabel="optimizer step", ylabel="loss (mean over the logged steps)")
        lr.plot(steps, _y(r["lr"] for r in rows), marker=".", color="C1")
        lr.set(title="learning rate", xlabel="optimizer step", ylabel="lr")
        lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        _save(fig, path)


def throughput(rows: list[dict], path: Path) -> None:
    """Samples/s (all processes, and per GPU) and the share of time spent waiting for data."""
    steps = [r["step"] for r in rows]
    with matplotlib.rc_context(STYLE):
        fig, (speed, wait) = _figure(2)
        speed.plot(steps, _y(r.get("samples_per_s") for r in rows), marker=".", label="all processes")
        if any(r.get("samples_per_s_per_gpu") != r.get("samples_per_s") for r in rows):
            speed.plot(steps, _y(r.get("samples_per_s_per_gpu") for r in rows), marker=".", label="per GPU")
        speed.set(title="training throughput", xlabel="optimizer step", ylabel="samples/s")
        speed.set_ylim(bottom=0)
        speed.legend()
        wait.plot(steps, [100 * (r.get("data_wait") or 0.0) for r in rows], marker=".", color="C2")
        wait.set(title="time waiting for data", xlabel="optimizer step", ylabel="% of the logging window")
        wait.set_ylim(bottom=0)
        _save(fig, path)


def scaling(entries: list[dict], path: Path) -> None:
    """Samples/s and efficiency against the GPU count, each with its ideal (linear from the smallest run)."""
    entries = sorted(entries, key=lambda e: e["gpus"])
    gpus = [e["gpus"] for e in entries]
    base = entries[0]["samples_per_s"] / entries[0]["gpus"]
    with matplotlib.rc_context(STYLE):
        fig, (speed, eff) = _figure(2)
        speed.plot(gpus, [e["samples_per_s"] for e in entries], marker="o", label="measured")
        speed.plot(gpus, [base * g for g in gpus], linestyle="--", color="grey", label="ideal (linear)")
        speed.set(title="scaling", xlabel="GPUs", ylabel="samples/s", xticks=gpus)
        speed.legend()
        eff.plot(gpus, _y(e.get("efficiency") for e in entries), marker="o", color="C1", label="measured")
        eff.axhline(1.0, linestyle="--", color="grey", label="ideal")
        eff.set(title="scaling efficiency", xlabel="GPUs", ylabel="efficiency", xticks=gpus)
        eff.set_ylim(0, 1.1 * max([1.0] + [e.get("efficiency") or 0 for e in entries]))
        eff.legend()
        _save(fig, path)
