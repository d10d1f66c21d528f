#!/usr/bin/env bash
# Wheels the lent H200 lacks (it has no package registry), downloaded here into .whl/
# (git-ignored) for the device call to carry: `run(carry=[".whl"], ...)`; gpu_suite.sh
# installs them into /tmp/site first. The device image already holds transformers,
# triton, matplotlib, pytest and hypothesis (device notes, KINDS.md); only jax-triton
# (the "triton" backend's launcher, pure Python) is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "jax-triton==0.3.1"
ls -la .whl
