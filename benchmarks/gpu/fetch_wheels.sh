#!/usr/bin/env bash
# Run on the CPU machine (PyPI reachable), from anywhere: fills <repo>/.whl/ (git-ignored) with what the GPU
# machine lacks, for its Python 3.12 on x86-64: a pure-Python DeepSpeed wheel (its CUDA ops compiled there on
# first use) and binary wheels of the packages its image does not hold (the device's KINDS.md lists them).
# One version of each; benchmarks/gpu/install.sh installs them there with --no-deps.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WHL=$ROOT/.whl
# Missing on the GPU image: DeepSpeed's hjson, ds_kfac's and DeepSpeed's pydantic (with pydantic-core,
# annotated-types, typing-inspection), and transformers at the version the BERT example is pinned to
# (the image has 5.17.0; its requirements, huggingface-hub>=1.31, tokenizers 0.23, are there), and pytorch-optimizer
# for the peer arms' SOAP and PSGD-Kron (configs/*_soap.json, *_psgd.json; DeepSpeed has Muon).
# Already there: torch, numpy, einops, msgpack, ninja, packaging, psutil, py-cpuinfo, tqdm, typing-extensions,
# nvidia-ml-py, tokenizers, huggingface-hub, safetensors, regex, pyyaml, typer, pytest, pytest-timeout.
PACKAGES=(
  pydantic==2.14.3
  pydantic-core==2.50.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  hjson==3.1.0
  transformers==5.23.0
  pytorch-optimizer==4.1.0
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

rm -rf "$WHL" && mkdir -p "$WHL"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]/#/--platform=}" -d "$WHL" "${PACKAGES[@]}"

# DeepSpeed from its sdist, no ops compiled (DS_BUILD_OPS=0): a py3-none-any wheel. Built in a throw-away venv that
# sees the project venv's torch and setuptools through a .pth file (read only), as `make` builds DeepSpeed.
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
python3 -m venv "$BUILD/venv"
SITE=$(echo "$ROOT"/.venv/lib/python3.*/site-packages)
"$BUILD/venv/bin/python" -c "import site, pathlib; pathlib.Path(site.getsitepackages()[0], 'project.pth').write_text('$SITE\n')"
DS_BUILD_OPS=0 "$BUILD/venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$WHL" deepspeed==0.19.8

ls -l "$WHL"
du -sh "$WHL"
