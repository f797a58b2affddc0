"""Where a pair's channel goes through reshapes and dots of activations: the shape
arithmetic both adapters' pair rules (``_quant.jaxpr.pair_rules``, ``_quant.stablehlo.pair_rules``) use.

A channel is an axis, or a tuple of axes (most significant first) where it is split over
several — attention's heads: ``(…, d) → (…, heads, head_dim)``, transposed, a batch axis of
``probs @ v``, merged back before the output projection. Where a broadcast copies the channels
along a new axis among theirs (grouped-query attention repeating the kv heads to the query
heads), they are :class:`Mapped`: the axes that carry them, and which channel each position
holds.
"""
from __future__ import annotations

import math

import dataclasses
from typing import Sequence

import numpy as np

REPEATED = ("the channels, repeated over an axis (grouped-query attention's kv heads), reach "
            "{op}: only reshapes, transposes, casts, products and the next layer pass them")


@dataclasses.dataclass(frozen=True, eq=False)
class Mapped:
    """Channels repeated along some of the axes that carry them: ``axes`` (in order) and
    ``ids``, shaped by those axes' sizes in that order, the channel at each position (a
    query head reads its kv head's channels)."""

    axes: tuple
    ids: np.ndarray

    @property
    def channels(self) -> int:
        return int(self.ids.max()) + 1

    def positions(self) -> tuple:
        """The channel each position holds, flat (the axes' order, row-major)."""
        return tuple(int(i) for i in self.ids.ravel())

    def shifted(self, by: int) -> "Mapped":
        return Mapped(tuple(a + by for a in self.axes), self.ids)


def settled(axis):
    """``axis`` as plain axes where it is :class:`Mapped` only by copies along axes that hold
    no channel (a broadcast of the activations along a new batch axis: each position there
    is an output of its own, not a repeat another layer contracts) — the channels along the
    remaining axes, each once, in order; else ``axis`` as it is."""
    if not isinstance(axis, Mapped):
        return axis
    ids = axis.ids
    varying = [k for k in range(ids.ndim) if ids.shape[k] > 1 and
               not np.all(ids == np.take(ids, [0], axis=k))]
    if not varying:
        return axis
    sub = ids[tuple(slice(None) if k in varying else 0 for k in range(ids.ndim))]
    if not np.array_equal(sub.ravel(), np.arange(sub.size)):
        return axis
    return one(tuple(axis.axes[k] for k in varying))


def broadcast(dims: Sequence[int], in_shape: Sequence[int], out_shape: Sequence[int], axis):
    """The channel's axes after a ``broadcast_in_dim`` with ``dims`` from ``in_shape`` to
    ``out_shape``: each axis moves; a new axis among the channel's (between its first and
    last, or after unit axes just before them: one kv head of multi-query attention)
    copies them along it — :class:`Mapped`."""
    dims = list(dims)
    ax = list(axis.axes if isinstance(axis, Mapped) else each(axis))
    lead, k = [], min(ax) - 1
    while k >= 0 and in_shape[k] == 1 and k not in ax:
        lead.insert(0, k)
        k -= 1
    moved = [dims[a] for a in ax]
    span = [dims[a] for a in lead] + moved
    copies = [d for d in range(min(span) + 1, max(span)) if d not in dims and out_shape[d] > 1]
    if not copies and not isinstance(axis, Mapped):
        return one(tuple(moved))
    ids = axis.ids if isinstance(axis, Mapped) else \
        np.arange(int(np.prod([out_shape[d] for d in moved]))).reshape(
            [out_shape[d] for d in moved])
    ids = ids.transpose(np.argsort(moved)).reshape(
        [1] * len(lead) + [out_shape[d] for d in sorted(moved)])
    have = [dims[a] for a in lead] + sorted(moved)
    new = sorted(have + copies)
    ids = np.expand_dims(ids.transpose(np.argsort(have)), [new.index(d) for d in copies])
    return Mapped(tuple(new), np.broadcast_to(ids, [out_shape[d] for d in new]))


def each(axis) -> tuple:
    """The channel as a tuple of axes, most significant first (split over several axes —
    attention's heads — it is ``(head axis, feature axis)``, in any positions)."""
    return axis if isinstance(axis, tuple) else (axis,)


def one(axes: tuple):
    """A channel over one axis as that axis; over several, the tuple."""
    return axes[0] if len(axes) == 1 else axes


def permuted(perm: Sequence[int], axis):
    """The channel's axes after a transpose by ``perm``."""
    perm = list(perm)
    if isinstance(axis, Mapped):
        return Mapped(tuple(perm.index(a) for a in axis.axes), axis.ids)
    return one(tuple(perm.index(a) for a in each(axis)))


