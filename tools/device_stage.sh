#!/usr/bin/env bash
# Builds the GPU machine's jaxops HERE (its Python, 3.12; sm_90; Release) into build/dev-device/stage
# by tools/dev_build.sh, so a device call spends its time running, not building (a fresh machine's
# `gpu_check.sh build` takes 160-190 s of the session's 1800). On the device: carry
# ["build/dev-device/stage"], then `tools/gpu_check.sh stage ...` installs it in place of `build`.
#   tools/device_stage.sh            # incremental: build/dev-device keeps the objects
# DEVICE_PYTHON overrides the interpreter (default: pyenv's 3.12). Needs nanobind for it
# (installed with pip on first use).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${DEVICE_PYTHON:-$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)}
[ -x "$py" ] || { echo "device_stage: no Python 3.12 (set DEVICE_PYTHON)" >&2; exit 1; }
"$py" -c "import nanobind" 2>/dev/null || "$py" -m pip install -q nanobind
# Compressed images, as in the wheel (a quarter of the bytes: two stages fit a device call's 64 MiB
# carry). gpu_check.sh's stage step runs a kernel, so a stage the driver could not load fails
# there, not in the tests.
PYTHON="$py" "$root/tools/dev_build.sh" device cuda
stage=$root/build/dev-device/stage
# What the stage was built from: the device's run can print it next to its results.
{ git -C "$root" rev-parse HEAD; git -C "$root" diff --stat HEAD | tail -1; date -u; } >"$stage/STAMP"
du -sh "$stage"
