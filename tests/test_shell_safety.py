"""No config value reaches a shell unquoted (issue 26, item 1): every value a rule's shell command takes is quoted
with Snakemake's `:q`, and a model path made to look like a command builds a model at that literal path instead.
"""

from __future__ import annotations

import re

from tests.workflow_helpers import REPO, make_project, run

PLACEHOLDER = re.compile(r"\{((?:params|input|output|resources|wildcards)(?:\.\w+)?|log)(:\w+)?\}")
# A profile's command prefix (profiles/slurm's srun), written by whoever runs the workflow, not by a config file.
UNQUOTED_ON_PURPOSE = {"params.launcher"}


def test_every_shell_placeholder_is_quoted():
    found = []
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for name, fmt in PLACEHOLDER.findall(smk.read_text()):
            found.append(name)
            assert fmt == ":q" or name in UNQUOTED_ON_PURPOSE, f"{smk.name}: {{{name}{fmt}}} reaches the shell unquoted"
    assert len(found) > 40  # the rules' commands were all seen


def test_a_model_path_that_looks_like_a_command_is_not_run(tmp_path):
    marker = tmp_path / "pwned"
    pretrained = f"models/x; touch {marker}; echo /tiny"  # named after its preset, as the config check wants
    project = make_project(tmp_path / "p", None, model={"pretrained": pretrained, "build_preset": "tiny"})
    run(["snakemake", "--cores", "1", "base_model"], project)
    assert not marker.exists()
    assert (project / pretrained / "model_index.json").is_file()
