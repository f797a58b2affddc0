"""Rewrite patterns and the rules that walk a per-channel affine chain.

A *pattern* is a named object with a one-line ``Pattern:`` docstring, registered by the
primitive at its root (``PATTERNS[primitive_name]``). It knows, for its root equation, which
output axis carries the features and which kernel axis produces them. The chain that follows
the root is walked with two small rule tables, both keyed by primitive name:

* ``AFFINE_STEPS``: ops that update the running ``(s, t)`` of ``y·s + t``
  (add, sub, mul, div, neg by a scalar or a per-channel operand);
* ``PASS_STEPS``: ops the chain passes through while the channel axis stays identifiable
  (``convert_element_type`` between float types, unit-dim ``reshape``/``squeeze``/
  ``broadcast_in_dim``, ``transpose``, ``with_sharding_constraint``).

Every failed match is reported as a reason string (``Refusal``), never an exception.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from . import _compat as C


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a match failed, in words a user can act on (``axis``: the offending axis, if any)."""

    reason: str
    axis: int | None = None

    def __str__(self) -> str:
        return self.reason


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
    return (f"{_spec_letters(tuple(lhs_spec), 'N', 'C')},"
            f"{_spec_letters(tuple(rhs_spec), 'O', 'I')}->{_spec_letters(tuple(out_spec), 'N', 'C')}")


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


def _is_float(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


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
        if not (_is_float(rhs.dtype) and _is_float(out.dtype)):
            return Refusal(f"integer convolution ({rhs.dtype} kernel, {out.dtype} output): "
                           "folding a scale into an integer kernel is not exact")
        if rhs.shape[rhs_spec[0]] != out.shape[out_spec[1]]:
            return Refusal("kernel output-feature size differs from the output feature size")
        # batch_group_count > 1 is fine: every output feature still comes from exactly one
        # slice of the kernel along its output-feature dimension (checked numerically in tests).
        return info


    def explain_axis(self, eqn: C.JaxprEqn, axis: int) -> str:
        out_spec = eqn.params["dimension_numbers"].out_spec
        if axis == out_spec[0]:
            return "the batch axis"
        return "a spatial axis"

    def lhs_channel_axis(self, eqn: C.JaxprEqn) -> int | None:
        return eqn.params["dimension_numbers"].lhs_spec[1]

    def input_channel(self, eqn: C.JaxprEqn) -> tuple[int, int] | Refusal:
        """(lhs feature axis, kernel input-feature axis) for folding an affine *before* the
        conv; refused where the padded or dilated zeros would not see the shift."""
        p = eqn.params
        dn = p["dimension_numbers"]
        if any(lo or hi for lo, hi in p["padding"]):
            return Refusal(f"padding {tuple(map(tuple, p['padding']))}: the padded border "
                           "would not see the shift t (only VALID/zero padding is exact)")
        if any(d != 1 for d in p["lhs_dilation"]):
            return Refusal("lhs dilation (transposed conv): the inserted zeros would not see t")
        if p.get("batch_group_count", 1) != 1:
            return Refusal("batch_group_count > 1")
        return dn.lhs_spec[1], dn.rhs_spec[1]


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
        if not (_is_float(rhs.dtype) and _is_float(out.dtype)):
            return Refusal(f"integer dot ({rhs.dtype} rhs, {out.dtype} output)")
        if len(rhs_free) != 1:
            return Refusal(f"the rhs has {len(rhs_free)} free dimensions; one output-feature "
                           "dimension is needed to rescale")
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
        if len(lhs_free) != 1 or not (_is_float(lhs.dtype) and _is_float(out.dtype)) or \
                not all(isinstance(d, int) for d in lhs.shape):   # (a weight is not symbolic)
            return []
        return [RootInfo(channel_axis=len(lb), kernel_index=0, kernel_axis=lhs_free[0],
                         layout=dot_layout(lhs.shape, rhs.shape, out.shape, True),
                         in_channels=int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64)),
                         out_channels=int(lhs.shape[lhs_free[0]]), groups=1)]

    def explain_axis(self, eqn: C.JaxprEqn, axis: int) -> str:
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        if axis < len(lb):
            return "a batch dimension of the dot"
        if axis < len(lb) + len(lhs_free):
            return "a free dimension of the lhs (the activations)"
        return "a free dimension of the rhs"

    def lhs_channel_axis(self, eqn: C.JaxprEqn) -> int | None:
        lc = _dot_dims(eqn)[0]
        return lc[0] if len(lc) == 1 else None

    def input_channel(self, eqn: C.JaxprEqn) -> tuple[int, int] | Refusal:
        lc, rc, lb, rb, lhs_free, rhs_free = _dot_dims(eqn)
        if lb:
            return Refusal("dot with batch dimensions")
        if len(lc) != 1:
            return Refusal(f"dot contracting {len(lc)} dimensions")
        return lc[0], rc[0]


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


