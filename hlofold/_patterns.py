"""Rewrite patterns: the roots a fold starts from.

A *pattern* is a named object with a one-line ``Pattern:`` docstring, registered by the
primitive at its root (``PATTERNS[primitive_name]``). It knows, for its root equation, which
output axis carries the features and which kernel axis produces them. The chain that follows
the root is matched by the rules of :mod:`hlofold._chain_rules`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from . import _compat as C
from ._chain_rules import Refusal, is_float


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
    return (f"dot{tuple(lhs)}x{tuple(rhs)}->{tuple(out)}" +
            (" (weight on the lhs)" if weight_on_lhs else ""))


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


@dataclasses.dataclass(frozen=True)
class ConvAffinePattern:
    """Pattern: conv(x, K)·s + t  ->  conv(x, K ⊙ s) + broadcast_in_dim(t), s/t per output feature."""

    name: str = "conv_affine"
    root: str = "conv_general_dilated"

    def alternatives(self, eqn: C.JaxprEqn) -> list:
        """Other readings of the root (none: the kernel of a conv is its rhs)."""
        return []

    def inspect_root(self, eqn: C.JaxprEqn) -> RootInfo | Refusal:
        dn = eqn.params["dimension_numbers"]
        lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
        out = eqn.outvars[0].aval
        layout = conv_layout(lhs_spec, rhs_spec, out_spec)
        groups = int(eqn.params.get("feature_group_count", 1))
        info = RootInfo(channel_axis=out_spec[1], kernel_index=1, kernel_axis=rhs_spec[0],
                        layout=layout, in_channels=int(lhs.shape[lhs_spec[1]]),
                        out_channels=int(out.shape[out_spec[1]]), groups=groups)
        if not (is_float(rhs.dtype) and is_float(out.dtype)):
            return Refusal(f"integer convolution ({rhs.dtype} kernel, {out.dtype} output): "
                           "folding a scale into an integer kernel is not exact", kind="not-float")
        if rhs.shape[rhs_spec[0]] != out.shape[out_spec[1]]:
            return Refusal("kernel output-feature size differs from the output feature size",
                           kind="root")
        # batch_group_count > 1 is fine: every output feature still comes from exactly one
        # slice of the kernel along its output-feature dimension (checked numerically in tests).
        return info


    def explain_axis(self, eqn: C.JaxprEqn, axis: int) -> str:
        return conv_axis_role(axis, eqn.params["dimension_numbers"].out_spec[0])

    def input_feature_axis(self, eqn: C.JaxprEqn, act: int = 0) -> int | None:
        """The input-feature axis of operand ``act`` (the activations), if it has one."""
        return eqn.params["dimension_numbers"].lhs_spec[1] if act == 0 else None

    def input_channel(self, eqn: C.JaxprEqn, act: int = 0) -> tuple[int, int] | Refusal:
        """(lhs feature axis, kernel input-feature axis) for folding an affine *before* the
        conv. A scale is exact for any geometry (the padded and inserted zeros stay zero); a
        shift that the padding or lhs dilation hides from some taps becomes a bias map
        (:meth:`bias_map`)."""
        if act != 0:
            return Refusal("the convolution's activations are its rhs", kind="root")
        if eqn.params.get("batch_group_count", 1) != 1:
            return Refusal("batch_group_count > 1", kind="root")
        dn = eqn.params["dimension_numbers"]
        return dn.lhs_spec[1], dn.rhs_spec[1]

    def batch_axis(self, eqn: C.JaxprEqn) -> int:
        return eqn.params["dimension_numbers"].out_spec[0]

    def border_masks(self, eqn: C.JaxprEqn) -> list | None | Refusal:
        """Which taps read the input (:func:`border_masks`) for this equation."""
        p, dn = eqn.params, eqn.params["dimension_numbers"]
        lhs, rhs, out = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape, \
            eqn.outvars[0].aval.shape
        n = len(dn.lhs_spec) - 2
        return border_masks([lhs[dn.lhs_spec[2 + d]] for d in range(n)],
                            [rhs[dn.rhs_spec[2 + d]] for d in range(n)],
                            [out[dn.out_spec[2 + d]] for d in range(n)],
                            p["window_strides"], [lo for lo, _ in p["padding"]],
                            p["lhs_dilation"], p["rhs_dilation"])

    def bias_map(self, eqn: C.JaxprEqn, taps: np.ndarray, masks: list) -> np.ndarray:
        dn = eqn.params["dimension_numbers"]
        return bias_map(taps, masks, dn.rhs_spec, dn.out_spec)


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


CONV_AFFINE = ConvAffinePattern()


def _dot_dims(eqn):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    lhs_free = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb), lhs_free, rhs_free


@dataclasses.dataclass(frozen=True)
class DotAffinePattern:
    """Pattern: dot(x, W)·s + t  ->  dot(x, W ⊙ s) + broadcast_in_dim(t), s/t per rhs feature."""

    name: str = "dot_affine"
    root: str = "dot_general"

    def inspect_root(self, eqn: C.JaxprEqn) -> RootInfo | Refusal:
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
        layout = dot_layout(lhs.shape, rhs.shape, out.shape)
        if not (is_float(rhs.dtype) and is_float(out.dtype)):
            return Refusal(f"integer dot ({rhs.dtype} rhs, {out.dtype} output)", kind="not-float")
        if len(rhs_free) != 1:
            return Refusal(f"the rhs has {len(rhs_free)} free dimensions; one output-feature "
                           "dimension is needed to rescale", kind="root")
        return RootInfo(channel_axis=len(lb) + len(lhs_free), kernel_index=1,
                        kernel_axis=rhs_free[0], layout=layout,
                        in_channels=int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64)),
                        out_channels=int(rhs.shape[rhs_free[0]]), groups=1)

    def alternatives(self, eqn: C.JaxprEqn) -> list:
        """The weight as the *lhs* (``einsum("oi,bi->bo", W, x)``): its one free dimension
        is the output feature. Tried when the rhs reading folds nothing, and only for a weight
        known at transform time (an input on the lhs may as well be the activations)."""
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
        if len(lhs_free) != 1 or not (is_float(lhs.dtype) and is_float(out.dtype)) or \
                not all(isinstance(d, int) for d in lhs.shape):   # (a weight is not symbolic)
            return []
        return [RootInfo(channel_axis=len(lb), kernel_index=0, kernel_axis=lhs_free[0],
                         layout=dot_layout(lhs.shape, rhs.shape, out.shape, True),
                         in_channels=int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64)),
                         out_channels=int(lhs.shape[lhs_free[0]]), groups=1)]

    def explain_axis(self, eqn: C.JaxprEqn, axis: int) -> str:
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        return dot_axis_role(axis, len(lb), len(lhs_free))

    def input_feature_axis(self, eqn: C.JaxprEqn, act: int = 0) -> int | None:
        """The contracted (input-feature) axis of operand ``act``, if there is one."""
        contracting = _dot_dims(eqn)[act]
        return contracting[0] if len(contracting) == 1 else None

    def border_masks(self, eqn: C.JaxprEqn) -> None:
        """A dot reads every input feature at every output position: no bias map."""
        return None

    def input_channel(self, eqn: C.JaxprEqn, act: int = 0) -> tuple[int, int] | Refusal:
        """(feature axis of operand ``act``, the other operand's input-feature axis)."""
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        if lb:
            return Refusal("dot with batch dimensions", kind="root")
        if len(lc) != 1:
            return Refusal(f"dot contracting {len(lc)} dimensions", kind="root")
        return (lc[0], rc[0]) if act == 0 else (rc[0], lc[0])


DOT_AFFINE = DotAffinePattern()


@dataclasses.dataclass(frozen=True)
class ForwardAffinePattern:
    """Pattern: root(x·s + t, K)  ->  root(x, K ⊙_in s) + root(t, K), s/t per input feature."""

    name: str
    root: str


FORWARD: dict[str, ForwardAffinePattern] = {
    "conv_general_dilated": ForwardAffinePattern("affine_conv", "conv_general_dilated"),
    "dot_general": ForwardAffinePattern("affine_dot", "dot_general")}

PATTERNS: dict[str, ConvAffinePattern | DotAffinePattern] = {
    CONV_AFFINE.root: CONV_AFFINE, DOT_AFFINE.root: DOT_AFFINE}


