"""The matching layer's chain rules, shared by both IR adapters.

Each adapter keeps a table of the ops a chain absorbs into ``y·s + t`` (add, sub, mul, div,
neg by a scalar or a per-channel operand) and of the ops it passes through while the channel
axis stays identifiable (float casts, unit-dim reshapes, transposes, sharding constraints);
the rules those tables apply are written here once: :func:`pass_axis` (where the channel
axis goes through a shape op), :func:`unit_reshape_map`, and
:func:`resolve_channel_operand`, which decides from shapes alone whether an operand is
per-channel. Every failed match is reported as a reason (``Refusal``), never an exception.
"""
from __future__ import annotations

import math
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .reasons import Reason


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a match failed, in words a user can act on (``axis``: the offending axis, if any;
    ``kind``: the rule, a key of ``_base.reasons.KINDS``, unless ``reason`` is a Reason)."""

    reason: str
    axis: int | None = None
    kind: str = "feature-axis"

    def __post_init__(self):
        if not isinstance(self.reason, Reason):
            object.__setattr__(self, "reason", Reason(self.kind, self.reason))
        object.__setattr__(self, "kind", self.reason.kind)

    def __str__(self) -> str:
        return self.reason


def is_float(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def is_extended(x) -> bool:
    """Whether ``x`` (a value) is of an extended dtype — a PRNG key: no number a fold reads,
    and NumPy cannot hold it; passed as it is."""
    return bool(jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.extended))


# --------------------------------------------------------------------------- chain steps


@dataclasses.dataclass(frozen=True)
class ChannelOperand:
    """A per-channel operand traced back to its smallest source.

    ``source`` is a Var or Literal whose only non-unit axis (``source_axis``, or None for a
    scalar / all-unit shape) is the chain's channel axis; ``casts`` are the float casts the
    program applied between the source and its use, in order.
    """

    source: Any
    source_axis: int | None
    casts: tuple[Any, ...]
    size: int = 1             # the channel count (1 for a scalar-like source)
    # channels on a Block: the source's extent along each block axis (1 where it is
    # broadcast, e.g. a per-head scale over (heads, head_dim)); None on one channel axis
    block: tuple | None = None
    block_dims: tuple | None = None   # the Block's own dims (its extents when not broadcast)


@dataclasses.dataclass(frozen=True)
class Block:
    """Consecutive axes that carry the channels together: a multi-head projection's
    (heads, head_dim) output features, and its kernel's. Channel ``c`` is their row-major
    flat index; anything that takes a channel axis also takes a Block."""

    axes: tuple
    dims: tuple

    @property
    def size(self) -> int:
        return int(math.prod(self.dims))

    def __str__(self) -> str:
        return "axes " + ", ".join(map(str, self.axes))


def on_axis(a, axis) -> bool:
    """Whether axis ``a`` is (one of) the channel ``axis`` (an int or a :class:`Block`)."""
    return a in axis.axes if isinstance(axis, Block) else a == axis


def channel_count(shape, axis) -> int:
    """The channels along ``axis`` (an int, or a :class:`Block`) of a value of ``shape``."""
    return axis.size if isinstance(axis, Block) else int(shape[axis])


def _axis_name(axis) -> str:
    return str(axis) if isinstance(axis, Block) else f"axis {axis}"


def unit_reshape_map(old_shape, new_shape) -> dict[int, int] | None:
    """Map old non-unit axes to new ones when a reshape only inserts/removes unit dims."""
    old_nu = [i for i, d in enumerate(old_shape) if d != 1]
    new_nu = [i for i, d in enumerate(new_shape) if d != 1]
    if [old_shape[i] for i in old_nu] != [new_shape[i] for i in new_nu]:
        return None
    return dict(zip(old_nu, new_nu))


def _channel_through_reshape(src_shape, out_shape, axis: int) -> int | None:
    """Where a reshape puts axis ``axis`` of ``src_shape``, if it survives as one axis of the
    same size with the same number of elements before it (other axes may merge or split)."""
    c = src_shape[axis]
    before = math.prod(src_shape[:axis])
    acc = 1
    for j, d in enumerate(out_shape):
        if acc == before and d == c:
            return j
        acc *= d
        if acc > before:
            return None
    return None


def resolve_channel_operand(value, out_shape, channel_axis: int, step_of: Callable,
                            shape_of: Callable, explain: bool = True
                            ) -> ChannelOperand | Refusal:
    """Decide whether ``value`` (an operand of a binary op whose other input is the chain
    value of shape ``out_shape``) varies only along ``channel_axis``: the one rule of both IR
    adapters, which supply ``shape_of(value)`` and ``step_of(value)``: what produced it, as
    ``(kind, source, detail)`` with kind ``broadcast_in_dim`` (detail: broadcast dims),
    ``reshape``, ``squeeze`` (detail: squeezed dims), ``convert`` (detail: the new element
    type; only between float types), ``dynamic`` (a broadcast to a symbolic shape), or None.

    Decided from shapes, walking back through broadcasts, unit-dim reshapes and float casts
    to the smallest source: never from element counts. ``explain=False``: a caller that only
    asks whether it resolves gets :data:`NOT_PER_CHANNEL` instead of the refusal's words.
    """
    rank = len(out_shape)
    shape = tuple(shape_of(value))
    if len(shape) not in (0, rank):
        return Refusal(f"operand of rank {len(shape)} against a value of rank {rank}")
    # axis_map: axis of the current value -> axis of the chain value (None: unit, unmapped)
    axis_map: dict[int, int | None] = {i: i for i in range(len(shape))}
    cur, casts = value, []
    first_bad: int | None = None
    found: ChannelOperand | None = None
    for _ in range(64):
        cshape = shape if cur is value else tuple(shape_of(cur))
        bad = [i for i, d in enumerate(cshape) if d != 1 and
               not on_axis(axis_map.get(i), channel_axis)]
        step = step_of(cur)
        kind = step[0] if step is not None else None
        partial = not bad and _partial_block(cshape, axis_map, channel_axis)
        if not bad and not partial:
            src_axis = next((i for i, d in enumerate(cshape)
                             if d != 1 and on_axis(axis_map.get(i), channel_axis)), None)
            found = ChannelOperand(cur, src_axis, tuple(casts), 1 if src_axis is None else
                                   channel_axis.size if isinstance(channel_axis, Block)
                                   else cshape[src_axis],
                                   *((_block_extent(cshape, axis_map, channel_axis),
                                      channel_axis.dims) if src_axis is not None and
                                     isinstance(channel_axis, Block) else (None, None)))
            # keep walking through shape-only ops to the smallest source (e.g. the (C,)
            # vector behind a (1, 1, 1, C) broadcast), so nothing is re-broadcast
            if kind not in ("broadcast_in_dim", "reshape", "squeeze"):
                return found
        elif partial:
            first_bad = None          # the most telling: a part of the (heads, head_dim) block
        elif axis_map.get(bad[0]) is not None:
            # the deepest source seen so far is the most telling: report its axis
            first_bad = axis_map.get(bad[0])
        if kind is None:
            break
        _, src, detail = step
        sshape = tuple(shape_of(src))
        if kind == "broadcast_in_dim":
            axis_map = {i: axis_map.get(int(b)) for i, b in enumerate(detail)}
        elif kind == "reshape":
            m = unit_reshape_map(sshape, cshape)
            if m is None:
                break
            axis_map = {i: axis_map.get(m[i]) if i in m else None for i in range(len(sshape))}
        elif kind == "squeeze":
            dims = set(int(d) for d in detail)
            kept = [i for i in range(len(sshape)) if i not in dims]
            axis_map = {i: (axis_map.get(kept.index(i)) if i in kept else None)
                        for i in range(len(sshape))}
        elif kind == "convert":
            casts.insert(0, detail)
        elif kind == "dynamic":
            return Refusal("operand is broadcast to a symbolic (dynamic) shape: symbolic-shape "
                           "modules are not folded at the StableHLO level; fold before "
                           "exporting (hlofold.export takes symbolic shapes)", kind="symbolic")
        else:
            break
        cur = src
    if found is not None:
        return found
    if not explain:
        return NOT_PER_CHANNEL
    if isinstance(channel_axis, Block) and first_bad is None:
        return Refusal(f"operand varies along only some of the output-feature {channel_axis}, "
                       "or along them in another order")
    same = " (same size as the channels: matched by axis, not size)" if \
        first_bad is not None and not isinstance(channel_axis, Block) and \
        out_shape[first_bad] == out_shape[channel_axis] else ""
    where = (f"{_axis_name(first_bad)} (size {out_shape[first_bad]})" if first_bad is not None
             else "a non-feature axis")
    return Refusal(f"operand varies along {where}, not only along the output-feature "
                   f"{_axis_name(channel_axis)}{same}", first_bad)


def _partial_block(cshape, axis_map, block) -> bool:
    """A value varying along a Block's axes out of their order (its flat index would not
    follow the channel index); one broadcast along some of them is fine (``block``)."""
    if not isinstance(block, Block):
        return False
    mapped = [axis_map.get(i) for i, d in enumerate(cshape) if d != 1]
    return mapped != sorted(mapped)


def _block_extent(cshape, axis_map, block) -> tuple | None:
    """The value's extent along each axis of ``block`` (1 where it is broadcast)."""
    if not isinstance(block, Block):
        return None
    ext = {axis_map.get(i): d for i, d in enumerate(cshape) if d != 1}
    return tuple(ext.get(a, 1) for a in block.axes)


