"""The package as users install it: a wheel, not this checkout.

The Docker image does `pip install .` and then runs the workflow from a project folder seeded with the workflow
files (`sdpipe pod`, pod.TEMPLATE). Here the same two steps run into a fresh target folder, and the commands run
from a project folder that has no sdpipe/ source in it, so anything the package finds only through the checkout
fails here as it would in the image.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sdpipe.ops import pod
from tests.conftest import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """sdpipe built as a wheel and installed (no editable link) into its own target folder."""
    root = tmp_path_factory.mktemp("install")
    wheels, target = root / "wheels", root / "site"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)], check=True, cwd=root
    )
    wheel = next(wheels.glob("sdpipe-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)], check=True)
    return target


def project_env(site: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(site), "PATH": f"{site / 'bin'}{os.pathsep}{env['PATH']}"}


def run(cmd: list[str], cwd: Path, site: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=project_env(site), capture_output=True, text=True)
    assert proc.returncode == 0, f"{shlex.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture()
def project(tmp_path, demo_source) -> Path:
    """A project folder as `sdpipe pod` seeds it from the image, with a few images and a CPU config."""
    folder = tmp_path / "project"
    assert pod.seed_project(folder, REPO)
    assert not (folder / "sdpipe").exists()
    raw = folder / "data" / "raw"
    raw.mkdir(parents=True)
    for image in sorted(demo_source.rglob("*.png"))[:6]:
        (raw / image.name).write_bytes(image.read_bytes())
    return folder


def test_the_installed_package_is_the_one_imported(installed, tmp_path):
    proc = run(
        [
            sys.executable,
            "-c",
            "import sdpipe, sdpipe.config as c; print(sdpipe.__file__); print(len(c.load_schema()['properties']))",
        ],
        tmp_path,
        installed,
    )
    where, sections = proc.stdout.split()
    assert Path(where).is_relative_to(installed), where
    assert int(sections) > 5


def test_check_config_and_a_stage_run_from_a_project_folder(installed, project):
    run(["sdpipe", "check-config"], project, installed)
    run(["sdpipe", "check-config", "--set", "train.learning_rate=1.0e-5"], project, installed)
    cfg = yaml.safe_load((project / "config" / "config.yaml").read_text())
    cfg["prepare"] = {**cfg["prepare"], "workers": 1, "eval_fraction": 0.0}
    (project / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    run(["sdpipe", "prepare"], project, installed)
    rows = (project / "results" / "prepare" / "manifest.jsonl").read_text().splitlines()
    assert len(rows) == 6


def test_snakemake_plans_the_whole_dag_with_the_installed_package(installed, project):
    proc = run([sys.executable, "-m", "snakemake", "-n", "--cores", "1"], project, installed)
    planned = {line.split()[0] for line in proc.stdout.split("Job stats:")[1].splitlines()[3:] if line.strip()}
    assert {"prepare", "caption", "latents", "train", "export", "evaluate", "report", "card", "all"} <= planned, planned
    assert not (project / "results" / "config.resolved.yaml").exists()  # a dry run writes nothing stages read


def test_init_from_the_installed_package_makes_a_project_snakemake_plans(installed, tmp_path, demo_source, tiny_model):
    """`sdpipe init` as in the image: templates ship in the wheel, the workflow comes from the image's project
    (SDPIPE_IMAGE_PROJECT; here this checkout stands in for /opt/sdpipe)."""
    env_project = {"SDPIPE_IMAGE_PROJECT": str(REPO)}
    job = tmp_path / "job"
    cmd = [
        "sdpipe",
        "init",
        str(job),
        "--template",
        "sd15-lora",
        "--images",
        str(demo_source),
        "--model",
        str(tiny_model),
        "--prompt",
        "a red circle",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**project_env(installed), **env_project}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert not (job / "sdpipe").exists() and (job / "Snakefile").is_file()
    fast = {"prepare": {"min_size": 32, "buckets": {"resolution": 32, "step": 8}}}
    (job / "fast.yaml").write_text(yaml.safe_dump(fast))
    proc = run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", "config/config.yaml", "fast.yaml"],
        job,
        installed,
    )
    assert "rule train:" in proc.stdout and "rule base_model" not in proc.stdout


def dockerfile() -> list[list[str]]:
    return [line.split() for line in (REPO / "Dockerfile").read_text().splitlines() if line.strip()]


def test_the_dockerfile_takes_the_same_path():
    """The image installs the package without an editable link and copies into its project template exactly what
    `sdpipe pod` seeds a project with (pod.TEMPLATE), the steps the tests above take."""
    lines = dockerfile()
    text = (REPO / "Dockerfile").read_text()
    installs = [
        " ".join(parts)
        for parts in lines
        if "pip" in parts and "install" in parts and any(p.startswith('".[workflow') for p in parts)
    ]
    assert installs and not any(" -e " in f" {line} " or "--editable" in line for line in installs), installs
    copied = {src for parts in lines if parts[0] == "COPY" for src in parts[1:-1]}
    linked = {parts[-1] for parts in lines if parts[:3] == ["RUN", "ln", "-s"]}
    assert set(pod.TEMPLATE) <= copied | linked, set(pod.TEMPLATE) - copied - linked
    assert "rm -rf sdpipe" in text, "the image's project template must hold no sdpipe/ source after the install"
