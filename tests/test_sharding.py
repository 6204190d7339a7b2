"""Every op partitions itself under a sharded jax.jit: same results, no gathering.

The checks live in tests/sharding_cases.py and run in a child process with 8 virtual CPU
devices (or every GPU, where there are two or more), because this pytest process has
already initialised JAX with one device. One child runs all cases; each case is reported
as its own test here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxops

sys.path.insert(0, str(Path(__file__).parent))
import sharding_cases  # noqa: E402  (only registers case names; runs nothing)

CASES_SCRIPT = Path(__file__).with_name("sharding_cases.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Runs every case once in a child process with 8 devices and returns its JSON report."""
    workdir = tmp_path_factory.mktemp("sharding")
    out = workdir / "report.json"
    env = dict(os.environ)
    # The child must import the same jaxops as this process (the dev stage or site-packages),
    # from a cwd outside the source tree so the source jaxops/ cannot shadow the build.
    package_root = str(Path(jaxops.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in sys.path if p])
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    env["JAXOPS_SHARDING_REPORT"] = str(out)
    env.setdefault("JAXOPS_TEST_X64", os.environ.get("JAXOPS_TEST_X64", "1"))
    proc = subprocess.run([sys.executable, str(CASES_SCRIPT)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)
    if not out.exists():
        pytest.fail(f"sharding cases crashed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def test_child_has_several_devices(report):
    assert len(report["devices"]) >= 2, report["devices"]


@pytest.mark.parametrize("name", list(sharding_cases.CASES))
def test_case(report, name):
    result = report["cases"][name]
    if result["status"] == "skip":
        pytest.skip(result["detail"])
    assert result["status"] == "pass", result["detail"]
