"""compute-sanitizer over every op's kernels (GPU machine only).

Runs tools/smoke_test.py (every public op, forward and gradient, at sizes that reach the
multi-warp, block and cluster paths) under memcheck and racecheck in child processes and
requires a clean report. The ops go in groups, one child process each: the whole sweep under
one tool took longer than a device call (over 560 s on an H100, sessions 59-71), so no run
finished it; a group is a test the runner can deal beside the others. Only jaxops's kernels are
instrumented; a probe program (sanitizer_probe.cu) shows the filter catches an out-of-bounds read
in a jaxops kernel and skips one elsewhere, and a CPU test keeps every kernel in the namespace.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import jaxops
from helpers import gpu_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import op_recipes  # noqa: E402

OP_GROUPS = {
    "softmax_relu": ["softmax", "log_softmax", "relu"],
    "batch_norm": ["batch_norm", "batch_norm_inference"],
    "layer_norm": ["layer_norm", "rms_norm"],
    "sum_mean_max_min": ["sum", "mean", "max", "min"],
    "logsumexp_arg": ["logsumexp", "argmax", "argmin"],
    # One process each: memcheck of the pair ran past 185 s beside racecheck (session 73).
    "knn": ["knn"],
    "knn_classify": ["knn_classify"],
}

# Only jaxops's kernels are instrumented (their mangled names hold "jaxops"): XLA's fusions and
# cuBLAS's GEMM (knn's distances) are not our code, and checking them kept the knn and reduction
# groups past 440 s (session 73), while our kernels are what the test is for.
KERNEL_FILTER = ["--kernel-name", "kns=jaxops"]

# What each tool prints when it found nothing (racecheck prints no "ERROR SUMMARY" line).
CLEAN_SUMMARY = {
    "memcheck": "ERROR SUMMARY: 0 errors",
    "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
}


def test_op_groups_cover_every_public_op_once():
    grouped = [op for ops in OP_GROUPS.values() for op in ops]
    assert len(grouped) == len(set(grouped)), f"an op in two groups: {sorted(grouped)}"
    assert sorted(grouped) == sorted(op_recipes.public_ops(jaxops)), \
        "OP_GROUPS must list every public op: add the new one to a group"


def test_every_kernel_is_in_the_jaxops_namespace():
    # The sanitizer checks only kernels whose mangled names hold "jaxops" (--kernel-name below);
    # a kernel declared outside the namespace would silently go unchecked.
    import audit_cuda_graph_safety as audit  # tools/: the CUDA sources and their comment stripper

    with_kernels = {}
    for path in audit.cuda_sources(ROOT):
        with open(path) as f:
            code = audit._strip_comments(f.read())
        if "__global__" in code:
            with_kernels[os.path.relpath(path, ROOT)] = code
    assert with_kernels, "no __global__ found under cc/"
    outside = [rel for rel, code in with_kernels.items() if "namespace jaxops" not in code]
    assert not outside, f"kernels outside namespace jaxops (the sanitizer would skip them): {outside}"


@gpu_only
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH")
@pytest.mark.parametrize("group", sorted(OP_GROUPS))
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_is_clean(tool, group):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = ["compute-sanitizer", "--tool", tool, *KERNEL_FILTER, "--error-exitcode", "9", "--print-limit", "20",
           sys.executable, os.path.join(ROOT, "tools", "smoke_test.py"), "--size", "gpu", "--no-reference",
           "--ops", *OP_GROUPS[group]]
    with tempfile.TemporaryDirectory() as cwd:  # outside the tree: only the installed jaxops
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-4000:]
    assert CLEAN_SUMMARY[tool] in report, report[-4000:]
    for op in OP_GROUPS[group]:  # each op of the group ran to its end
        assert any(line.startswith("ok") and line.split()[1] == op for line in report.splitlines()), \
            f"{op} did not report ok:\n{report[-4000:]}"


@gpu_only
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None or shutil.which("nvcc") is None,
                    reason="compute-sanitizer or nvcc is not on PATH")
def test_kernel_filter_checks_jaxops_kernels_and_skips_others(tmp_path):
    # Without this control a filter that matched nothing would pass every test above.
    probe = str(tmp_path / "probe")
    build = subprocess.run(["nvcc", "-o", probe, os.path.join(ROOT, "tests", "sanitizer_probe.cu")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr

    def memcheck(which):
        proc = subprocess.run(["compute-sanitizer", "--tool", "memcheck", *KERNEL_FILTER, "--error-exitcode", "9",
                               probe, which], capture_output=True, text=True, timeout=300)
        return proc.returncode, proc.stdout + proc.stderr

    rc, report = memcheck("inside")
    assert rc == 9 and "Invalid __global__ read" in report and "probe_out_of_bounds" in report, report[-4000:]
    rc, report = memcheck("outside")
    assert rc == 0 and CLEAN_SUMMARY["memcheck"] in report, report[-4000:]
