"""No stage deletes a folder it did not create (issue 26, item 2): with a preset set, a model folder sdpipe did not
build stops the workflow in one line, before Snakemake removes the rule's output to rebuild it."""

from __future__ import annotations

from tests.workflow_helpers import make_project, run


def test_a_preset_never_replaces_a_users_model_folder(tmp_path):
    project = make_project(tmp_path / "p", None)  # the shipped build_preset: tiny at models/tiny
    users = project / "models" / "tiny"
    users.mkdir(parents=True)
    (users / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    proc = run(["snakemake", "--cores", "1", "--forcerun", "base_model", "--", "base_model"], project, check=False)
    assert proc.returncode != 0
    assert "sdpipe did not build" in proc.stderr and "Traceback" not in proc.stderr
    assert (users / "model_index.json").read_text() == '{"_class_name": "StableDiffusionPipeline"}'


def test_a_preset_sdpipe_built_is_rebuilt_in_place(tmp_path):
    project = make_project(tmp_path / "p", None)
    run(["snakemake", "--cores", "1", "base_model"], project)
    run(["snakemake", "--cores", "1", "--forcerun", "base_model", "--", "base_model"], project)
    assert (project / "models" / "tiny" / "sdpipe_preset.json").is_file()
