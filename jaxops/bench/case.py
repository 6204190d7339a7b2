"""What a benchmark case is; each op family's cases_<family>.py builds a list of them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np


@dataclass
class Case:
    """One timed comparison: jaxops against the XLA reference on the same fresh inputs.

    make_inputs(key) returns a tuple of device arrays (random, never zeros); both functions
    take them positionally. `bytes` is the op's minimal traffic: each input read once and each
    output written once (or the family's stated bound). `x` is the plot abscissa (row length).
    """

    op: str
    shape: tuple[int, ...]
    dtype: str
    make_inputs: Callable[[jax.Array], Sequence[jax.Array]]
    jaxops_fn: Callable[..., Any]
    xla_fn: Callable[..., Any] | None
    bytes: int
    x: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class Options:
    """What the user asked for on the command line, passed to every family's case builder."""

    ops: set[str] | None
    dtypes: list[str]
    shapes: list[tuple[int, ...]] | None
    gpu: bool


def dtype_of(name: str):
    return {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16,
            "float64": np.float64}[name]


def itemsize(name: str) -> int:
    return np.dtype(dtype_of(name)).itemsize


def wants(options: Options, op: str) -> bool:
    return options.ops is None or op in options.ops
