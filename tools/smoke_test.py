#!/usr/bin/env python3
"""Runs every public jaxops op once (forward under jit, and its gradient where differentiable).

Used from outside the source tree on an installed wheel (tools/check_wheel.py) and, with
--save, by tests/test_cuda_graphs.py to record outputs with and without XLA command buffers:

  python tools/smoke_test.py [--size small|gpu] [--no-reference] [--save OUT.npz]
                             [--expect-platform cpu|cuda] [--source-tree DIR]

Checks (exit status 1 on any failure): build_info() is consistent, every public op has a
recipe in op_recipes.py, and every op agrees with its pure-JAX reference (skipped with
--no-reference). Each jitted function runs twice, on two different inputs of the same shape,
so a replayed (command-buffer) execution is checked as well as the first one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # op_recipes beside this file
import op_recipes  # noqa: E402


def _loss(out, weights):
    leaves = jax.tree_util.tree_leaves(out)
    return sum(jnp.sum(leaf.astype(jnp.float32) * w) for leaf, w in zip(leaves, weights))


def _grad_jitted(fn, case, diff_argnums):
    """jit of the gradient of sum(fn(...) * weights) with respect to args ``diff_argnums``."""
    call = _unjitted(fn, case)

    def loss(diff_args, args, kwargs, weights):
        args = list(args)
        for i, a in zip(diff_argnums, diff_args):
            args[i] = a
        return _loss(call(args, kwargs), weights)

    grad = jax.grad(loss)
    return jax.jit(lambda args, kwargs, weights: grad([args[i] for i in diff_argnums], args, kwargs, weights))


def _compare(name, recipe, out, ref, case):
    if recipe.check is not None:
        recipe.check(out, ref, case)
        return
    outs, refs = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
    assert len(outs) == len(refs), f"{len(outs)} outputs, reference has {len(refs)}"
    low = any(str(getattr(a, "dtype", "")) in ("bfloat16", "float16") for a in case.args)
    for o, r in zip(outs, refs):
        o64, r64 = np.asarray(o, np.float64), np.asarray(r, np.float64)
        assert o64.shape == r64.shape, f"shape {o64.shape}, reference {r64.shape}"
        scale = max(1.0, float(np.nanmax(np.abs(r64))) if r64.size else 1.0)
        rtol = 5e-2 if low else recipe.rtol
        np.testing.assert_allclose(o64, r64, rtol=rtol, atol=rtol * scale if low else recipe.atol * scale,
                                   equal_nan=True, err_msg=f"{name} {case.label}")


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _arrays(case):
    """The array arguments of a case (None where the argument is static), positional and keyword."""
    return ([a if _is_array(a) else None for a in case.args],
            {k: v for k, v in case.kwargs.items() if _is_array(v)})


def _jitted(fn, case):
    """jit of fn for this case's static arguments (ints, strings, axes); arrays stay traced."""
    return jax.jit(_unjitted(fn, case))


def _unjitted(fn, case):
    static_args = {i: a for i, a in enumerate(case.args) if not _is_array(a)}
    static_kwargs = {k: v for k, v in case.kwargs.items() if not _is_array(v)}

    def call(args, kwargs):
        full = [static_args[i] if i in static_args else a for i, a in enumerate(args)]
        return fn(*full, **static_kwargs, **kwargs)

    return jax.jit(call)


def _as_saved(x):
    """float arrays as float32 (exact for every narrower float dtype, so bitwise comparable)."""
    a = np.asarray(x.astype("float32") if str(x.dtype) in ("bfloat16", "float16") else x)
    return a


