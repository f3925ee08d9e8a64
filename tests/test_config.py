"""Config validation: defaults, one-line errors naming key, value and what is allowed, the CLI's exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from sdpipe import config
from sdpipe.errors import UserError

REPO_CONFIG = "config/config.yaml"


def test_shipped_config_is_valid_and_lists_every_key():
    raw = yaml.safe_load(open(REPO_CONFIG))
    cfg = config.from_dict(raw)
    assert cfg.model.build_preset == "tiny" and cfg.prepare.buckets.step == 8
    filled = config.validate_dict(raw)
    assert filled == raw, "config/config.yaml should spell out every key the schema knows"


def test_empty_config_takes_schema_defaults():
    cfg = config.from_dict({})
    assert cfg.data.raw_dir == "data/raw" and cfg.latents.dtype == "fp16" and cfg.caption.gpus == "auto"
    assert cfg.prepare.buckets.resolution == 512


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            {"latents": {"dtype": "fp8"}},
            "latents.dtype = 'fp8' is not allowed; expected one of ['fp32', 'fp16', 'bf16']",
        ),
        ({"data": {"raw_dri": "x"}}, "unknown key data.raw_dri"),
        ({"caption": {"gpus": -1}}, "caption.gpus = -1"),
        ({"prepare": {"eval_fraction": 0.9}}, "expected a value from 0 to 0.5"),
        ({"caption": {"chain": ["sidecar", "blipp"]}}, "caption.chain[1] = 'blipp'"),
        ({"prepare": {"min_size": "big"}}, "prepare.min_size = 'big' is not allowed; expected a value of type integer"),
        ({"model": {"build_preset": "xl"}}, "expected null or one of ['tiny', 'sd15', 'sdxl', 'tiny-sd3'"),
        ({"seed": -1}, "seed = -1 is not allowed; expected a value >= 0"),
        (
            {"export": {"name": "my dog"}},
            "export.name = 'my dog' is not allowed; expected a file stem of letters, digits",
        ),
        ({"export": {"name": "../up"}}, "export.name = '../up' is not allowed; expected a file stem"),
        ({"export": {"name": "dog.safetensors"}}, "without .safetensors"),
    ],
)
def test_bad_values_name_key_value_and_allowed(raw, expected):
    with pytest.raises(UserError) as err:
        config.from_dict(raw)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_mistyped_key_gets_the_key_it_probably_meant():
    with pytest.raises(UserError) as err:
        config.from_dict({"train": {"learnig_rate": 1e-4}})
    assert "unknown key train.learnig_rate; did you mean train.learning_rate?" in str(err.value)
    with pytest.raises(UserError) as err:
        config.from_dict({"train": {"zzz": 1}})
    assert "did you mean" not in str(err.value) and "allowed here:" in str(err.value)


def test_numbers_written_as_peers_write_them_are_numbers(tmp_path):
    """PyYAML (and so Snakemake's configfile) reads 1e-4 as a string: where a key takes a number, it is one; a key
    that takes text keeps the text."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 1e-4\n  max_steps: 2e3\ncaption:\n  template: 1e5\n  gpus: '2'\n")
    assert yaml.safe_load(path.read_text())["train"]["learning_rate"] == "1e-4"  # what the loader gives
    cfg = config.load(path)
    assert cfg.train.learning_rate == pytest.approx(1e-4) and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.max_steps == 2000 and isinstance(cfg.train.max_steps, int)
    assert cfg.caption.template == "1e5" and cfg.caption.gpus == 2
    assert cfg.raw["train"]["learning_rate"] == pytest.approx(1e-4)  # the resolved config the stages read
    with pytest.raises(UserError, match="train.learning_rate = '1e-4x' is not allowed"):
        config.from_dict({"train": {"learning_rate": "1e-4x"}})


def test_a_demo_preset_cannot_be_built_over_a_real_model_path():
    """Only model.pretrained changed to a hub id, build_preset still the demo's: a random model would be built in a
    folder named like the hub id and hide the real weights."""
    hub = {"model": {"pretrained": "stable-diffusion-v1-5/stable-diffusion-v1-5", "build_preset": "tiny"}}
    with pytest.raises(UserError) as err:
        config.check_user_config(config.from_dict(hub))
    assert "set model.build_preset: null" in str(err.value) and "\n" not in str(err.value)
    config.check_user_config(config.from_dict({"model": {"pretrained": "models/tiny", "build_preset": "tiny"}}))
    config.check_user_config(config.from_dict({"model": {**hub["model"], "build_preset": None}}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdpipe",
            "check-config",
            "--set",
            "model.pretrained=stable-diffusion-v1-5/stable-diffusion-v1-5",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "set model.build_preset: null" in proc.stderr


def test_a_lora_run_cannot_train_the_whole_text_encoder():
    """It trained to the end, then export failed without naming the cause."""
    with pytest.raises(UserError, match="set train.text_encoder.mode to lora or none"):
        config.from_dict({"train": {"mode": "lora", "text_encoder": {"mode": "full"}}})
    for te in ("lora", "none"):
        assert config.from_dict({"train": {"mode": "lora", "text_encoder": {"mode": te}}}).train.text_encoder.mode == te


def test_cli_reports_bad_config_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("latents:\n  batch_size: 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "sdpipe", "check-config", "--config", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sdpipe check-config: error: config: latents.batch_size = 0 is not allowed; expected one of ['auto'] or an "
        "integer from 1 to 4096"
    ]


def test_set_overrides_are_validated_too(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sdpipe", "check-config", "--set", "latents.gpus=many"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "latents.gpus = 'many'" in proc.stderr and "Traceback" not in proc.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "sdpipe", "check-config", "--set", "latents.gpus=2"], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr


def test_missing_and_invalid_yaml_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        config.load(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        config.load(broken)


def test_ddp_settings_reach_accelerate():
    from datetime import timedelta

    from sdpipe.train.loop import ddp_kwargs

    ddp, group = ddp_kwargs(config.from_dict({}))
    assert ddp.to_kwargs() == {"gradient_as_bucket_view": True} and group.timeout == timedelta(seconds=1800)
    ddp, group = ddp_kwargs(
        config.from_dict(
            {
                "train": {
                    "mode": "full",
                    "text_encoder": {"mode": "full"},
                    "ddp": {
                        "bucket_cap_mb": 50,
                        "static_graph": True,
                        "gradient_as_bucket_view": False,
                        "timeout_s": 120,
                    },
                }
            }
        )
    )
    assert ddp.to_kwargs() == {"bucket_cap_mb": 50, "static_graph": True, "find_unused_parameters": True}
    assert group.timeout == timedelta(seconds=120)
    with pytest.raises(UserError, match="train.ddp.timeout_s = 5"):
        config.from_dict({"train": {"ddp": {"timeout_s": 5}}})


def test_a_cache_dir_under_a_file_is_one_line_before_any_work(tmp_path):
    """Issue 26 (one of 29 bad configs): check-config said ok, and prepare then stopped in NotADirectoryError."""
    (tmp_path / "afile").write_text("x")
    cfg = config.from_dict({"model": {"pretrained": "m"}, "cache_dir": str(tmp_path / "afile" / "cache")})
    with pytest.raises(UserError, match=r"cache_dir = .*afile/cache must be a folder, but .*afile is a file"):
        config.check_user_config(cfg)
