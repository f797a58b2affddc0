"""What a root is, for both IRs: ``RootInfo`` (which output axis carries the features, which
kernel axis produces them), layout names, what a non-feature axis is, and the geometry of a
convolution's border (which taps read the input; the bias map of a shift in front).

Each adapter reads its roots into these (``hlofold._fold.jaxpr.patterns``,
``hlofold._fold.stablehlo.patterns``); the chain that follows a root is matched by the rules of
:mod:`hlofold._base.chain_rules`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from hlofold._base.chain_rules import Block, Refusal


# --------------------------------------------------------------------------- roots


@dataclasses.dataclass(frozen=True)
class RootInfo:
    """What a pattern learned about its root equation."""

    channel_axis: int      # output axis that carries the features
    kernel_index: int      # operand index of the kernel
    kernel_axis: int       # kernel axis along which output features are produced
    layout: str
    in_channels: int
    out_channels: int
    groups: int


_SPATIAL = {1: "W", 2: "HW", 3: "DHW"}


def conv_layout(lhs_spec, rhs_spec, out_spec) -> str:
    """``"NHWC,HWIO->NHWC"`` from the (batch/out-feature, feature/in-feature, *spatial)
    dimension numbers of a convolution's three operands; shared by both IR adapters."""
    return _conv_layout(tuple(lhs_spec), tuple(rhs_spec), tuple(out_spec))


@functools.lru_cache(maxsize=256)
def _conv_layout(lhs_spec, rhs_spec, out_spec) -> str:
    return (f"{_spec_letters(lhs_spec, 'N', 'C')},"
            f"{_spec_letters(rhs_spec, 'O', 'I')}->{_spec_letters(out_spec, 'N', 'C')}")


def dot_layout(lhs, rhs, out, weight_on_lhs: bool = False) -> str:
    """``"dot(8, 16)x(16, 32)->(8, 32)"`` from the three shapes."""
    return _dot_layout(tuple(lhs), tuple(rhs), tuple(out), weight_on_lhs)


@functools.lru_cache(maxsize=256)      # (a model's layers repeat their shapes)
def _dot_layout(lhs, rhs, out, weight_on_lhs: bool) -> str:
    return f"dot{lhs}x{rhs}->{out}" + (" (weight on the lhs)" if weight_on_lhs else "")


def _spec_letters(spec: tuple[int, ...], first: str, second: str) -> str:
    rank = len(spec)
    spatial = _SPATIAL.get(rank - 2, "".join(f"S{i}" for i in range(rank - 2)))
    letters = [""] * rank
    letters[spec[0]] = first
    letters[spec[1]] = second
    for pos, ch in zip(spec[2:], spatial):
        letters[pos] = ch
    return "".join(letters)


def conv_axis_role(axis: int, batch_axis: int) -> str:
    """What a non-feature axis of a convolution's output is (both adapters' refusals)."""
    return "the batch axis" if axis == batch_axis else "a spatial axis"


def dot_axis_role(axis: int, n_batch: int, n_lhs_free: int) -> str:
    """What a non-feature axis of a dot's output is: batch dims, then the lhs's free dims,
    then the rhs's."""
    if axis < n_batch:
        return "a batch dimension of the dot"
    if axis < n_batch + n_lhs_free:
        return "a free dimension of the lhs (the activations)"
    return "a free dimension of the rhs"


def border_masks(lhs: Sequence, rhs: Sequence, out: Sequence, strides: Sequence,
                 pad_lo: Sequence, lhs_dilation: Sequence, rhs_dilation: Sequence
                 ) -> list | None | Refusal:
    """Which taps of a convolution read the input, per spatial dimension (sizes of the input,
    kernel and output there; strides, low padding, dilations): a (kernel size, output size)
    0/1 matrix each; None where every output position reads every tap from the input
    (VALID, no lhs dilation), so a shift in front adds the same bias everywhere. One rule
    for both IRs."""
    masks = []
    for h, k, ho, st, lo, a, rd in zip(lhs, rhs, out, strides, pad_lo, lhs_dilation,
                                        rhs_dilation):
        if not all(isinstance(n, (int, np.integer)) for n in (h, k, ho)):
            return Refusal("a symbolic spatial size: the bias map of a padded "
                           "convolution (its border sees less of the shift t) needs "
                           "the spatial sizes", kind="symbolic")
        # position in the lhs-dilated input that output o reads at tap j
        q = np.arange(ho)[None, :] * st + np.arange(k)[:, None] * rd - lo
        masks.append(((q >= 0) & (q <= (h - 1) * a) & (q % a == 0)).astype(np.float64))
    return None if all(m.all() for m in masks) else masks


