"""The jaxpr's chain steps: the rule tables of a chain after a root, read from equations.

* ``AFFINE_STEPS``: equations that update the running ``(s, t)`` of ``y·s + t``
  (add, sub, mul, div, neg by a scalar or a per-channel operand);
* ``PASS_STEPS``: equations the chain passes through while the channel axis stays
  identifiable (``convert_element_type`` between float types, unit-dim ``reshape``/
  ``squeeze``/``broadcast_in_dim``, ``transpose``, ``with_sharding_constraint``).

The rules themselves are the core's (:mod:`hlofold._base.chain_rules`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops
from hlofold._base.chain_rules import (DIVISOR, ChannelOperand, Refusal, is_float, pass_axis,
                                       resolve_channel_operand)


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


def resolve_operand(atom, out_shape, channel_axis: int,
                    producer: Callable[[Any], C.JaxprEqn | None]) -> ChannelOperand | Refusal:
    """:func:`resolve_channel_operand` on a jaxpr (``producer``: a variable's equation)."""
    def step_of(v):
        eqn = producer(v) if isinstance(v, C.Var) else None
        if eqn is None:
            return None
        prim, src = eqn.primitive.name, eqn.invars[0]
        if prim == "broadcast_in_dim":
            return prim, src, eqn.params["broadcast_dimensions"]
        if prim == "reshape" and eqn.params.get("dimensions") is None:
            return prim, src, None
        if prim == "squeeze":
            return prim, src, eqn.params["dimensions"]
        if prim == "convert_element_type" and is_float(src.aval.dtype) \
                and is_float(eqn.params["new_dtype"]):
            return "convert", src, eqn.params["new_dtype"]
        return None
    return resolve_channel_operand(atom, out_shape, channel_axis, step_of,
                                   lambda v: v.aval.shape)


# Affine steps: which operand position holds the chain value decides the kind.
_BINARY_KIND = {
    ("add", 0): "add", ("add", 1): "add",
    ("sub", 0): "sub", ("sub", 1): "rsub",
    ("mul", 0): "mul", ("mul", 1): "mul",
    ("div", 0): "div",
}
AFFINE_STEPS = ops.names(lambda o: o.affine is not None)
# the shape ops a chain passes (the channel axis through each: ``pass_step``)
PASS_STEPS = ops.names(lambda o: o.shape in ("cast", "reshape", "squeeze", "broadcast",
                                             "transpose", "constraint"))


def affine_step(eqn: C.JaxprEqn, pos: int, channel_axis: int,
                producer) -> AffineStep | Refusal:
    """Absorb ``eqn`` (whose operand ``pos`` is the chain value) into ``y·s + t``."""
    prim = eqn.primitive.name
    out = eqn.outvars[0].aval
    if not is_float(out.dtype):
        return Refusal(f"{prim} produces {out.dtype}, not a float", kind="not-float")
    if prim == "neg":
        return AffineStep(eqn, "neg", None)
    if len(eqn.invars) != 2:
        return Refusal(f"{prim} with {len(eqn.invars)} operands", kind="chain-end")
    kind = _BINARY_KIND.get((prim, pos))
    if kind is None:
        return Refusal(DIVISOR.after(f"{prim} "))
    other = eqn.invars[1 - pos]
    if tuple(eqn.invars[pos].aval.shape) != tuple(out.shape):
        return Refusal(f"{prim} broadcasts the conv value to a larger shape {tuple(out.shape)}")
    op = resolve_operand(other, tuple(out.shape), channel_axis, producer)
    if isinstance(op, Refusal):
        return Refusal(op.reason.after(f"{prim}: "), op.axis)
    return AffineStep(eqn, kind, op)


def pass_step(eqn: C.JaxprEqn, channel_axis: int) -> int | Refusal:
    """New channel axis after passing through ``eqn`` (a jaxpr equation), or why the chain
    cannot pass (:func:`pass_axis`)."""
    prim = eqn.primitive.name
    src = eqn.invars[0].aval
    out = eqn.outvars[0].aval
    if prim not in PASS_STEPS:
        return Refusal(f"chain ends at {prim}", kind="chain-end")
    if prim == "convert_element_type":
        if not (is_float(src.dtype) and is_float(out.dtype)):
            return Refusal(f"cast {src.dtype} -> {out.dtype} is not between float types",
                           kind="not-float")
        return channel_axis
    if prim == "reshape" and eqn.params.get("dimensions") is not None:
        return Refusal("reshape with a dimension permutation", kind="chain-end")
    return pass_axis(prim, tuple(src.shape), tuple(out.shape), channel_axis,
                     perm=eqn.params.get("permutation"),
                     bdims=eqn.params.get("broadcast_dimensions"),
                     dims=[int(d) for d in eqn.params.get("dimensions") or ()])


def place_target(target, op):
    """``target`` (a scalar or one value per channel) in the shape of ``op.source``."""
    tv = np.asarray(target, np.float64)
    shape = tuple(op.source.aval.shape) if isinstance(op.source, C.Var) else ()
    if tv.ndim == 0:
        return np.broadcast_to(tv, shape)
    if op.source_axis is None:
        return tv.reshape(()) if np.all(tv == tv.flat[0]) and tv.size else None
    if op.block is not None:     # (heads, head_dim): the source holds its extents of it
        full = tv.reshape(op.block_dims)
        part = full[tuple(slice(0, b) for b in op.block)]
        return part.reshape(shape) if np.array_equal(np.broadcast_to(part, full.shape),
                                                     full) else None
    place = [1] * len(shape)
    place[op.source_axis] = tv.size
    return np.broadcast_to(tv.reshape(place), shape)
