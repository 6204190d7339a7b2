"""Loads the handler libraries, registers every FFI target, and builds FFI calls."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from jaxops import _jaxops_cpu

try:  # built only where a CUDA compiler was found
    from jaxops import _jaxops_cuda
except ImportError:  # pragma: no cover - depends on the build
    _jaxops_cuda = None

_REBUILD_HINT = (
    "jaxops was installed without its CUDA handlers, so it cannot run on a GPU. Rebuild it on a "
    "machine with nvcc: JAXOPS_CUDA=ON pip install --no-build-isolation --force-reinstall ."
)


def _register_all() -> None:
    cpu_targets = _jaxops_cpu.registrations()
    for name, capsule in cpu_targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if _jaxops_cuda is not None:
        for name, capsule in _jaxops_cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        return
    # Without CUDA handlers, a GPU run reaches a handler that reports how to rebuild instead of
    # XLA's opaque "no handler registered".
    stub = _jaxops_cpu.missing_cuda_handler()
    for name in cpu_targets:
        try:
            jax.ffi.register_ffi_target(name, stub, platform="CUDA")
        except Exception:  # no CUDA backend in this jaxlib: nothing to reach
            return


_register_all()


def has_cuda() -> bool:
    """True when the CUDA handlers were built into this installation."""
    return _jaxops_cuda is not None


def build_info() -> dict[str, Any]:
    """Version, platforms, CUDA architectures and FFI API version compiled into jaxops."""
    from jaxops import __version__

    cpu = _jaxops_cpu.build_info()
    info: dict[str, Any] = {
        "version": __version__,
        "platforms": ["cpu"] + (["cuda"] if _jaxops_cuda is not None else []),
        "ffi_api_version": tuple(cpu["ffi_api_version"]),
        "cuda_architectures": None,
        "cuda_version": None,
        "jax_version": jax.__version__,
    }
    if _jaxops_cuda is not None:
        cuda = _jaxops_cuda.build_info()
        info["cuda_architectures"] = cuda["cuda_architectures"].split(",")
        info["cuda_version"] = cuda["cuda_version"]
    return info


def _check_backend(fn_name: str) -> None:
    if _jaxops_cuda is None and jax.default_backend() == "gpu":
        raise RuntimeError(f"jaxops.{fn_name}: {_REBUILD_HINT}")


def ffi_call(
    fn_name: str,
    target: str,
    results: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    *args: Any,
    vmap_method: str = "broadcast_all",
    **attrs: Any,
) -> Any:
    """Calls FFI target `target` on behalf of public function `fn_name`.

    Integer and boolean attributes are passed as 64-bit integers, floats as float32.
    """
    _check_backend(fn_name)
    converted = {}
    for key, value in attrs.items():
        if isinstance(value, (bool, np.bool_, int, np.integer)):
            converted[key] = np.int64(value)
        elif isinstance(value, (float, np.floating)):
            converted[key] = np.float32(value)
        else:
            converted[key] = value
    call = jax.ffi.ffi_call(target, results, vmap_method=vmap_method)
    return call(*args, **converted)