def run(size: str, reference: bool, save: str | None, only: list[str] | None) -> int:
    import jaxops

    failures = []
    saved: dict[str, np.ndarray] = {}
    ops = op_recipes.public_ops(jaxops)
    missing = [op for op in ops if op not in op_recipes.RECIPES]
    for op in missing:
        failures.append(f"{op}: public op without a recipe in tools/op_recipes.py")
    key = jax.random.key(20240607)
    for op_index, op in enumerate(ops):
        if op in missing or (only and op not in only):
            continue
        recipe, fn = op_recipes.RECIPES[op], getattr(jaxops, op)
        start = time.perf_counter()
        try:
            # Two input sets per case: the second call reuses the compiled (and recorded) program.
            runs = [recipe.cases(jax.random.fold_in(key, 2 * op_index + rep), size) for rep in (0, 1)]
            for ci, case in enumerate(runs[0]):
                f = _jitted(fn, case)
                # numpy references (knn) cannot be traced: they run eagerly
                ref = _jitted(recipe.reference, case) if recipe.check is None else \
                    (lambda a, kw, _c=case: recipe.reference(*[x if x is not None else y for x, y in
                                                                 zip(a, _c.args)], **_c.kwargs))
                df = rf = None
                if recipe.diff_argnums:
                    df = _grad_jitted(fn, case, recipe.diff_argnums)
                    rf = _grad_jitted(recipe.reference, case, recipe.diff_argnums)
                for rep in (0, 1):
                    c = runs[rep][ci]
                    for ai, arg in enumerate(jax.tree_util.tree_leaves(_arrays(c))):
                        saved[f"{op}|{c.label}|run{rep}|input{ai}"] = _as_saved(arg)
                    out = jax.block_until_ready(f(*_arrays(c)))
                    for li, leaf in enumerate(jax.tree_util.tree_leaves(out)):
                        saved[f"{op}|{c.label}|run{rep}|out{li}"] = _as_saved(leaf)
                    if reference:
                        _compare(op, recipe, out, ref(*_arrays(c)), c)
                    if recipe.diff_argnums:
                        weights = [_normal_like(jax.random.fold_in(key, 1000 + li), leaf)
                                   for li, leaf in enumerate(jax.tree_util.tree_leaves(out))]
                        grads = jax.block_until_ready(df(*_arrays(c), weights))
                        for gi, g in enumerate(grads):
                            saved[f"{op}|{c.label}|run{rep}|grad{gi}"] = _as_saved(g)
                        if reference:
                            ref_grads = rf(*_arrays(c), weights)
                            for g, rg in zip(grads, ref_grads):
                                _compare(op + " grad", op_recipes.Recipe(None, None, rtol=recipe.rtol * 5,
                                                                         atol=recipe.atol * 5), g, rg, c)
            print(f"ok    {op:22s} {len(runs[0])} cases  {time.perf_counter() - start:6.2f} s", flush=True)
        except Exception as err:  # report every op, then fail
            traceback.print_exc()
            failures.append(f"{op}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            print(f"FAIL  {op}", flush=True)
    if save:
        np.savez(save, **saved)
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


def _normal_like(key, leaf):
    return jax.random.normal(key, leaf.shape, jnp.float32)


def check_install(expect_platform: str | None, source_tree: str | None) -> list[str]:
    """Consistency of build_info() and of where jaxops was imported from."""
    import jaxops

    problems = []
    info = jaxops.build_info()
    print("jaxops", jaxops.__file__)
    print("build_info", info)
    print("jax", jax.__version__, "backend", jax.default_backend(), flush=True)
    if source_tree and os.path.realpath(jaxops.__file__).startswith(os.path.realpath(source_tree) + os.sep):
        problems.append(f"jaxops was imported from the source tree ({jaxops.__file__}), not the install")
    if info["version"] != jaxops.__version__:
        problems.append(f"build_info version {info['version']} != __version__ {jaxops.__version__}")
    if tuple(info["ffi_api_version"]) != (0, 1):
        problems.append(f"built against FFI API {info['ffi_api_version']}, expected (0, 1) (jaxlib 0.5.0's)")
    if expect_platform == "cuda":
        if "cuda" not in info["platforms"]:
            problems.append("the CUDA handlers are missing from this build")
        elif not info["cuda_architectures"]:
            problems.append("no CUDA architectures recorded")
    if jax.default_backend() == "gpu" and "cuda" not in info["platforms"]:
        problems.append("running on a GPU but this build has no CUDA handlers")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["small", "gpu"], default="small")
    parser.add_argument("--no-reference", action="store_true", help="skip comparing with pure JAX")
    parser.add_argument("--save", help="write every output and gradient to this .npz")
    parser.add_argument("--expect-platform", choices=["cpu", "cuda"])
    parser.add_argument("--source-tree", help="fail if jaxops is imported from under this directory")
    parser.add_argument("--ops", nargs="*", help="only these ops")
    args = parser.parse_args(argv)
    problems = check_install(args.expect_platform, args.source_tree)
    for problem in problems:
        print("FAILED:", problem)
    status = run(args.size, not args.no_reference, args.save, args.ops)
    return 1 if problems or status else 0


if __name__ == "__main__":
    sys.exit(main())
