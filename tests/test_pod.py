"""The pod image's start-up (`sdpipe pod`, the Dockerfile's entrypoint), run as a plain command: GPU detection,
state on the volume, the settings it writes and the commands it runs. The image itself is not built here (no
Docker engine); the Dockerfile is checked against the repository it copies from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sdpipe import parallel
from tests.conftest import REPO

SMI = "#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})'\n" for i in range(4))


def fake_tools(tmp_path: Path) -> Path:
    """A bin folder with an nvidia-smi listing 4 GPUs and a snakemake that records how it was called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(SMI)
    (bin_dir / "snakemake").write_text(
        "#!/bin/sh\n"
        f"{sys.executable} -c 'import json, os, sys; "
        'print(json.dumps([sys.argv[1:], os.getcwd(), os.environ["HF_HOME"]]))\''
        ' "$@" >> "$SDPIPE_TEST_CALLS"\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def pod_env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        PATH=f"{fake_tools(tmp_path)}:{env['PATH']}",
        SDPIPE_WORKSPACE=str(tmp_path / "workspace"),
        SDPIPE_IMAGE_PROJECT=str(REPO),
        SDPIPE_TEST_CALLS=str(tmp_path / "calls.jsonl"),
        **extra,
    )
    return env


def pod(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdpipe", "pod", *args], env=env, capture_output=True, text=True, check=True
    )


@pytest.mark.parametrize("visible, expected", [("0,1,2", 3), ("", 0), ("-1", 0), ("GPU-aa,GPU-bb", 2)])
def test_gpu_count_from_cuda_visible_devices(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert parallel.detect_gpu_count() == expected


def test_gpu_count_from_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", f"{fake_tools(tmp_path)}:{os.environ['PATH']}")
    assert parallel.detect_gpu_count() == 4


def test_prepare_seeds_the_project_and_writes_settings_on_the_volume(tmp_path):
    env = pod_env(tmp_path, SDPIPE_TARGET="report", SDPIPE_SNAKEMAKE_ARGS="--keep-going")
    plan = json.loads(pod(env, "--prepare-only").stdout)
    ws = tmp_path / "workspace"
    project = ws / "project"
    assert plan["gpus"] == 4 and plan["project"] == str(project)
    assert (project / "Snakefile").is_file() and (project / "workflow" / "rules").is_dir()
    assert (project / "runpod" / "config.yaml").is_file(), "the ./runpod profile link must resolve"
    assert all(Path(v).is_relative_to(ws) for v in plan["env"].values()), plan["env"]
    settings = yaml.safe_load(Path(plan["accelerate_config"]).read_text())
    assert Path(plan["accelerate_config"]) == ws / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    assert (settings["distributed_type"], settings["num_processes"], settings["use_cpu"]) == ("MULTI_GPU", 4, False)
    assert plan["commands"] == [
        ["snakemake", "--profile", "runpod", "--unlock"],
        ["snakemake", "--profile", "runpod", "--resources", "gpu=4", "--keep-going", "report"],
    ]
    # A restarted pod keeps the user's project as it is.
    (project / "config" / "config.yaml").write_text("seed: 7\n")
    pod(env, "--prepare-only")
    assert (project / "config" / "config.yaml").read_text() == "seed: 7\n"


def test_cpu_only_container_runs_one_process(tmp_path):
    env = pod_env(tmp_path, CUDA_VISIBLE_DEVICES="")
    plan = json.loads(pod(env, "--dry-run").stdout)
    assert plan["gpus"] == 0 and "gpu=0" in plan["commands"][1]
    assert not (tmp_path / "workspace").exists(), "a dry run writes nothing"


def test_start_runs_snakemake_in_the_project_with_caches_on_the_volume(tmp_path):
    env = pod_env(tmp_path, SDPIPE_KEEP_ALIVE="0")
    pod(env)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    project, hf_home = tmp_path / "workspace" / "project", tmp_path / "workspace" / ".cache" / "huggingface"
    assert [c[0] for c in calls] == [
        ["--profile", "runpod", "--unlock"],
        ["--profile", "runpod", "--resources", "gpu=4"],
    ]
    assert all(Path(c[1]) == project and Path(c[2]) == hf_home for c in calls)


def test_dockerfile_copies_what_the_repository_has():
    lines = [line.split() for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    sources = [src for parts in lines for src in parts[1:-1]]
    assert "requirements/constraints.txt" in sources and "sdpipe" in sources
    missing = [src for src in sources if not (REPO / src).exists()]
    assert not missing, f"the Dockerfile copies files the repository lacks: {missing}"
    assert 'ENTRYPOINT ["tini", "--", "sdpipe", "pod"]' in (REPO / "Dockerfile").read_text()


def test_constraints_pin_versions_an_index_serves():
    """A direct reference (`name @ file:///...`) from `pip freeze` names a file on one machine: a fresh clone's
    `make setup` (CI, the Docker image) cannot install it."""
    pins = [
        line
        for line in (REPO / "requirements/constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9_.+!\-]+", p) for p in pins), [
        p for p in pins if "==" not in p or "@" in p
    ]
