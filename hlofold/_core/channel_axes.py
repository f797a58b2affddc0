"""Where a pair's channel goes through reshapes and dots of activations: the shape
arithmetic both adapters' pair rules (``_jaxpr.pair_rules``, ``_stablehlo.pair_rules``) use.

A channel is an axis, or a tuple of axes (most significant first) where it is split over
several — attention's heads: ``(…, d) → (…, heads, head_dim)``, transposed, a batch axis of
``probs @ v``, merged back before the output projection.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


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
    return one(tuple(perm.index(a) for a in each(axis)))


def reshaped(old: Sequence[int], new: Sequence[int], axis):
    """The channel's axes after a reshape from ``old`` to ``new`` that keeps the channels
    whole and in order (the sizes before and after them unchanged): they may be split over
    consecutive axes (heads) or merged back (with unit axes between them); else why not."""
    ax = each(axis)
    if list(ax) != sorted(ax) or any(old[a] != 1 for a in range(ax[0], ax[-1] + 1)
                                     if a not in ax):   # (unit axes between them are none)
        return ("a reshape of channels split over axes that are not together (as where "
                "grouped-query attention repeats the kv heads)")
    lo, hi = ax[0], ax[-1] + 1
    before, size = int(np.prod(old[:lo])), int(np.prod(old[lo:hi]))
    starts = [k for k in range(len(new) + 1) if int(np.prod(new[:k])) == before]
    for k in reversed(starts):                 # (after any unit axes before them)
        for m in range(k + 1, len(new) + 1):
            if int(np.prod(new[k:m])) == size:
                return one(tuple(range(k, m)))
            if int(np.prod(new[k:m])) > size:
                break
    return "a reshape that merges the channels with another axis (a flatten)"


def through_dot(ranks: Sequence[int], contracting: Sequence[Sequence[int]],
                batch: Sequence[Sequence[int]], pos: int, axis):
    """The channel's axes in the output of a dot of two activations (attention's ``probs @
    v``, the heads a batch axis) whose operand ``pos`` carries it, with these dimension
    numbers (``contracting``/``batch``: the lhs's, the rhs's); None where the dot contracts
    a channel axis (then it is no path). The output's axes: the batch axes, the lhs's free
    axes, the rhs's."""
    contract, bat = contracting[pos], batch[pos]
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
    ax = each(axis)
    free = [d for d in range(kernel_rank) if d not in ker]
    if batch[0] or batch[1] or sorted(act) != sorted(ax) or not free:
        return None
    by = dict(zip(act, ker))
    return one(tuple(by[a] for a in ax)), free[0]


def as_block(axis, shape):
    """Channels split over consecutive axes, in order, as the fold's
    :class:`~hlofold._core.chain_rules.Block` (what the per-channel operand rule reads);
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
