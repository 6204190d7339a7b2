"""jaxops: CUDA kernels for JAX as XLA FFI custom calls, with C++ CPU twins.

Every function works under ``jax.jit`` and ``jax.vmap``; the differentiable ones define
``jax.custom_vjp`` rules whose backward passes are FFI kernels too. One private module per op
family holds the public functions; this package re-exports them.
"""
__version__ = "0.1.0"

from jaxops import _version_check

_version_check.check_jax()  # first: a too-old jax gets an ImportError naming the version needed
from jaxops import _knn, _layer_norm, _normalization, _reductions, _softmax
from jaxops._ffi import build_info, has_cuda
from jaxops._knn import *  # noqa: F401,F403
from jaxops._layer_norm import *  # noqa: F401,F403
from jaxops._normalization import *  # noqa: F401,F403
from jaxops._reductions import *  # noqa: F401,F403
from jaxops._softmax import *  # noqa: F401,F403

__all__ = [
    "build_info",
    "has_cuda",
    *_softmax.__all__,
    *_normalization.__all__,
    *_layer_norm.__all__,
    *_reductions.__all__,
    *_knn.__all__,
]
