"""Scanned layer stacks: one fold per layer, restacked (the rule both adapters call).

A stack of layers run by a loop (``lax.scan`` over stacked parameters: ``flax.linen.scan``,
``nnx.scan``, MaxText; a StableHLO ``while`` reading them through ``dynamic_slice``) runs
one body ``L`` times, layer ``l`` reading slice ``l`` of each stacked parameter. Where those
parameters are known, each adapter folds the body once per layer with its slices known
(``K_l ⊙ s_l``, ``t_l``: the same rules and safety checks as an unrolled layer) and hands the
results here:

* the stack folds only when **every layer folds alike**: the same folded body up to the
  values of its constants (one site refused in one layer — σ² = 0 with ε = 0 — makes the
  bodies differ, and the stack is left as the loop it was, with that reason);
* a constant equal in every layer stays one loop-invariant operand; the others are stacked
  along a new leading axis and become per-iteration operands of the loop (the folded
  kernels and biases: one prepare for the stack, the body runs conv + bias).

The report has one record per site of the body, with ``layers = L``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from hlofold._base.reasons import Reason
from .rescale import aligned_empty

def layers_differ(why: str) -> Reason:
    """Why a scanned stack's sites are left: its layers do not fold alike."""
    return Reason("stack-layers-differ", f"the layers of this scanned stack do not fold "
                  f"alike ({why}); the loop is left as it is: each layer would need a body "
                  f"of its own")


def _status(rec) -> str:
    return rec.status + (f" ({rec.reason})" if rec.reason else "")


def first_difference(first: Sequence, other: Sequence, layer: int) -> str:
    """Where layer ``layer``'s records first differ from layer 0's (the words of
    :func:`layers_differ`)."""
    for a, b in zip(first, other):
        if (a.status, a.reason) != (b.status, b.reason):
            where = f"{a.file}:{a.line}" if a.file else a.scope
            return f"at {where}, layer 0 is {_status(a)} and layer {layer} {_status(b)}"
    if len(first) != len(other):
        return f"layer {layer} has {len(other)} sites, layer 0 {len(first)}"
    return f"layer {layer}'s folded body differs from layer 0's"


@dataclasses.dataclass
class Stacked:
    """Where each constant of the folded body goes: ``shared[j]`` (one value, loop-invariant)
    or ``stacked[j]`` (one per layer, stacked on axis 0), by the body's constant order."""

    shared: list[tuple[int, Any]]        # (constant index, value)
    stacked: list[tuple[int, np.ndarray]]


def _same(a, b) -> bool:
    if a is b:
        return True
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and \
        np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")


class Restack:
    """The constants of ``length`` folded bodies, restacked layer by layer as they come
    (``add``): a constant equal so far in every layer is held once, the first layer that
    differs allocates its stack (the earlier layers' rows filled from the first one), so no
    layer's values are held beyond its own ``add`` — the stack is the only copy."""

    def __init__(self, length: int):
        self.length = length
        self.key: Any = None
        self.first: list = []
        self.stacks: dict[int, np.ndarray] = {}
        self.layers = 0

    def add(self, key: Any, consts: Sequence[Any]) -> str | None:
        """Layer ``self.layers``'s body (``key``: it up to its constants' values), or why it
        does not fold like layer 0."""
        layer = self.layers
        if layer == 0:
            self.key, self.first = key, list(consts)
        elif key != self.key:
            return f"layer {layer} folds differently from layer 0"
        else:
            for j, c in enumerate(consts):
                if j not in self.stacks:
                    if _same(self.first[j], c):
                        continue
                    first = np.asarray(self.first[j])
                    self.stacks[j] = aligned_empty((self.length,) + first.shape, first.dtype)
                    self.stacks[j][:layer] = first
                self.stacks[j][layer] = np.asarray(c)
        self.layers += 1
        return None

    def result(self) -> Stacked:
        return Stacked([(j, c) for j, c in enumerate(self.first) if j not in self.stacks],
                       sorted(self.stacks.items()))


def stacked_view(values: Sequence[Any]) -> np.ndarray | None:
    """One array holding ``values`` (one per layer) as its rows, where they already are
    consecutive rows of one buffer (views of one allocation, same shape, dtype and strides,
    each starting where the previous ends): the stack without a copy. None otherwise."""
    first = values[0]
    if not isinstance(first, np.ndarray) or first.base is None or \
            not first.flags.c_contiguous:
        return None
    start, size = first.__array_interface__["data"][0], first.nbytes
    for k, v in enumerate(values):
        if not (isinstance(v, np.ndarray) and v.base is first.base and v.shape == first.shape
                and v.dtype == first.dtype and v.flags.c_contiguous and
                v.__array_interface__["data"][0] == start + k * size):
            return None
    return np.lib.stride_tricks.as_strided(first, (len(values),) + first.shape,
                                           (size,) + first.strides, writeable=False)


def mark_layers(records: Sequence, length: int) -> list:
    """``records`` (of a loop body's sites) marked as run ``length`` times — a stack inside a
    stack runs its body the product of both lengths."""
    for rec in records:
        rec.layers = (rec.layers or 1) * length
    return list(records)


def layer_records(per_layer: Sequence[list], length: int) -> list:
    """The report records of a stack folded alike: layer 0's, each marked with the stack
    length (the other layers' records say the same of their slices)."""
    return mark_layers(per_layer[0], length)
