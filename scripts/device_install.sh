#!/usr/bin/env bash
# On a GPU machine without network: install the carried wheels (.whl/, see device_wheels.sh) that its Python lacks
# into /tmp/site, sdpipe always (as users install it: a wheel, no checkout on the path). Then:
#   export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t missing < <(python3 - <<'PY'
import importlib.metadata as md
import pathlib

# Always ours: sdpipe, and what needs a newer version than such images may hold (pydantic pins its core, and
# wants a recent typing_extensions).
ALWAYS = {"sdpipe", "pydantic", "pydantic_core", "typing_extensions"}
for wheel in sorted(pathlib.Path(".whl").glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        md.distribution(name)
        present = name not in ALWAYS
    except md.PackageNotFoundError:
        present = False
    if not present:
        print(wheel)
PY
)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${missing[@]}"
[ -d .whl/vendor ] && cp -r .whl/vendor/. /tmp/site/  # files without a wheel (device_wheels.sh says which)
echo "installed into /tmp/site: ${missing[*]##*/}"
