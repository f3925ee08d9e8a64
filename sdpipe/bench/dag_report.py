"""The DAG benchmark's Markdown: one table of stage wall times per job, then the rates behind them."""

from __future__ import annotations

STAGES = ("prepare", "caption", "latents", "train", "export", "evaluate", "report", "card")  # the DAG's order
NON_TRAINING_TARGET = 0.20  # issue 24: every stage but training at most 20 % of the sd15 full fine-tune's DAG


def _f(x, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def stage_table(res: dict) -> list[str]:
    dag = res["dag_s"]
    lines = ["| stage | wall s | share of the DAG |", "|---|---|---|"]
    order = {stage: i for i, stage in enumerate(STAGES)}
    for stage, seconds in sorted(res["stages_s"].items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])):
        lines.append(f"| {stage} | {seconds:.1f} | {100 * seconds / dag:.1f} % |")
    overhead = res["snakemake_overhead_s"]
    lines.append(
        f"| Snakemake itself (parsing, scheduling, between jobs) | {overhead:.1f} | {100 * overhead / dag:.1f} % |"
    )
    lines.append(f"| **whole DAG** | **{dag:.1f}** | 100 % |")
    return lines


def job_lines(name: str, res: dict) -> list[str]:
    j, t, e, ev = res["job"], res["train"], res["export"], res["evaluate"]
    share = res["non_training_share"]
    layout = (res.get("data") or {}).get("layout", "files")
    lines = (
        [
            f"### {name}: {j['images']} JPEGs at {j['resolution']} px"
            f"{' in webdataset tar shards' if layout == 'tar' else ''}, template {j['template']} on the random-init "
            f"{j['preset']} preset, batch {j['batch']}, {j['steps']} steps",
            "",
        ]
        + stage_table(res)
        + [""]
    )
    verdict = ""
    if name == "sd15-full":
        verdict = f" (target at most {NON_TRAINING_TARGET:.0%}: {'met' if share <= NON_TRAINING_TARGET else 'missed'})"
    lines.append(
        f"- Everything but training: {res['dag_s'] - res['stages_s'].get('train', 0):.1f} s, "
        f"{share:.1%} of the DAG{verdict}."
    )
    lines.append(
        f"- Training ({t['compile']}): steady {_f(t['samples_per_s'])} samples/s; warm-up "
        f"{_f(t['warmup_s'])} s, of which compiling {_f(t['compile_s'])} s; first optimizer step "
        f"{_f(t['time_to_first_step_s'])} s after the stage started (cold compile caches); validation and "
        f"checkpoints {_f(t['validation_and_checkpoint_s'])} s."
    )
    if res.get("warm_start"):
        w = res["warm_start"]
        lines.append(
            f"- Second run, compile caches warm: first optimizer step after {_f(w['time_to_first_step_s'])} s "
            f"(compiling {_f(w['compile_s'])} s); steady {_f(w['samples_per_s'])} samples/s over {w['steps']} steps."
        )
    lines += remote_lines(res)
    verified = [k for k, v in e.items() if isinstance(v, dict) and v["verified"]]
    diffs = ", ".join(f"{k} {v['mean_abs_diff']}" for k, v in e.items() if isinstance(v, dict))
    lines.append(
        f"- Export: {', '.join(verified)} verified on {e.get('rendered_on')} (mean |diff| in RGB levels: {diffs})."
    )
    lines.append(
        f"- Evaluation: {ev['images']} images at {_f(ev['images_per_s'], '.2f')} images/s after warm-up; "
        f"model loading {_f(ev['load_s'])} s, warm-up {_f(ev['warmup_s'])} s."
    )
    lat = res["latents"]
    lines.append(
        f"- Latent caching: {_f(lat.get('images_per_s_after_warmup'))} images/s after warm-up; "
        f"{_f(lat['images_per_s'])} images/s over the stage's {_f(lat['seconds'])} s of encoding, start-up included."
    )
    return lines


def remote_lines(res: dict) -> list[str]:
    lines = []
    mirrored = (res.get("prepare") or {}).get("raw_remote")
    if mirrored:
        lines.append(
            f"- prepare mirrored the images from data.raw_remote ({mirrored['url']}): {mirrored['objects']} objects, "
            f"{mirrored['downloaded']} downloaded."
        )
    r = res.get("from_remote")
    if not r:
        return lines
    return lines + [
        f"- Training with no local latent cache, every shard fetched from latents.remote "
        f"({res['data']['latents_remote']}) on first use: first optimizer step after "
        f"{_f(r['time_to_first_step_s'])} s, steady {_f(r['samples_per_s'])} samples/s over {r['steps']} steps; "
        f"{r['fetched_files']} of {r['local_files']} store files fetched ({r['fetched_mb']} MB)."
    ]


def baseline_lines(res: dict) -> list[str]:
    b = res.get("baseline")
    if not b:
        return []
    return [
        "",
        f"- diffusers' train_text_to_image.py on the same images and model, {b['steps']} steps at batch "
        f"{b['batch']}: {b['wall_s']:.1f} s in all ({b['startup_s']:.1f} s before its first step, then "
        f"{b['samples_per_s']:.1f} samples/s). At {b['projected_steps']} steps: "
        f"{b['projected_s']:.1f} s{' (projected from this run)' if b['projected'] else ''}, against "
        f"{res['dag_s']:.1f} s for sdpipe's whole DAG.",
    ]


def markdown(results: dict) -> str:
    meta = results["meta"]
    gpu = (meta.get("gpu") or {}).get("name") or "no GPU"
    lines = [f"## The whole DAG, `snakemake --profile runpod` ({gpu}, commit {meta.get('git_commit')})", ""]
    for name, res in results["jobs"].items():
        lines += job_lines(name, res) + baseline_lines(res) + [""]
    return "\n".join(lines)
