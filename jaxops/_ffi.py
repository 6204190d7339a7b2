"""Loads the handler libraries, registers every FFI target, and builds FFI calls."""
from __future__ import annotations

from typing import Any, Sequence

from jaxops import _version_check

_version_check.check_jax()  # first: a too-old jax gets an ImportError naming the version needed

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxops import _jaxops_cpu  # noqa: E402

try:  # built only where a CUDA compiler was found
    from jaxops import _jaxops_cuda
except ImportError:  # pragma: no cover - depends on the build
    _jaxops_cuda = None

_REBUILD_HINT = (
    "jaxops was installed without its CUDA handlers, so it cannot run on a GPU. Rebuild it on a "
    "machine with nvcc: JAXOPS_CUDA=ON pip install --no-build-isolation --force-reinstall ."
)


def _register(name: str, capsule: Any, platform: str, ffi_api: tuple[int, int]) -> None:
    try:
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    except Exception as err:  # e.g. XLA refusing the handlers' FFI API version
        raise _version_check.registration_error(name, platform, err, ffi_api) from err


def _register_all() -> None:
    cpu_targets = _jaxops_cpu.registrations()
    cpu_api = tuple(_jaxops_cpu.build_info()["ffi_api_version"])
    for name, capsule in cpu_targets.items():
        _register(name, capsule, "cpu", cpu_api)
    if _jaxops_cuda is not None:
        # Without a CUDA backend jax only records these (registered if a CUDA plugin loads
        # later), so a wheel with CUDA handlers imports on a machine without a GPU.
        cuda_api = tuple(_jaxops_cuda.build_info()["ffi_api_version"])
        for name, capsule in _jaxops_cuda.registrations().items():
            _register(name, capsule, "CUDA", cuda_api)
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
    """What this jaxops installation was built with, and the jax it runs on.

    Returns:
      A dict with ``version`` (jaxops), ``platforms`` (``["cpu"]`` or ``["cpu", "cuda"]``),
      ``cuda_architectures`` (CMake-style, e.g. ``["80-real", "90"]``: sm_80 machine code, sm_90
      machine code and compute_90 PTX; None without CUDA), ``cuda_version`` (of nvcc; None
      without CUDA), ``ffi_api_version`` (the XLA FFI API the handlers were compiled against,
      e.g. ``(0, 1)``), ``targets`` (FFI targets per platform), ``jax_minimum`` (oldest
      supported jax/jaxlib), ``jax_version`` and ``jaxlib_version`` (installed).
    """
    from jaxops import __version__

    cpu = _jaxops_cpu.build_info()
    jax_version, jaxlib_version = _version_check.installed_versions()
    info: dict[str, Any] = {
        "version": __version__,
        "platforms": ["cpu"] + (["cuda"] if _jaxops_cuda is not None else []),
        "cuda_architectures": None,
        "cuda_version": None,
        "ffi_api_version": tuple(cpu["ffi_api_version"]),
        "targets": {"cpu": int(cpu["targets"])},
        "jax_minimum": _version_check.JAX_MINIMUM,
        "jax_version": jax_version,
        "jaxlib_version": jaxlib_version,
    }
    if _jaxops_cuda is not None:
        cuda = _jaxops_cuda.build_info()
        info["cuda_architectures"] = cuda["cuda_architectures"].split(",")
        info["cuda_version"] = cuda["cuda_version"]
        info["targets"]["cuda"] = int(cuda["targets"])
    return info


def device_plan() -> dict[str, Any] | None:
    """Which chip-dependent kernel plans the current CUDA device takes.

    Returns:
      None without the CUDA handlers or a device; else a dict with ``dram_bytes_per_sm_cycle``
      (peak DRAM bytes a cycle of one SM: H100 ~12.8, H200 ~18.8) and ``fast_dram`` (True where
      the kernels take the plans chosen for DRAM that outruns the SMs; ``JAXOPS_FAST_DRAM=0/1``
      forces it).
    """
    if _jaxops_cuda is None:
        return None
    plan = _jaxops_cuda.device_plan()
    return None if plan is None else dict(plan)


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

    Integer and boolean attributes are passed as 64-bit integers, floats as float64 (handlers
    read them with ``Attr<double>``, so float64 inputs see the exact value).
    """
    _check_backend(fn_name)
    converted = {}
    for key, value in attrs.items():
        if isinstance(value, (bool, np.bool_, int, np.integer)):
            converted[key] = np.int64(value)
        elif isinstance(value, (float, np.floating)):
            converted[key] = np.float64(value)
        else:
            converted[key] = value
    call = jax.ffi.ffi_call(target, results, vmap_method=vmap_method)
    return call(*args, **converted)
