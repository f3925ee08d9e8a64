"""End to end through Snakemake on a temporary copy of the demo data: the DAG, incremental reruns, lint, profiles."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from sdpipe import demo
from tests.workflow_helpers import REPO, make_project, run

pytestmark = pytest.mark.slow
SMALL = {"eval_fraction": 0.0, "workers": 1}


def summary(project, stage):
    return json.loads((project / "results" / stage / "summary.json").read_text())


@pytest.fixture(scope="module")
def project(tmp_path_factory, demo_source):
    """One Snakemake run through `latents`, shared by the tests that read its results. The VAE is the preset's
    (not trained on the data, as with any pretrained model), so adding images encodes only those."""
    proj = make_project(
        tmp_path_factory.mktemp("wf") / "proj", demo_source, prepare=SMALL, model={"train_vae": {"enabled": False}}
    )
    run(["snakemake", "--cores", "2", "latents"], proj)
    return proj


def test_dag_runs_through_latents(project):
    prep = summary(project, "prepare")
    assert prep["accepted"] == 40 and prep["rejected"] == 0
    cap = summary(project, "captions")
    assert (cap["captioned"], cap["reused"], cap["failed"]) == (40, 0, 0)
    assert cap["by_source"]["template"] > 0 and cap["by_source"]["sidecar"] > 0
    lat = summary(project, "latents")
    assert (lat["encoded"], lat["reused"], lat["failed"]) == (40, 0, 0)
    assert (project / "models" / "tiny" / "model_index.json").is_file()
    for log in ("base_model", "prepare", "caption", "latents"):
        assert (project / "logs" / f"{log}.log").is_file()
    assert (project / "benchmarks" / "latents.tsv").is_file()


def test_adding_three_images_recomputes_only_those(project, tmp_path):
    extra = tmp_path / "extra"
    demo.generate(extra, count=3, seed=7)
    new_dir = project / "data" / "raw" / "new"
    new_dir.mkdir()
    for f in extra.rglob("*"):
        if f.is_file():
            shutil.copy(f, new_dir / f"new_{f.name}")
    run(["snakemake", "--cores", "2", "latents"], project)
    prep = summary(project, "prepare")
    assert (prep["accepted"], prep["decoded"], prep["reused"]) == (43, 3, 40)
    cap, lat = summary(project, "captions"), summary(project, "latents")
    assert (cap["captioned"], cap["reused"]) == (3, 40)
    assert (lat["encoded"], lat["reused"]) == (3, 40)
    again = run(["snakemake", "--cores", "2", "latents"], project)
    assert "Nothing to be done" in again.stdout + again.stderr


def test_named_targets_run_the_dag_up_to_that_stage(tmp_path, demo_source):
    proj = make_project(tmp_path / "p", demo_source, prepare=SMALL)
    run(["snakemake", "--cores", "2", "prepare"], proj)
    assert (proj / "results/prepare/manifest.jsonl").is_file()
    assert not (proj / "results/captions").exists() and not (proj / "models").exists()


def test_missing_raw_folder_fails_with_one_clear_line(tmp_path):
    proj = make_project(tmp_path / "p", None)
    proc = run(["snakemake", "--cores", "1", "prepare"], proj, check=False)
    assert proc.returncode != 0
    log = (proj / "logs" / "prepare.log").read_text()
    assert "data.raw_dir" in log and "Traceback" not in log


def test_bad_config_stops_before_any_job(tmp_path):
    proj = make_project(tmp_path / "p", None, latents={"dtype": "fp8"})
    proc = run(["snakemake", "--cores", "1", "-n"], proj, check=False)
    assert proc.returncode != 0
    assert "latents.dtype = 'fp8' is not allowed; expected one of ['fp32', 'fp16', 'bf16']" in proc.stderr
    assert "Traceback" not in proc.stderr and not (proj / "results" / "prepare").exists()


def test_the_workflow_refuses_a_demo_preset_over_a_real_model_before_any_job(tmp_path):
    proj = make_project(tmp_path / "p", None, model={"pretrained": "stable-diffusion-v1-5/stable-diffusion-v1-5"})
    proc = run(["snakemake", "--cores", "1", "-n"], proj, check=False)
    assert proc.returncode != 0 and "set model.build_preset: null" in proc.stderr
    assert "Traceback" not in proc.stderr and not (proj / "models").exists()


def test_snakemake_reads_1e_4_as_the_number_check_config_reads(tmp_path):
    """One effective config: a learning rate written 1e-4 reaches the stages as 0.0001 through Snakemake too."""
    proj = make_project(tmp_path / "p", None)
    cfg_path = proj / "config" / "config.yaml"
    text = yaml.safe_load(cfg_path.read_text())
    text["train"]["learning_rate"] = "LR"
    cfg_path.write_text(yaml.safe_dump(text, sort_keys=False).replace("LR", "1e-4"))
    run(["snakemake", "--cores", "1", "base_model"], proj)  # a run that executes writes the config its stages read
    assert yaml.safe_load((proj / "results" / "config.resolved.yaml").read_text())["train"]["learning_rate"] == 1e-4


def test_a_users_configfile_means_what_check_config_says(tmp_path):
    """One effective config: `snakemake --configfile my.yaml` gives the stages exactly what `sdpipe check-config
    --config my.yaml` validates (schema defaults under the user's file), with nothing inherited from the demo's
    config/config.yaml (its train_vae, learning rate, text encoder)."""
    proj = make_project(tmp_path / "p", None)
    mine = {
        "model": {"pretrained": "models/tiny", "build_preset": "tiny"},
        "prepare": {"buckets": {"resolution": 32, "step": 8}},
        "train": {"max_steps": 3},
    }
    (proj / "my.yaml").write_text(yaml.safe_dump(mine))
    run(["snakemake", "--cores", "1", "--configfile", "my.yaml", "--config", "seed=7", "--", "base_model"], proj)
    resolved = yaml.safe_load((proj / "results" / "config.resolved.yaml").read_text())
    from sdpipe import config

    assert resolved == config.load(proj / "my.yaml", ["seed=7"]).raw
    demo_cfg = yaml.safe_load((proj / "config" / "config.yaml").read_text())
    assert demo_cfg["model"]["train_vae"]["enabled"] and not resolved["model"]["train_vae"]["enabled"]
    assert resolved["train"]["text_encoder"]["mode"] == "none" and resolved["train"]["learning_rate"] == 1e-4
    assert resolved["seed"] == 7 and resolved["train"]["max_steps"] == 3


def test_a_single_file_base_model_is_an_input_of_the_stages_that_load_it(tmp_path):
    """Replacing an A1111/ComfyUI checkpoint file in place reruns what used it (a folder's content is keyed by
    hashes in the caches instead)."""
    ckpt = tmp_path / "my-model.safetensors"
    ckpt.write_bytes(b"not read by a dry run")
    proj = make_project(
        tmp_path / "p",
        None,
        model={"pretrained": str(ckpt), "build_preset": None, "train_vae": {"enabled": False}},
        prepare={"buckets": {"resolution": 512, "step": 64}},
    )
    proc = run(["snakemake", "-n", "--cores", "1", "export"], proj)
    jobs = proc.stdout.split("rule ")
    for rule in ("latents", "train", "export"):
        job = next(j for j in jobs if j.startswith(rule + ":"))
        assert str(ckpt) in job.split("output:")[0], f"{rule} does not list the checkpoint as input"


def test_lint_is_clean():
    proc = run(["snakemake", "--lint"], REPO)
    assert "Congratulations, your workflow is in a good condition!" in proc.stdout + proc.stderr


def test_profiles_parse(tmp_path, demo_source):
    proj = make_project(tmp_path / "p", demo_source)
    runpod = run(["snakemake", "--profile", "runpod", "-n"], proj)
    assert "latents" in runpod.stdout
    slurm = run(["snakemake", "--profile", "profiles/slurm", "-n", "-p"], proj)
    assert "latents" in slurm.stdout
    # Training: one 2-node allocation; srun starts one `sdpipe train` per node, which resolves "auto" there.
    train_job = slurm.stdout[slurm.stdout.index("rule train:") :].split("\n\n")[0]
    assert "nodes=2, tasks=2, tasks_per_gpu=0, gres=gpu:8" in train_job
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 sdpipe train" in train_job
    assert "--set train.num_processes=auto" in train_job
    # Kubernetes keeps data in a storage provider (S3 in the profile); a local folder stands in for the bucket,
    # holding the raw images as a user's upload would.
    shutil.copytree(proj / "data" / "raw", tmp_path / "bucket" / "data" / "raw")
    k8s = run(
        [
            "snakemake",
            "--profile",
            "profiles/kubernetes",
            "-n",
            "--default-storage-provider",
            "fs",
            "--default-storage-prefix",
            str(tmp_path / "bucket"),
        ],
        proj,
    )
    assert "rule train:" in k8s.stdout and "gpu=8" in k8s.stdout


def test_changing_only_training_settings_reruns_only_training(project):
    cfg_path = project / "config" / "config.yaml"
    original = cfg_path.read_text()
    try:
        cfg = yaml.safe_load(original)
        cfg["caption"]["batch_size"] = cfg["caption"]["batch_size"] + 1  # a caption setting: caption reruns
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        assert "caption" in _planned(project)
        cfg = yaml.safe_load(original)
        cfg["train"]["learning_rate"] = cfg["train"]["learning_rate"] / 2
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        assert _planned(project) == {"train", "export", "evaluate", "report", "card", "all"}  # not the data stages
    finally:
        cfg_path.write_text(original)


def _planned(project) -> set[str]:
    """Rules a dry run of the whole DAG would execute, read from its "Job stats" table."""
    proc = run(["snakemake", "--cores", "2", "-n", "--quiet", "rules"], project)
    lines = (proc.stdout + proc.stderr).splitlines()
    start = lines.index("Job stats:") + 3  # skip the header and the dashes
    rows = []
    for line in lines[start:]:
        if line.split()[0] == "total":
            break
        rows.append(line.split()[0])
    return set(rows)


def test_a_dry_run_leaves_the_config_a_running_pipeline_reads(tmp_path):
    """Issue 26, item 4: `snakemake -n --configfile other.yaml` beside a running pipeline once rewrote
    results/config.resolved.yaml under it; only a run that executes, holding the project's lock, writes it."""
    proj = make_project(tmp_path / "p", None)
    run(["snakemake", "--cores", "1", "-n"], proj)
    assert not (proj / "results" / "config.resolved.yaml").exists()
    run(["snakemake", "--cores", "1", "base_model"], proj)
    resolved = proj / "results" / "config.resolved.yaml"
    before = resolved.read_bytes()
    (proj / "other.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"pretrained": "models/tiny", "build_preset": "tiny"},
                "train": {"learning_rate": 0.5, "max_steps": 2},
            }
        )
    )
    proc = run(["snakemake", "--cores", "1", "-n", "--configfile", "other.yaml"], proj)
    assert "rule train" in proc.stdout  # the dry run planned the other config's jobs
    assert resolved.read_bytes() == before
