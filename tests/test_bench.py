"""The benchmark harness: device-time splitting of profiled dispatches, and the CLI end to end."""
import json

import jax
import numpy as np
import pytest

from jaxops.bench import device_clock
from jaxops.bench.case import Options
from jaxops.bench.cli import build_cases
from jaxops.bench.cli import main as bench_main
from jaxops.bench.timing import COPY_MAX_BYTES, GPU_COPY_MIN_BYTES, allocator_warning, copy_reference_bytes


def _dispatch(t0, kernels):
    """Back-to-back activities starting at t0 (ns), each (duration, gap before the next)."""
    out, t = [], t0
    for dur, gap in kernels:
        out.append((t, t + dur))
        t += dur + gap
    return out


def test_split_cuts_at_the_host_gaps():
    # three dispatches of three kernels; small gaps inside, 300 us of host time between them
    d = [_dispatch(t0, [(100_000, 2_000), (5_000, 1_000), (100_000, 0)])
         for t0 in (0, 510_000, 1_020_000)]
    chunks = device_clock._split(sorted(sum(d, [])), 3)
    assert chunks == d
    spans = [(max(e for _, e in c) - c[0][0]) for c in chunks]
    assert spans == [208_000] * 3  # the idle gaps inside a dispatch count, those between do not


def test_split_handles_overlapping_activities():
    # a kernel that ends after the next one starts (two streams) must not open a false gap
    a = [(0, 100), (10, 500), (490, 600)]
    b = [(x + 10_000, y + 10_000) for x, y in a]
    assert device_clock._split(a + b, 2) == [a, b]


@pytest.mark.parametrize("events,dispatches", [
    ([(0, 10), (100, 110), (200, 210)], 2),                        # not divisible
    ([(0, 10), (1000, 1010), (1020, 1030), (1040, 1050)], 2),      # uneven chunks
])
def test_split_refuses_what_it_cannot_tell_apart(events, dispatches):
    assert device_clock._split(events, dispatches) is None


def test_cli_records_the_clock(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_main(["--ops", "relu", "--shapes", "257", "--dtypes", "float32", "--repeats", "2",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["clock"] in ("wall", "device (CUPTI kernel spans)")
    assert [r["op"] for r in data["rows"]] == ["relu"] and data["rows"][0]["jaxops_us"] > 0
    assert "clock:" in capsys.readouterr().out
    assert data["warning"] is None or "ALLOCATOR" in data["warning"]


@pytest.mark.parametrize("env,warns", [({}, False), ({"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}, False),
                                       ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, True),
                                       ({"XLA_PYTHON_CLIENT_ALLOCATOR": " Platform "}, True)])
def test_allocator_warning(env, warns):
    """The platform allocator's gaps between calls would be charged to every case (copy 2.59 vs
    3.02 TB/s on an H100): the CLI says so instead of printing figures that do not compare."""
    got = allocator_warning(env)
    assert (got is not None) == warns
    if warns:
        assert "XLA_PYTHON_CLIENT_ALLOCATOR=platform" in got and "Unset" in got


@pytest.mark.parametrize("largest,gpu,want", [
    (10 << 20, True, GPU_COPY_MIN_BYTES), (2 * GPU_COPY_MIN_BYTES + 6, True, GPU_COPY_MIN_BYTES + 3),
    (5 * COPY_MAX_BYTES, True, COPY_MAX_BYTES), (10 << 20, False, 5 << 20), (100, False, 1 << 20),
    (5 * COPY_MAX_BYTES, False, COPY_MAX_BYTES)])
def test_copy_reference_bytes(largest, gpu, want):
    """On a GPU the copy reference fills the chip whatever the run's cases (a run of small cases
    timed a small copy at 2.77 TB/s where the same H100 copies 3.03, and every fraction of copy
    read ~9 % high); half the largest case's bytes beyond that, at most 1 GB."""
    assert copy_reference_bytes(largest, gpu) == want


def test_named_column_ops_take_user_shapes():
    """`--ops argmax_cols --shapes RxC` reduces the leading axis of RxC (it built no case before)."""
    cases = build_cases(Options(ops={"argmax_cols", "sum"}, dtypes=["float32"], shapes=[(70, 33), (50,)],
                                gpu=False))
    assert sorted((c.op, c.shape) for c in cases) == [("argmax_cols", (70, 33)), ("sum", (50,)), ("sum", (70, 33))]
    (col,) = [c for c in cases if c.op == "argmax_cols"]
    x = col.make_inputs(jax.random.key(0))
    assert col.jaxops_fn(*x).shape == (33,)
    np.testing.assert_array_equal(np.asarray(col.jaxops_fn(*x)), np.asarray(col.xla_fn(*x)))


@pytest.mark.parametrize("op", ["softmax_masked", "softmax_masked_bwd"])
def test_masked_softmax_cases_agree_with_xla(op):
    """The masked cases time the same result on both sides: a baseline that computed something
    else (the mask ignored, the masked cotangents counted) would make the ratio meaningless."""
    (case,) = build_cases(Options(ops={op}, dtypes=["float32"], shapes=[(37, 301)], gpu=False))
    inputs = case.make_inputs(jax.random.key(4))
    assert not bool(np.all(np.asarray(inputs[-1])))  # some entries masked
    np.testing.assert_allclose(np.asarray(case.jaxops_fn(*inputs)), np.asarray(case.xla_fn(*inputs)),
                               rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("op", ["layer_norm_vmap", "rms_norm_vmap"])
def test_vmap_norm_cases_agree_with_xla(op):
    """The per-example-parameter cases time the same forward and gradients on both sides, and
    only run when named (the default run keeps its case list)."""
    (case,) = build_cases(Options(ops={op}, dtypes=["float32"], shapes=[(3, 7, 130)], gpu=False))
    assert case.shape == (3, 7, 130)
    inputs = case.make_inputs(jax.random.key(5))
    assert inputs[1].shape == (3, 130)  # a scale row per example
    got, want = case.jaxops_fn(*inputs), case.xla_fn(*inputs)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
    default = build_cases(Options(ops=None, dtypes=["float32"], shapes=[(3, 7, 130)], gpu=False))
    assert not any(c.op.endswith("_vmap") for c in default)