# --------------------------------------------------------------------------- chain steps


@dataclasses.dataclass(frozen=True)
class AffineStep:
    """One absorbed op: ``kind`` in {add, sub, rsub, mul, div, neg}; ``operand`` the resolved
    per-channel operand (None for neg)."""

    eqn: C.JaxprEqn
    kind: str
    operand: "ChannelOperand | None"


@dataclasses.dataclass(frozen=True)
class PassStep:
    """One op the chain passes through (shape op or float cast); replayed on the new conv."""

    eqn: C.JaxprEqn


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

    @property
    def size(self) -> int:
        if self.source_axis is None:
            return 1
        return int(self.source.aval.shape[self.source_axis])


def _axis_name(axis: int) -> str:
    return f"axis {axis}"


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
    before = int(np.prod(src_shape[:axis], dtype=np.int64))
    acc = 1
    for j, d in enumerate(out_shape):
        if acc == before and d == c:
            return j
        acc *= d
        if acc > before:
            return None
    return None


def resolve_operand(atom, out_shape, channel_axis: int,
                    producer: Callable[[Any], C.JaxprEqn | None]) -> ChannelOperand | Refusal:
    """Decide whether ``atom`` (an operand of a binary op whose other input is the chain
    value of shape ``out_shape``) varies only along ``channel_axis``.

    Decided from shapes, walking back through ``broadcast_in_dim``, unit-dim ``reshape`` and
    float ``convert_element_type`` to the smallest source: never from element counts.
    """
    rank = len(out_shape)
    shape = tuple(atom.aval.shape)
    if len(shape) == 0:
        return ChannelOperand(atom, None, ())
    if len(shape) != rank:
        return Refusal(f"operand of rank {len(shape)} against a value of rank {rank}")
    # axis_map: axis of the current value -> axis of the chain value (None: unit, unmapped)
    axis_map: dict[int, int | None] = {i: i for i in range(rank)}
    cur = atom
    casts: list[Any] = []
    first_bad: int | None = None
    found: ChannelOperand | None = None
    for _ in range(64):
        cshape = tuple(cur.aval.shape)
        bad = [i for i, d in enumerate(cshape) if d != 1 and axis_map.get(i) != channel_axis]
        eqn = producer(cur) if isinstance(cur, C.Var) else None
        if not bad:
            src_axis = next((i for i, d in enumerate(cshape)
                             if d != 1 and axis_map.get(i) == channel_axis), None)
            found = ChannelOperand(cur, src_axis, tuple(casts))
            # keep walking through shape-only ops to the smallest source (e.g. the (C,)
            # vector behind a (1, 1, 1, C) broadcast), so nothing is re-broadcast
            if eqn is None or eqn.primitive.name not in ("broadcast_in_dim", "reshape",
                                                          "squeeze"):
                return found
        else:
            # the deepest source seen so far is the most telling: report its axis
            first_bad = axis_map.get(bad[0]) if axis_map.get(bad[0]) is not None else first_bad
        if eqn is None:
            break
        prim = eqn.primitive.name
        if prim == "broadcast_in_dim":
            src = eqn.invars[0]
            bdims = eqn.params["broadcast_dimensions"]
            axis_map = {i: axis_map.get(int(b)) for i, b in enumerate(bdims)}
            cur = src
        elif prim == "reshape" and eqn.params.get("dimensions") is None:
            src = eqn.invars[0]
            m = unit_reshape_map(tuple(src.aval.shape), cshape)
            if m is None:
                break
            axis_map = {i: axis_map.get(m[i]) if i in m else None
                        for i in range(len(src.aval.shape))}
            cur = src
        elif prim == "squeeze":
            src = eqn.invars[0]
            dims = set(int(d) for d in eqn.params["dimensions"])
            kept = [i for i in range(len(src.aval.shape)) if i not in dims]
            axis_map = {i: (axis_map.get(kept.index(i)) if i in kept else None)
                        for i in range(len(src.aval.shape))}
            cur = src
        elif prim == "convert_element_type" and _is_float(eqn.invars[0].aval.dtype) \
                and _is_float(eqn.params["new_dtype"]):
            casts.insert(0, eqn.params["new_dtype"])
            cur = eqn.invars[0]
        else:
            break
    if found is not None:
        return found
    same = " (same size as the channels: matched by axis, not size)" if \
        first_bad is not None and out_shape[first_bad] == out_shape[channel_axis] else ""
    return Refusal(
        f"operand varies along {_axis_name(first_bad)} (size {out_shape[first_bad]}), "
        f"not only along the output-feature {_axis_name(channel_axis)}{same}", first_bad)