def bias_map(taps: np.ndarray, masks: list, rhs_spec: Sequence, out_spec: Sequence
             ) -> np.ndarray:
    """``conv(pad(t), K)``, the output of a constant image ``t``, from ``taps`` (the
    float64 kernel with the input features contracted against ``t``: kernel layout, the
    input-feature axis of size 1): shaped like the output with a batch of 1 (``rhs_spec``,
    ``out_spec``: the kernel's and output's (O/N, I/C, spatial...) axes)."""
    n = len(masks)
    w = np.transpose(taps, tuple(rhs_spec)).astype(np.float64)[:, 0]
    letters = "abcdefgh"[:n]
    spec = ("o" + letters + "," + ",".join(f"{c}{c.upper()}" for c in letters) +
            "->" + letters.upper() + "o")
    # interior positions share one column of taps: contract each distinct column once,
    # then copy it out (features last: each copy moves contiguous rows)
    cols = [_distinct_columns(m) for m in masks]
    m = np.einsum(spec, w, *[u for u, _ in cols], optimize=True)
    for d, (_, inv) in enumerate(cols):
        m = np.take(m, inv, axis=d)
    m = m[None]                                            # (1, *spatial out, O)
    return np.moveaxis(m, list(range(n + 2)), [out_spec[0]] + list(out_spec[2:]) +
                       [out_spec[1]])


def _distinct_columns(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(u, inv)`` with ``m == u[:, inv]``, the columns of the 0/1 matrix ``m`` distinct."""
    if m.shape[0] > 50:
        u, inv = np.unique(m, axis=1, return_inverse=True)
        return u, inv.reshape(-1)
    key = (2.0 ** np.arange(m.shape[0])) @ m           # exact: one bit per tap
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return m[:, first], inv.reshape(-1)


def block_of(rhs_shape, rhs_free, out_first: int):
    """``(output Block, kernel Block)`` of a dot whose weight has several free dimensions,
    contiguous in it (they are then contiguous in the output, from ``out_first``), else None."""
    free = list(rhs_free)
    if len(free) < 2 or free != list(range(free[0], free[0] + len(free))) or \
            not all(isinstance(rhs_shape[d], (int, np.integer)) for d in free):
        return None
    dims = tuple(int(rhs_shape[d]) for d in rhs_free)
    return Block(tuple(range(out_first, out_first + len(dims))), dims), Block(tuple(rhs_free), dims)


def product_layout(lhs_rank: int, rhs_rank: int, lc, rc, lb, rb):
    """A ``dot_general`` that contracts nothing and one of whose operands has only batch
    axes (a per-channel scale applied by ``einsum("...k,k->...k")``): ``(the other operand's
    index, the dot's layout as a permutation of its axes, the vector's index, the vector's
    axes and the other's, in batch order)`` — each output element one product, which both IR
    adapters spell as such (``_fold.{jaxpr,stablehlo}.canonical``); else None."""
    if lc or rc or not lb:
        return None
    ranks = (lhs_rank, rhs_rank)
    for j, (vb, xb) in enumerate(((lb, rb), (rb, lb))):     # j: the vector's operand
        if ranks[j] != len(vb):
            continue
        free = [d for d in range(ranks[1 - j]) if d not in xb]
        return 1 - j, tuple(xb) + tuple(free), j, tuple(vb), tuple(xb)
    return None
