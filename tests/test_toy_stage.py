"""A new stage, added the way docs/ARCHITECTURE.md's checklist says and touching only the files it names, runs under
Snakemake, reruns when a key it declares changes, and gets its DVC stage: the checklist is complete."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from sdpipe import dvc_file
from tests.workflow_helpers import make_project, run

pytestmark = pytest.mark.slow

STAGE = '''"""Count the words of every caption (a toy stage, made by tests/test_toy_stage.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io
from sdpipe.stages import read_upstream

if TYPE_CHECKING:
    from sdpipe.config import Config

INPUTS = {"captions": "results/captions/captions.jsonl"}
OUTPUTS = {"summary": "results/wordcount/summary.json"}
# The config keys the outputs depend on (stages/declared.py).
READS = ("caption",)


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> None:
    rows = read_upstream(inputs["captions"], "caption")
    words = {row["path"]: len((row["caption"] or "").split()) for row in rows}
    io.write_json(outputs["summary"], {"words": words, "template": cfg.caption.template})
'''

RULE = """

rule wordcount:
    input:
        captions=rules.caption.output.captions,
    output:
        summary="results/wordcount/summary.json",
    log:
        "logs/wordcount.log",
    benchmark:
        "benchmarks/wordcount.tsv"
    conda:
        "../envs/sdpipe.yaml"
    params:
        config=RESOLVED_CONFIG,
        settings=settings_of("wordcount"),
    shell:
        "sdpipe wordcount --config {params.config:q} --captions {input.captions:q} --summary {output.summary:q} "
        "> {log:q} 2>&1"
"""


def _add_the_stage(proj: Path) -> set[str]:
    """Checklist steps 1, 2, 4, 5 and 6 (step 3, a config section of its own, does not apply: the stage reads
    caption.*). Returns the files touched, relative to the project."""
    (proj / "sdpipe/stages/wordcount.py").write_text(STAGE)
    _edit(
        proj / "sdpipe/cli.py",
        '    "card": "sdpipe.stages.card",\n',
        '    "card": "sdpipe.stages.card",\n    "wordcount": "sdpipe.stages.wordcount",\n',
    )
    (proj / "workflow/rules/data.smk").write_text((proj / "workflow/rules/data.smk").read_text() + RULE)
    _edit(
        proj / "sdpipe/dvc_file.py",
        "\n}\n# fmt: on",
        '\n    "wordcount": Stage("wordcount", "wordcount", [CAPTIONS], [], ["results/wordcount/summary.json"]),'
        "\n}\n# fmt: on",
    )
    _edit(
        proj / "Snakefile",
        "        rules.card.output,\n",
        "        rules.card.output,\n        rules.wordcount.output,\n",
    )
    return {"sdpipe/stages/wordcount.py", "sdpipe/cli.py", "workflow/rules/data.smk", "sdpipe/dvc_file.py", "Snakefile"}


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path.name} no longer holds {old!r}: update the checklist and this test"
    path.write_text(text.replace(old, new, 1))


def _checklist() -> str:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    return doc.split("## Checklist: adding a stage", 1)[1].split("\n## ", 1)[0]


def test_a_stage_added_by_the_checklist_runs_and_reruns(tmp_path, demo_source):
    proj = make_project(tmp_path / "proj", demo_source, with_code=True, prepare={"eval_fraction": 0.0, "workers": 1})
    touched = _add_the_stage(proj)
    generic = {f.replace("wordcount", "foo").replace("data.smk", "<phase>.smk") for f in touched}
    assert all(f"`{f}`" in _checklist() for f in generic), "every file the stage needed is in the checklist"
    env = {**os.environ, "PYTHONPATH": str(proj)}  # the project's copy of sdpipe, with the new stage
    run_env = lambda cmd: run(cmd, proj, env=env)
    run_env([sys.executable, "-m", "snakemake", "--cores", "1", "wordcount"])
    counts = json.loads((proj / "results/wordcount/summary.json").read_text())
    assert len(counts["words"]) == 40 and all(n > 0 for n in counts["words"].values())

    cfg_path = proj / "config" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["caption"]["template"] = "{stem} shape"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    dry = run_env([sys.executable, "-m", "snakemake", "-n", "wordcount"]).stdout
    assert "wordcount" in dry and "caption" in dry, "a key it READS changed, so it reruns"

    run_env([sys.executable, "-m", "sdpipe", "dvc-yaml"])
    stage = yaml.safe_load((proj / "dvc.yaml").read_text())["stages"]["wordcount"]
    assert stage["params"] == [{"config/config.yaml": ["caption"]}]
    assert "sdpipe/stages/wordcount.py" in stage["deps"] and dvc_file.CAPTIONS in stage["deps"]
