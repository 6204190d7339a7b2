#!/usr/bin/env python3
"""Builds (or takes) a jaxops wheel, installs it into fresh virtual environments, smoke-tests it.

  python tools/check_wheel.py [--wheel dist/jaxops-*.whl | --build] [--jax latest --jax 0.5.0]
                              [--offline] [--expect-platform cuda] [--full-tests]

For each --jax version (``latest``: whatever pip resolves; ``0.5.0``: the oldest supported,
which pins jax and jaxlib), a new venv gets the wheel plus that jax, and tools/smoke_test.py runs
from a temporary directory outside the source tree, so the import can only come from the wheel.
--full-tests also runs the test suite (tests/) against that install. --offline (for machines
without internet, e.g. the GPU machine) makes venvs that see the system site-packages (its jax)
and installs the wheel alone. Also checks that the CUDA module needs no CUDA library at load
(static cudart: `import jaxops` works on machines without CUDA).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Shared libraries the extension modules may load: the C/C++ runtime only, never CUDA's.
ALLOWED_NEEDED = ("libc.so", "libm.so", "libstdc++.so", "libgcc_s.so", "libdl.so", "libpthread.so",
                  "librt.so", "ld-linux")


def jax_minimum() -> str:
    """JAX_MINIMUM from jaxops/_version_check.py (read, not imported: the tree has no build)."""
    with open(os.path.join(ROOT, "jaxops", "_version_check.py")) as f:
        return re.search(r'^JAX_MINIMUM = "([^"]+)"', f.read(), re.M).group(1)


def sh(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def build_wheel(out_dir: str, no_build_isolation: bool) -> str:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out_dir, ROOT]
    if no_build_isolation:
        cmd.insert(4, "--no-build-isolation")
    sh(cmd)
    return newest_wheel(out_dir)


def newest_wheel(directory: str) -> str:
    wheels = sorted(glob.glob(os.path.join(directory, "jaxops-*.whl")), key=os.path.getmtime)
    if not wheels:
        sys.exit(f"no jaxops wheel in {directory}")
    return wheels[-1]


def check_contents(wheel: str, expect_platform: str | None) -> list[str]:
    """Wheel holds both extension modules (CUDA when expected) whose NEEDED libs are not CUDA's."""
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        modules = [n for n in names if n.startswith("jaxops/_jaxops_") and n.endswith(".so")]
        print("wheel modules:", modules)
        if not any("_jaxops_cpu" in n for n in modules):
            problems.append("wheel has no _jaxops_cpu module")
        if expect_platform == "cuda" and not any("_jaxops_cuda" in n for n in modules):
            problems.append("wheel has no _jaxops_cuda module (built without a CUDA compiler?)")
        if any(n.startswith(("tests/", "cc/", "third_party/")) for n in names):
            problems.append("wheel contains source-tree folders")
        with tempfile.TemporaryDirectory() as tmp:
            for name in modules:
                path = zf.extract(name, tmp)
                needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
                libs = [line.split("[")[1].split("]")[0] for line in needed.splitlines() if "(NEEDED)" in line]
                print(os.path.basename(name), "needs", libs)
                bad = [lib for lib in libs if not lib.startswith(ALLOWED_NEEDED)]
                if bad:
                    problems.append(f"{os.path.basename(name)} needs {bad}: importing jaxops would need them")
    return problems


def make_venv(path: str, offline: bool) -> str:
    cmd = [sys.executable, "-m", "venv", path]
    if offline:
        cmd.append("--system-site-packages")
    sh(cmd)
    return os.path.join(path, "bin", "python")


def install(python: str, wheel: str, jax_version: str, offline: bool, extras: list[str]) -> None:
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if offline:
        # the wheel alone; jax, numpy and pytest come from the system site-packages
        sh(pip + ["--no-deps", "--no-index", wheel])
        return
    reqs = [wheel]
    if jax_version != "latest":
        reqs += [f"jax=={jax_version}", f"jaxlib=={jax_version}"]
    sh(pip + reqs + extras)


def smoke(python: str, expect_platform: str | None, size: str) -> int:
    with tempfile.TemporaryDirectory() as cwd:  # outside the source tree
        cmd = [python, "-E", "-s", os.path.join(ROOT, "tools", "smoke_test.py"), "--size", size,
               "--source-tree", ROOT]
        if expect_platform:
            cmd += ["--expect-platform", expect_platform]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=cwd, env=_clean_env()).returncode


def full_tests(python: str, pytest_args: list[str]) -> int:
    # A copy of tests/ outside the tree, so `import jaxops` can only find the installed wheel.
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(tmp, "tests"))
        # The tests read the project's tools, headers, sources and metadata; the package itself
        # (jaxops/) stays behind so only the installed wheel can be imported.
        for name in ("tools", "third_party", "cc"):
            shutil.copytree(os.path.join(ROOT, name), os.path.join(tmp, name))
        for name in ("README.md", "pyproject.toml"):
            shutil.copy(os.path.join(ROOT, name), os.path.join(tmp, name))
        cmd = [python, "-E", "-s", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", *pytest_args]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=tmp, env=_clean_env()).returncode


def _clean_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--wheel", help="the wheel to check (default: newest in dist/, or --build)")
    src.add_argument("--build", action="store_true", help="build the wheel first (pip wheel . -w dist)")
    parser.add_argument("--no-build-isolation", action="store_true")
    parser.add_argument("--jax", action="append", help="jax versions to test: 'latest' and/or e.g. 0.5.0 "
                        "(default: latest and the oldest supported)")
    parser.add_argument("--offline", action="store_true",
                        help="no downloads: venvs see the system site-packages (its jax)")
    parser.add_argument("--expect-platform", choices=["cpu", "cuda"])
    parser.add_argument("--size", choices=["small", "gpu"], default="small")
    parser.add_argument("--full-tests", action="store_true", help="also run tests/ against each install")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--keep", action="store_true", help="keep the venvs (printed)")
    args = parser.parse_args(argv)

    versions = args.jax or (["system"] if args.offline else ["latest", jax_minimum()])
    wheel = args.wheel or (build_wheel(os.path.join(ROOT, "dist"), args.no_build_isolation) if args.build
                           else newest_wheel(os.path.join(ROOT, "dist")))
    print("wheel:", wheel, flush=True)
    failures = [f"contents: {p}" for p in check_contents(wheel, args.expect_platform)]
    base = tempfile.mkdtemp(prefix="jaxops-wheel-")
    try:
        for version in versions:
            venv = os.path.join(base, f"jax-{version}")
            python = make_venv(venv, args.offline)
            extras = ["pytest", "hypothesis", "scipy", "scikit-learn"] if args.full_tests else []
            try:
                install(python, wheel, version, args.offline, extras)
            except subprocess.CalledProcessError as err:
                failures.append(f"jax {version}: install failed ({err})")
                continue
            if smoke(python, args.expect_platform, args.size):
                failures.append(f"jax {version}: smoke test failed")
            if args.full_tests and full_tests(python, args.pytest_args):
                failures.append(f"jax {version}: test suite failed")
    finally:
        if args.keep:
            print("venvs kept under", base)
        else:
            shutil.rmtree(base, ignore_errors=True)
    for failure in failures:
        print("FAILED:", failure)
    print("check_wheel:", "FAILED" if failures else "OK", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
