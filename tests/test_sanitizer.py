"""compute-sanitizer over every op's kernels (GPU machine only).

Runs tools/smoke_test.py (every public op, forward and gradient, at sizes that reach the
multi-warp, block and cluster paths) under memcheck and racecheck in a child process and
requires a clean report.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from helpers import gpu_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@gpu_only
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_is_clean(tool):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", "--print-limit", "20",
           sys.executable, os.path.join(ROOT, "tools", "smoke_test.py"), "--size", "gpu", "--no-reference"]
    with tempfile.TemporaryDirectory() as cwd:  # outside the tree: only the installed jaxops
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-4000:]
    assert "ERROR SUMMARY: 0 errors" in report, report[-4000:]
