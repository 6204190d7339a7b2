"""Load-time compatibility checks: which jax/jaxlib jaxops supports, with actionable errors.

jaxops's handlers are compiled against the XLA FFI headers of the oldest supported jaxlib
(third_party/xla_ffi), so any jaxlib from ``JAX_MINIMUM`` on accepts them. Older jax has no
``jax.ffi`` at all, and its XLA rejects handlers it does not know; both are reported here as an
ImportError that names the version needed instead of a failure deep inside jax.
"""
from __future__ import annotations

import re

# Keep in step with pyproject.toml's dependencies, README and third_party/xla_ffi
# (tests/test_release.py checks that they agree).
JAX_MINIMUM = "0.5.0"
# The FFI API version of the headers jaxops is built against by default (jaxlib 0.5.0's).
FFI_API_VERSION = (0, 1)

_UPGRADE = f'pip install -U "jax>={JAX_MINIMUM}" "jaxlib>={JAX_MINIMUM}"'


def parse_version(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: '0.9.0.1' -> (0, 9, 0, 1), '0.6.0.dev1' -> (0, 6, 0)."""
    parts = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):  # '0rc1': the release part ends here
            break
    return tuple(parts)


def _too_old(version: str) -> bool:
    return parse_version(version) < parse_version(JAX_MINIMUM)


def installed_versions() -> tuple[str, str]:
    """(jax version, jaxlib version) without importing more of jax than needed."""
    import jax

    try:
        from jaxlib import version as jaxlib_version

        jaxlib = jaxlib_version.__version__
    except ImportError:  # pragma: no cover - jax without jaxlib cannot import at all
        jaxlib = "not installed"
    return jax.__version__, jaxlib


def check_jax(jax_version: str | None = None, jaxlib_version: str | None = None) -> None:
    """Raises ImportError when the installed jax or jaxlib is older than ``JAX_MINIMUM``."""
    if jax_version is None or jaxlib_version is None:
        found_jax, found_jaxlib = installed_versions()
        jax_version = jax_version or found_jax
        jaxlib_version = jaxlib_version or found_jaxlib
    old = [f"{name} {version}" for name, version in (("jax", jax_version), ("jaxlib", jaxlib_version))
           if _too_old(version)]
    if old:
        raise ImportError(
            f"jaxops needs jax and jaxlib >= {JAX_MINIMUM} (the first with jax.ffi and XLA FFI API "
            f"{FFI_API_VERSION[0]}.{FFI_API_VERSION[1]}), but found {' and '.join(old)}. "
            f"Upgrade with: {_UPGRADE}"
        )


def registration_error(target: str, platform: str, error: Exception, ffi_api: tuple[int, int]) -> ImportError:
    """The ImportError for a jaxlib that refused to register one of jaxops's FFI handlers."""
    jax_version, jaxlib_version = installed_versions()
    return ImportError(
        f"jaxops: jaxlib {jaxlib_version} (jax {jax_version}) refused FFI handler {target!r} for "
        f"{platform}: {error}\n"
        f"jaxops's handlers were compiled against XLA FFI API {ffi_api[0]}.{ffi_api[1]}; jaxops "
        f"supports jax/jaxlib >= {JAX_MINIMUM}. If your jaxlib is older, run: {_UPGRADE}. If it is "
        "newer and no longer accepts this FFI version, rebuild jaxops against it: "
        "JAXOPS_FFI_INCLUDE_DIR=jax pip install --no-build-isolation --force-reinstall jaxops "
        "(from a source checkout)."
    )