def reshaped(old: Sequence[int], new: Sequence[int], axis):
    """The channel's axes after a reshape from ``old`` to ``new`` that keeps the channels
    whole and in order (the sizes before and after them unchanged): they may be split over
    consecutive axes (heads) or merged back (with unit axes between them); else why not."""
    if isinstance(axis, Mapped):
        return _reshaped_mapped(old, new, axis)
    ax = each(axis)
    if list(ax) != sorted(ax) or any(old[a] != 1 for a in range(ax[0], ax[-1] + 1)
                                     if a not in ax):   # (unit axes between them are none)
        return ("a reshape of channels split over axes that are not together (another "
                "axis between them)")
    lo, hi = ax[0], ax[-1] + 1
    if not all(isinstance(d, (int, np.integer)) for d in (*old, *new)):
        return "a reshape of symbolic dimensions"
    old, new = [int(d) for d in old], [int(d) for d in new]
    before, size = math.prod(old[:lo]), math.prod(old[lo:hi])
    starts = [k for k in range(len(new) + 1) if math.prod(new[:k]) == before]
    for k in reversed(starts):                 # (after any unit axes before them)
        for m in range(k + 1, len(new) + 1):
            if math.prod(new[k:m]) == size:
                return one(tuple(range(k, m)))
            if math.prod(new[k:m]) > size:
                break
    return "a reshape that merges the channels with another axis (a flatten)"


def _reshaped_mapped(old, new, axis: "Mapped"):
    order = np.argsort(axis.axes)
    ax = [int(a) for a in np.asarray(axis.axes)[order]]
    gaps = [a for a in range(ax[0], ax[-1] + 1) if a not in ax]
    if any(old[a] != 1 for a in gaps):
        return "a reshape of repeated channels over axes that are not together"
    ids = axis.ids.transpose(order)
    full = sorted(ax + gaps)                  # (unit axes between them: carried along)
    ids = np.expand_dims(ids, [full.index(a) for a in gaps])
    got = reshaped(old, new, tuple(full))
    if isinstance(got, str):
        return got
    got = each(got)
    return Mapped(got, ids.reshape([new[a] for a in got]))


def through_dot(ranks: Sequence[int], contracting: Sequence[Sequence[int]],
                batch: Sequence[Sequence[int]], pos: int, axis):
    """The channel's axes in the output of a dot of two activations (attention's ``probs @
    v``, the heads a batch axis) whose operand ``pos`` carries it, with these dimension
    numbers (``contracting``/``batch``: the lhs's, the rhs's); None where the dot contracts
    a channel axis (then it is no path). The output's axes: the batch axes, the lhs's free
    axes, the rhs's."""
    contract, bat = contracting[pos], batch[pos]
    if isinstance(axis, Mapped):
        got = through_dot(ranks, contracting, batch, pos, axis.axes)
        return None if got is None else Mapped(each(got), axis.ids)
    if any(a in contract for a in each(axis)):
        return None
    free = [d for d in range(ranks[pos]) if d not in contract and d not in bat]
    n_lhs_free = ranks[0] - len(contracting[0]) - len(batch[0])
    return one(tuple(list(bat).index(a) if a in bat else
                     len(batch[0]) + (0 if pos == 0 else n_lhs_free) + free.index(a)
                     for a in each(axis)))


def read_by_kernel(contracting: Sequence[Sequence[int]], batch: Sequence[Sequence[int]],
                   kernel_rank: int, pos: int, axis):
    """``(kernel input axes, a kernel output axis)`` of a dot whose operand ``pos`` carries
    channels split over axes and whose other operand is a kernel contracting exactly those
    (an output projection reading (heads, head_dim)), in the channel's order; None
    otherwise (a batch axis, other axes contracted, no output axis). ``contracting`` /
    ``batch``: the lhs's, the rhs's."""
    act, ker = contracting[pos], contracting[1 - pos]
    ax = axis.axes if isinstance(axis, Mapped) else each(axis)
    free = [d for d in range(kernel_rank) if d not in ker]
    if batch[0] or batch[1] or sorted(act) != sorted(ax) or not free:
        return None
    by = dict(zip(act, ker))
    return one(tuple(by[a] for a in ax)), free[0]


def as_block(axis, shape):
    """Channels split over consecutive axes, in order, as the fold's
    :class:`~hlofold._base.chain_rules.Block` (what the per-channel operand rule reads);
    None for channels on one axis, or over axes apart or reordered (no bias can follow)."""
    from .chain_rules import Block
    ax = each(axis)
    if len(ax) < 2 or list(ax) != list(range(ax[0], ax[0] + len(ax))):
        return None
    return Block(tuple(ax), tuple(int(shape[a]) for a in ax))


def whole_block(operand, block) -> bool:
    """Whether a per-channel operand (``chain_rules.ChannelOperand``) varies over the whole
    ``block`` (one value per channel: a bias it divides by the scale)."""
    return operand.block is not None and tuple(operand.block) == tuple(block.dims)


def back_through_shape(kind: str, in_shape, out_shape, axis: int, dims=None) -> int | None:
    """The operand's axis holding the channels a shape op's result holds on ``axis``, where
    the op keeps them whole and moves no value across them: a reshape, squeeze or
    expand_dims (other axes merged or split, as Equinox's unbatched layers under ``vmap``
    write), a ``broadcast_in_dim`` that keeps that axis (``dims``); else None."""
    if not isinstance(axis, int):
        return None
    if kind in ("reshape", "squeeze", "expand"):
        got = reshaped(tuple(out_shape), tuple(in_shape), axis)
    elif kind == "broadcast" and dims is not None and axis in dims:
        got = list(dims).index(axis)
    else:
        return None
    if not isinstance(got, int) or int(in_shape[got]) != int(out_shape[axis]):
        return None
    return got