# Affine steps: which operand position holds the chain value decides the kind.
_BINARY_KIND = {
    ("add", 0): "add", ("add", 1): "add",
    ("sub", 0): "sub", ("sub", 1): "rsub",
    ("mul", 0): "mul", ("mul", 1): "mul",
    ("div", 0): "div",
}
AFFINE_STEPS = frozenset({"add", "sub", "mul", "div", "neg"})
PASS_STEPS = frozenset({"convert_element_type", "reshape", "squeeze", "broadcast_in_dim",
                        "transpose", "sharding_constraint"})


def affine_step(eqn: C.JaxprEqn, pos: int, channel_axis: int,
                producer) -> AffineStep | Refusal:
    """Absorb ``eqn`` (whose operand ``pos`` is the chain value) into ``y·s + t``."""
    prim = eqn.primitive.name
    out = eqn.outvars[0].aval
    if not _is_float(out.dtype):
        return Refusal(f"{prim} produces {out.dtype}, not a float")
    if prim == "neg":
        return AffineStep(eqn, "neg", None)
    if len(eqn.invars) != 2:
        return Refusal(f"{prim} with {len(eqn.invars)} operands")
    kind = _BINARY_KIND.get((prim, pos))
    if kind is None:
        return Refusal(f"{prim} with the conv value as divisor is not affine")
    other = eqn.invars[1 - pos]
    if tuple(eqn.invars[pos].aval.shape) != tuple(out.shape):
        return Refusal(f"{prim} broadcasts the conv value to a larger shape {tuple(out.shape)}")
    op = resolve_operand(other, tuple(out.shape), channel_axis, producer)
    if isinstance(op, Refusal):
        return Refusal(f"{prim}: {op.reason}", op.axis)
    return AffineStep(eqn, kind, op)


def pass_axis(kind: str, src_shape, out_shape, axis: int, *, floats: bool = True,
              perm=None, bdims=None, dims=None) -> int | Refusal:
    """New channel axis after a shape op or cast, or why the chain cannot pass it; one rule
    for both IR adapters (``kind``: convert, reshape, squeeze, broadcast_in_dim, transpose,
    sharding_constraint; ``floats``: a convert is between float types)."""
    if kind == "convert":
        return axis if floats else Refusal("cast between a float and a non-float type")
    if kind == "sharding_constraint":     # replayed on the folded conv's output, same shape
        return axis
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
    return Refusal(f"chain ends at {kind}")


def pass_step(eqn: C.JaxprEqn, channel_axis: int) -> int | Refusal:
    """New channel axis after passing through ``eqn`` (a jaxpr equation), or why the chain
    cannot pass (:func:`pass_axis`)."""
    prim = eqn.primitive.name
    src = eqn.invars[0].aval
    out = eqn.outvars[0].aval
    if prim not in PASS_STEPS:
        return Refusal(f"chain ends at {prim}")
    if prim == "convert_element_type":
        if not (_is_float(src.dtype) and _is_float(out.dtype)):
            return Refusal(f"cast {src.dtype} -> {out.dtype} is not between float types")
        return channel_axis
    if prim == "reshape" and eqn.params.get("dimensions") is not None:
        return Refusal("reshape with a dimension permutation")
    return pass_axis(prim, tuple(src.shape), tuple(out.shape), channel_axis,
                     perm=eqn.params.get("permutation"),
                     bdims=eqn.params.get("broadcast_dimensions"),
                     dims=[int(d) for d in eqn.params.get("dimensions") or ()])
