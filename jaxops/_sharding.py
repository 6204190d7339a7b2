"""How every jaxops op partitions itself across devices under ``jax.jit``.

An FFI call is opaque to XLA: left alone, the SPMD partitioner gathers every operand onto
every device and runs the whole call there. jaxops therefore wraps each FFI call in one
mechanism, :func:`sharded_call`, which tells the partitioner how the op splits.

Why ``jax.experimental.custom_partitioning`` with a Shardy sharding rule, not ``shard_map``:

* Users shard with ``jax.sharding`` and ``jax.jit`` (``in_shardings``, committed sharded
  arrays, ``with_sharding_constraint``) and never name a mesh at the op. Inside ``jit`` in the
  default (auto) sharding mode, a tracer carries no sharding, so a ``shard_map`` wrapper would
  have to guess the mesh and the partition specs at trace time (or force the user to pass
  them). ``custom_partitioning`` is called by the partitioner itself with the shardings that
  propagation actually chose for the operands, so it splits the op the way the data already
  lies, whatever mesh the user built.
* The Shardy rule (jax 0.10 partitions with Shardy by default) lets shardings propagate
  *through* the op in both directions, like a native XLA op, instead of stopping at it.
* On one device, or inside a user's ``shard_map``/``pmap`` (all mesh axes manual), the
  wrapper lowers straight to the FFI call: no cost where there is nothing to partition.

``custom_partitioning`` has no batching or differentiation rule. Differentiation stays with
each family's ``jax.custom_vjp`` (the partitioned calls sit inside its fwd/bwd, which see
primal values only). Batching is added here with ``jax.custom_batching.custom_vmap``: a
batched call is the same op with the local function ``jax.vmap``-ed (so the FFI call's own
``vmap_method`` applies per shard) and one more leading "batch" factor in the rule, so the
vmapped axis may itself be sharded.

The rule of an op (:class:`Rule`) names a *factor* for every dimension of every operand and
result (as in an einsum). Three kinds of factor:

* pass-through (default): a dimension sharded on some mesh axes stays sharded; every operand
  and result that has the factor is split the same way and each device runs the op on its
  block (rows of softmax and layer_norm, queries of knn, elements of relu);
* ``replicated``: the op needs the whole dimension on each device (softmax's normalized axis,
  the feature axis of knn). If a user shards it anyway, its mesh axes are moved onto another
  factor of the largest operand (softmax split over its row becomes split over rows, each
  device does 1/n of the work; the partitioner picks the reshard: one all-to-all on jax 0.5
  and 0.10, all-gathers on jax 0.11.2) or, failing that, the partitioner gathers that
  operand; either way the result is correct;
* ``reduced``: the op may run on a block of the dimension and combine partial results
  itself; results never carry a reduced factor (reductions' reduced axis, knn's references).

The local function receives, in ``axes``, the mesh axes splitting every split factor and
combines partials with collectives over them: all-reduces of per-row partials for reductions
(logsumexp: max, then sum of exp; argmax: value, then first global index), one all-gather of
the small per-device (m, k) lists for knn, and for ops whose rows are split while a result
sums over rows (layer_norm's parameter gradients, SyncBatchNorm's per-channel statistics, an
all-reduce of (C,) vectors merged stably with Chan's formula) a psum over the row axes.

A factor whose size the devices splitting it do not divide evenly stays whole instead
(padding would feed garbage into reductions and global indices). Operands are visited
largest first, so on a conflict for a mesh axis the largest operand keeps its layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence, Union

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["Axes", "Dim", "Rule", "row_axes", "rows_rule", "sharded_call"]

# Mesh axes splitting each factor that is split, e.g. {"n": ("x",)}.
Axes = Mapping[str, tuple[str, ...]]
# One dimension of a value: a factor name, or a compound (major, ..., minor) of factor names.
Dim = Union[str, tuple[str, ...]]


@dataclass(frozen=True)
class Rule:
    """Factor names for each dimension of each operand and result, plus factor kinds.

    ``operands[i][j]`` names the factor of dimension j of operand i (``()`` for a scalar).
    Factors in ``replicated`` are never split; factors in ``reduced`` may be split and the
    local function then combines across the devices itself (they never appear in results).
    Factors appearing only in results (like knn's k) are never split. Results whose factors
    are all whole while an operand factor is split (a parameter gradient summed over sharded
    rows) must be combined by the local function too: it gets the mesh axes of every split
    factor in ``axes``.
    """

    operands: tuple[tuple[Dim, ...], ...]
    results: tuple[tuple[Dim, ...], ...]
    replicated: tuple[str, ...] = ()
    reduced: tuple[str, ...] = ()
    # Sizes of factors used inside compound dims, e.g. (("g", 4),): a dim written ("q", "g")
    # is q*g long, split (when sharded) on its major factor q only.
    factor_sizes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        in_results = {f for r in self.results for d in r for f in _factors(d)}
        bad = in_results & set(self.reduced)
        if bad:
            raise ValueError(f"reduced factors {sorted(bad)} cannot appear in results")

    def with_leading_batch(self, in_batched: Sequence[bool]) -> "Rule":
        """The rule of the op vmapped over a new leading axis of the batched operands."""
        name = _fresh_factor("vmap", self)
        return Rule(
            operands=tuple(((name,) + o) if b else o for o, b in zip(self.operands, in_batched)),
            results=tuple((name,) + r for r in self.results),
            replicated=self.replicated,
            reduced=self.reduced,
            factor_sizes=self.factor_sizes,
        )

    def sdy(self) -> str:
        """The Shardy (einsum-like) rule string, e.g. ``"b0 c, c -> b0 c"``."""
        sizes = dict(self.factor_sizes)

        def dim(d):
            if isinstance(d, str):
                return d
            # Shardy rejects size-1 factors inside a compound: leave them out.
            kept = [f for f in d if sizes.get(f) != 1] or [d[0]]
            return kept[0] if len(kept) == 1 else "(" + " ".join(kept) + ")"

        side = lambda values: ", ".join(" ".join(dim(d) for d in v) for v in values)  # noqa: E731
        return f"{side(self.operands)} -> {side(self.results)}"

    def sdy_factor_sizes(self) -> dict[str, int]:
        """Sizes Shardy needs: those of factors that appear only inside compounds."""
        plain = {self_dim for v in self.operands + self.results for self_dim in v
                 if isinstance(self_dim, str)}
        sizes = dict(self.factor_sizes)
        kept = set()
        for v in self.operands + self.results:
            for d in v:
                if not isinstance(d, str):
                    fs = [f for f in d if sizes.get(f) != 1] or [d[0]]
                    if len(fs) > 1:
                        kept |= set(fs)
                    else:  # a compound left with one factor is written as a whole dim
                        plain |= set(fs)
        return {f: n for f, n in sizes.items() if f in kept and f not in plain}


def _factors(dim) -> tuple[str, ...]:
    return (dim,) if isinstance(dim, str) else tuple(dim)


def _fresh_factor(prefix: str, rule: Rule) -> str:
    used = {f for v in rule.operands + rule.results for d in v for f in _factors(d)}
    i = 0
    while f"{prefix}{i}" in used:
        i += 1
    return f"{prefix}{i}"


def rows_rule(row_dims: int, operands: str, results: str, *, last: str = "c") -> Rule:
    """Rule for ops on rows: ``row_dims`` leading dims index independent rows of length c.

    ``operands`` and ``results`` have one letter per value, saying which dims it has:
    ``x`` rows and the row (``(b0, ..., c)``), ``s`` rows only (per-row statistics),
    ``p`` the row only (per-column parameters such as scale, or their gradients), ``0`` a
    scalar placeholder. The row factor ``c`` is replicated: the op needs whole rows. A result
    ``p`` computed from sharded rows (a parameter gradient) is the local function's to
    ``psum`` over ``axes`` of the row factors.
    """
    rows = tuple(f"b{i}" for i in range(row_dims))
    kinds = {"x": rows + (last,), "s": rows, "p": (last,), "0": ()}
    try:
        return Rule(operands=tuple(kinds[k] for k in operands),
                    results=tuple(kinds[k] for k in results), replicated=(last,))
    except KeyError as e:
        raise ValueError(f"rows_rule: unknown value kind {e}") from None


def row_axes(axes: Axes) -> tuple[str, ...]:
    """Mesh axes splitting the rows (factors ``b0, b1, ...``) in a local call of a
    :func:`rows_rule` op: the axes to ``psum`` a parameter gradient over. (Axes splitting a
    ``vmap`` factor are left out: that factor is in the gradient's shape, so each device's
    slice of it is already complete.)"""
    return tuple(a for f, names in sorted(axes.items()) if f[0] == "b" and f[1:].isdigit()
                 for a in names)


@dataclass(frozen=True, eq=False)
class _Op:
    """A local function plus its rule; hashed by identity (a static argument)."""

    local: Callable[..., Any]  # local(*args, axes) -> array or tuple of arrays
    rule: Rule
    name: str = field(default="")

    def run(self, args, axes: Axes):
        return self.local(*args, axes=axes)


def sharded_call(name: str, local: Callable[..., Any], rule: Rule, *args: jax.Array) -> Any:
    """Calls ``local(*args, axes={})`` so that, under a sharded ``jit``, it runs per shard.

    ``local`` must compute the op on whatever block of the operands it receives. ``axes``
    maps every factor that is split to the mesh axes splitting it (in major-to-minor order,
    as ``jax.lax.axis_index(axes[f])`` numbers the blocks); ``local`` must combine partial
    results across the axes of reduced factors with collectives (``jax.lax.psum``, ...).
    With ``axes={}`` it computes the whole op on one device. ``name`` appears in errors.
    """
    if len(rule.operands) != len(args):
        raise ValueError(f"jaxops.{name}: rule has {len(rule.operands)} operands, got {len(args)}")
    for arg, mapping in zip(args, rule.operands):
        if jax.numpy.ndim(arg) != len(mapping):
            raise ValueError(f"jaxops.{name}: rule {rule.sdy()} does not fit an operand of shape "
                             f"{jax.numpy.shape(arg)}")
    return _vmappable(_Op(local, rule, name), *args)


_BATCHED_TRACES = [0]  # local functions being traced under vmap right now (tracing is synchronous)


def in_batched_trace() -> bool:
    """True while an op's local function is traced under ``jax.vmap``: data-dependent control
    flow there (``lax.cond`` / ``lax.switch``) would run every branch, so ops can avoid it."""
    return _BATCHED_TRACES[0] > 0


def _vmappable(op: _Op, *args):
    @custom_vmap
    def call(*xs):
        return _partitioned(op, *xs)

    @call.def_vmap
    def _batched(axis_size, in_batched, *xs):
        del axis_size  # batched operands carry the new axis in front
        axes_in = tuple(0 if b else None for b in in_batched)

        def local(*ys, axes):
            _BATCHED_TRACES[0] += 1
            try:
                return jax.vmap(partial(op.local, axes=axes), in_axes=axes_in)(*ys)
            finally:
                _BATCHED_TRACES[0] -= 1

        batched = _Op(local, op.rule.with_leading_batch(in_batched), op.name)
        out = _vmappable(batched, *xs)
        return out, jax.tree.map(lambda _: True, out)

    return call(*args)


def _unsharded(op: _Op, *args):
    return op.run(args, {})


_partitioned = custom_partitioning(_unsharded, static_argnums=(0,))


def _sdy_rule(op: _Op, mesh, operand_types, result_types):
    del mesh, operand_types, result_types
    return op.rule.sdy(), {
        "need_replication_factors": op.rule.replicated,
        "reduction_factors": op.rule.reduced,
        **op.rule.sdy_factor_sizes(),
    }


def _spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _factor_axes(op: _Op, mesh, arg_shapes) -> dict[str, tuple[str, ...]]:
    """Which mesh axes split each factor, read from the operand shardings.

    Operands are visited largest first, so when two operands want one mesh axis for
    different factors, the largest keeps its layout (knn: the references, not the queries).
    A mesh axis is used by one factor only. Replicated factors, and factors whose size the
    devices do not divide evenly, stay whole.
    """
    rule = op.rule
    sizes: dict[str, int] = dict(rule.factor_sizes)
    for shape, mapping in zip(arg_shapes, rule.operands):
        for dim, factor in zip(shape.shape, mapping):
            if isinstance(factor, str):
                sizes.setdefault(factor, dim)
    order = sorted(range(len(arg_shapes)), key=lambda i: -_nbytes(arg_shapes[i]))
    chosen: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    for i in order:
        for factor, names in _operand_axes(arg_shapes[i], rule.operands[i]):
            if not names or factor in chosen or factor in rule.replicated:
                continue
            if used & set(names):
                continue
            count = math.prod(mesh.shape[a] for a in names)
            if count <= 1 or sizes[factor] % count:
                continue
            chosen[factor] = names
            used |= set(names)
    _move_onto_free_factor(rule, mesh, arg_shapes, order, sizes, chosen, used)
    return chosen


def _nbytes(shape) -> int:
    return math.prod(shape.shape) * jax.numpy.dtype(shape.dtype).itemsize


def _operand_axes(shape, mapping):
    """(factor, mesh axes) for each dim of one operand, from its NamedSharding."""
    sharding = getattr(shape, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return []
    spec = tuple(sharding.spec) + (None,) * (len(mapping) - len(sharding.spec))
    # A compound dim is split on its major factor (the minor ones stay whole).
    return [(_factors(factor)[0], _spec_axes(entry)) for factor, entry in zip(mapping, spec)]


def _move_onto_free_factor(rule: Rule, mesh, arg_shapes, order, sizes, chosen, used) -> None:
    """Mesh axes a user put on a replicated factor go to another factor instead.

    E.g. softmax of x sharded P(None, "x") over its normalized axis: rather than every
    device gathering all of x and computing everything, x is resharded to be split over rows
    on "x", each device normalizes its own rows, and the partitioner reshards the result back
    to the user's layout. (How it reshards is its choice: an all-to-all on jax 0.5 and 0.10,
    all-gathers on jax 0.11.2; the result is correct either way.) The factor chosen is the
    first of the largest operand that may be split (pass-through or reduced) and stays
    evenly divisible.
    """
    main = rule.operands[order[0]] if order else ()
    free = [_factors(d)[0] for d in main if _factors(d)[0] not in rule.replicated]
    for i in order:
        for factor, names in _operand_axes(arg_shapes[i], rule.operands[i]):
            names = tuple(a for a in names if a not in used)
            if factor not in rule.replicated or not names:
                continue
            count = math.prod(mesh.shape[a] for a in names)
            for target in free:
                have = chosen.get(target, ())
                if sizes[target] % (count * math.prod(mesh.shape[a] for a in have)) == 0:
                    chosen[target] = have + names
                    used |= set(names)
                    break


def _partition(op: _Op, mesh, arg_shapes, result_shape):
    chosen = _factor_axes(op, mesh, arg_shapes)

    arg_shardings = tuple(_named(mesh, m, chosen) for m in op.rule.operands)
    result_shardings = [_named(mesh, m, chosen) for m in op.rule.results]

    def lower(*args):
        return op.run(args, dict(chosen))

    return mesh, lower, _like_results(result_shape, result_shardings), arg_shardings


def _infer_from_operands(op: _Op, mesh, arg_shapes, result_shape):
    # Only used by the GSPMD partitioner (Shardy reads the sharding rule instead).
    chosen = _factor_axes(op, mesh, arg_shapes)
    out = [_named(mesh, m, chosen) for m in op.rule.results]
    return _like_results(result_shape, out)


def _like_results(result_shape, shardings: list[NamedSharding]):
    """The result shardings in the very pytree structure of the local function's results.

    jax < 0.6 checks it strictly (a list of results needs a list of shardings, not a tuple).
    """
    return jax.tree.unflatten(jax.tree.structure(result_shape), shardings)


def _named(mesh, mapping, chosen) -> NamedSharding:
    """The sharding of a value with factor `mapping` when factors are split as `chosen`."""
    spec = []
    for dim in mapping:
        names = tuple(a for f in _factors(dim) for a in chosen.get(f, ()))
        spec.append(None if not names else (names[0] if len(names) == 1 else names))
    return NamedSharding(mesh, PartitionSpec(*spec))


_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_from_operands,
    sharding_rule=_sdy_rule,
)
