"""The jaxpr's root patterns: the equations a fold starts from.

A *pattern* is a named object with a one-line ``Pattern:`` docstring, registered by the
primitive at its root (``PATTERNS[primitive_name]``). It reads its root equation into a
:class:`~hlofold._fold.core.patterns.RootInfo` (which output axis carries the features and which
kernel axis produces them); the geometry is the core's.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hlofold import _compat as C
from hlofold._base.chain_rules import Refusal, is_float
from hlofold._fold.core.patterns import (RootInfo, bias_map, block_of, border_masks, conv_axis_role,
                                         conv_layout, dot_axis_role, dot_layout)


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

    def output_dims(self, eqn: C.JaxprEqn, kernel_index: int) -> int:
        """A convolution kernel has one output-feature dimension."""
        return 1

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
        if len(rhs_free) != 1 and (not rhs_free or len(lhs_free) == 1):
            # (one free lhs dimension: the weight is the lhs, ``alternatives``)
            return Refusal(f"the rhs has {len(rhs_free)} free dimensions; one output-feature "
                           "dimension is needed to rescale", kind="root")
        # several free dimensions on both sides (x (b, t, d) · W (d, heads, head_dim), a
        # multi-head projection): the output features are the block of them (contiguous in
        # the kernel: a Block; else the rhs's first only); a forward scale (along the
        # contracted axis) needs none of them
        block = block_of(rhs.shape, rhs_free, len(lb) + len(lhs_free))
        if block is not None:
            return RootInfo(channel_axis=block[0], kernel_index=1, kernel_axis=block[1],
                            layout=layout, out_channels=block[0].size, groups=1,
                            in_channels=int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64)))
        return RootInfo(channel_axis=len(lb) + len(lhs_free), kernel_index=1,
                        kernel_axis=rhs_free[0], layout=layout,
                        in_channels=int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64)),
                        out_channels=int(rhs.shape[rhs_free[0]]), groups=1)

    def alternatives(self, eqn: C.JaxprEqn) -> list:
        """The weight as the *lhs* (``einsum("oi,bi->bo", W, x)``; a multi-head weight,
        Gemma's ``einsum("BTD,SNDH->SBTNH")``): its free dimensions are the output features
        (their block where contiguous in it, else the first). Tried when the rhs reading folds
        nothing or reads an activation as its kernel, and only for a weight known at
        transform time (an input on the lhs may as well be the activations)."""
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
        if not lhs_free or not (is_float(lhs.dtype) and is_float(out.dtype)) or \
                not all(isinstance(d, int) for d in lhs.shape):   # (a weight is not symbolic)
            return []
        layout = dot_layout(lhs.shape, rhs.shape, out.shape, True)
        cin = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
        block = block_of(lhs.shape, lhs_free, len(lb))
        if block is not None:
            return [RootInfo(channel_axis=block[0], kernel_index=0, kernel_axis=block[1],
                             layout=layout, in_channels=cin, out_channels=block[0].size,
                             groups=1)]
        return [RootInfo(channel_axis=len(lb), kernel_index=0, kernel_axis=lhs_free[0],
                         layout=layout, in_channels=cin,
                         out_channels=int(lhs.shape[lhs_free[0]]), groups=1)]

    def explain_axis(self, eqn: C.JaxprEqn, axis: int) -> str:
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        return dot_axis_role(axis, len(lb), len(lhs_free))

    def output_dims(self, eqn: C.JaxprEqn, kernel_index: int) -> int:
        """How many output (free) dimensions the weight operand has."""
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        return len(rhs_free if kernel_index == 1 else lhs_free)

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