def block_values(op: "ChannelOperand", flat, xp=None):
    """A Block operand's values (``flat``: its source's, row-major) as the per-channel
    vector over the whole block (broadcast where the source is). ``xp``: None for NumPy,
    else ``(reshape, broadcast_to)`` of the caller's IR."""
    dims = op.block_dims
    if op.block is None or flat is None or tuple(op.block) == tuple(dims):
        return flat
    if xp is None:
        return np.broadcast_to(np.reshape(flat, op.block), dims).reshape(-1)
    reshape, broadcast_to = xp
    return reshape(broadcast_to(reshape(flat, op.block), dims), (int(np.prod(dims)),))


# What resolve_channel_operand(..., explain=False) refuses with (no words are built)
NOT_PER_CHANNEL = Refusal("operand varies along a non-feature axis")

# A refusal both adapters write (after the op's name), in the same words.
DIVISOR = Reason("not-affine", "with the conv value as divisor is not affine")

def pass_axis(kind: str, src_shape, out_shape, axis: int, *, floats: bool = True,
              perm=None, bdims=None, dims=None) -> int | Refusal:
    """New channel axis after a shape op or cast, or why the chain cannot pass it; one rule
    for both IR adapters (``kind``: convert, reshape, squeeze, broadcast_in_dim, transpose,
    sharding_constraint; ``floats``: a convert is between float types)."""
    if kind == "convert":
        return axis if floats else Refusal("cast between a float and a non-float type",
                                           kind="not-float")
    if kind == "sharding_constraint":     # replayed on the folded conv's output, same shape
        return axis
    if isinstance(axis, Block):
        return Refusal(f"{kind} moves the output-feature {axis} (heads, head_dim)",
                       kind="chain-end")
    if src_shape[axis] == 1 and kind != "transpose":
        return Refusal(f"{kind} of a value whose channel axis has size 1 (ambiguous)")
    if kind == "reshape":
        j = _channel_through_reshape(tuple(src_shape), tuple(out_shape), axis)
        if j is None:
            return Refusal(f"reshape {tuple(src_shape)} -> {tuple(out_shape)} merges or "
                           "splits the channel axis")
        return j
    if kind == "squeeze":
        return [i for i in range(len(src_shape)) if i not in set(dims)].index(axis)
    if kind == "broadcast_in_dim":
        bdims = tuple(int(b) for b in bdims)
        if tuple(out_shape[b] for b in bdims) != tuple(src_shape) or \
                any(out_shape[i] != 1 for i in range(len(out_shape)) if i not in bdims):
            return Refusal("broadcast_in_dim that replicates the conv value")
        return bdims[axis]
    if kind == "transpose":
        return tuple(int(p) for p in perm).index(axis)
    return Refusal(f"chain ends at {kind}", kind="chain-end")
