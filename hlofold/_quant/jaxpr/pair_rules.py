"""The per-primitive rules of a pair's path (:mod:`hlofold._quant.jaxpr.pairs`): how a positive
per-channel scale on an equation's input reaches its output — the channel axis it moves to,
or why the path stops there — one entry per primitive in :data:`RULES`; and the helpers the
pair reader and the stream reader (:mod:`hlofold._quant.jaxpr.rotate`) share.

A channel is an axis, or a tuple of axes (most significant first) where it is split over
several (attention's heads; :mod:`hlofold._base.channel_axes`).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops
from hlofold._ir.jaxpr.uses import index_uses
from hlofold._base.chain_rules import Refusal, is_float
from hlofold._base.channel_axes import (as_block, broadcast, each, one, permuted, reshaped,
                                        whole_block)
from hlofold._quant.core.pair_walk import through_body
from hlofold._fold.jaxpr.steps import resolve_operand

CALLS = ops.names(lambda o: o.call in ("jit", "custom"))
# the channels as they are: an identity on the values (a sharding constraint only says where
# they live), or a negation. (A rounding is no identity: ``pairs`` lets it pass with powers of
# two only; elsewhere a path stops there.)
_PASS = ops.names(lambda o: o.shape in ("copy", "constraint") or o.affine == "neg")
# a parameter leaf through these, each read once, is still that leaf
SHAPES = ops.names(lambda o: o.shape in ("reshape", "broadcast", "cast", "squeeze", "expand",
                                         "constraint"))
NOT_HOMOGENEOUS = ops.names(lambda o: o.homogeneous is False)
ROUNDING = ops.names(lambda o: o.rounding == "always")


@dataclasses.dataclass
class Ctx:
    """What a rule reads: the jaxpr's uses and producers, the parameter leaves, the
    biases a pair scales (filled as the path is read), a call body's literal inputs."""

    jaxpr: object
    uses: dict
    producer: dict
    leaves: dict                      # top-level leaf var -> index (empty in a body)
    biases: list
    literals: dict = dataclasses.field(default_factory=dict)   # a body's var -> value
    outputs: str = "a program output"   # what the jaxpr's outputs are, in the reasons


def varying_axis(producer, v, rank: int):
    """The one axis along which ``v`` (of rank ``rank``) varies, where it is a broadcast
    of values with one non-unit axis (``jnp`` broadcasting a bias or a norm's scale to the
    activations' shape); -1 where it varies along none; None otherwise."""
    mapping = list(range(rank))            # v's axes -> the first value's
    for _ in range(8):
        shape = v.aval.shape
        dims = [d for d, n in enumerate(shape) if n != 1]
        if len(dims) <= 1:
            return (mapping[dims[0]] if mapping[dims[0]] is not None else None) \
                if dims else -1
        p = producer.get(v)
        if p is None or p.primitive.name != "broadcast_in_dim":
            return None
        src, bd = p.invars[0], p.params["broadcast_dimensions"]
        if not isinstance(src, C.Var):
            return None
        mapping = [mapping[bd[i]] if src.aval.shape[i] == shape[bd[i]] else None
                   for i in range(src.aval.ndim)]
        v = src
    return None


def leaf_of(v, leaves, producer, uses):
    """The parameter leaf ``v`` is, through reshapes, broadcasts and casts each read once;
    None otherwise (a computed value, a literal)."""
    return leaf_with_offset(v, leaves, producer, uses, offsets=False)[0]


def leaf_with_offset(v, leaves, producer, uses, offsets: bool = True):
    """``(leaf, c)``: ``v`` is the parameter leaf, or (``offsets``) the leaf plus a literal
    scalar ``c`` (Gemma's ``1 + scale``), through reshapes, broadcasts and casts each read
    once; ``(None, 0.0)`` otherwise."""
    offset = None
    for _ in range(12 if offsets else 8):
        if not isinstance(v, C.Var):
            return None, 0.0
        if v in leaves:
            return v, offset or 0.0
        p = producer.get(v)
        if p is None or len(uses.get(v, [])) != 1:
            return None, 0.0
        if p.primitive.name in SHAPES:
            v = p.invars[0]
            continue
        lits = [a for a in p.invars if isinstance(a, C.Literal) and np.ndim(a.val) == 0]
        vs = [a for a in p.invars if isinstance(a, C.Var)]
        if not offsets or p.primitive.name != "add" or offset is not None or \
                len(lits) != 1 or len(vs) != 1:
            return None, 0.0
        offset, v = float(np.asarray(lits[0].val)), vs[0]
    return None, 0.0


def cast_leaf(ctx, v):
    """The parameter leaf ``v`` is, directly or through float-to-float converts (a float32
    weight cast to the bfloat16 the layer computes in) and sharding constraints each read
    once, or None."""
    for _ in range(4):
        if not isinstance(v, C.Var):
            return None
        if v in ctx.leaves:
            return v
        p = ctx.producer.get(v)
        if p is not None and p.primitive.name == "sharding_constraint" and \
                len(ctx.uses.get(v, [])) == 1:      # (the values as they are: a jit's
            v = p.invars[0]                         # in_shardings, inlined)
            continue
        if p is None or p.primitive.name != "convert_element_type" or \
                len(ctx.uses.get(v, [])) != 1 or \
                not jnp.issubdtype(p.params["new_dtype"], jnp.floating) or \
                not jnp.issubdtype(p.invars[0].aval.dtype, jnp.floating):
            return None
        v = p.invars[0]
    return None


def single_leaf(ctx, v, what: str):
    if len(ctx.uses.get(v, [])) != 1:
        return f"{what} is read {len(ctx.uses.get(v, []))} times (a shared weight)"
    return None


# ------------------------------------------------------------------ per-primitive rules

def _other(e, pos):
    return e.invars[1 - pos]


def is_zero(ctx, x) -> bool:
    """A literal zero (through casts and broadcasts; a call's body sees its operands)."""
    return literal_zero(x, ctx.producer, ctx.literals)


def literal_zero(x, producer: dict, literals=None) -> bool:
    """``x`` a literal zero through casts and broadcasts (``producer``: var -> its equation;
    ``literals``: vars known to hold a literal, a call's operands in its body)."""
    for _ in range(8):
        if isinstance(x, C.Literal):
            return bool(np.all(np.asarray(x.val) == 0))
        if literals and x in literals:
            return bool(np.all(np.asarray(literals[x]) == 0))
        p = producer.get(x)
        if p is None or ops.of(p.primitive.name).shape not in ("cast", "broadcast"):
            return False
        x = p.invars[0]
    return False


def _bias(ctx, e, pos, axis):
    """x ± b, b one value per channel: b is divided by the scale too — the leaves it is
    linear in (:func:`_additive`), or nothing for a literal zero."""
    if e.primitive.name == "sub" and pos == 1:
        return "a subtraction from the channels"
    b = _other(e, pos)
    if is_zero(ctx, b):
        return axis
    if isinstance(axis, tuple):
        return _bias_over_axes(ctx, e, b, axis)
    out = e.outvars[0].aval.shape
    shape = getattr(getattr(b, "aval", None), "shape", None)
    if shape is None or len(shape) != len(out) or shape[axis] != out[axis] or \
            varying_axis(ctx.producer, b, len(out)) != axis:
        return (f"{e.primitive.name} of a value that is not one per channel (a residual "
                f"add ties channels)")
    found = _additive(ctx, b, out[axis], 0)
    if isinstance(found, str):
        return f"{e.primitive.name} of {found}"
    for leaf, dim in found:
        ctx.biases.append((ctx.leaves[leaf], dim))
    return axis


def _bias_over_axes(ctx, e, b, axis):
    """x ± b with the channels over (heads, head_dim) and b a leaf with one value per
    channel (a multi-head projection's bias, reshaped or broadcast), read once."""
    why = f"{e.primitive.name} of a value while the channels are split over axes"
    out = e.outvars[0].aval.shape
    blk = as_block(axis, out)
    r = resolve_operand(b, out, blk, ctx.producer.get) if blk is not None else None
    if r is None or isinstance(r, Refusal) or not whole_block(r, blk) or \
            r.source not in ctx.leaves:
        return why
    v = b
    while v is not r.source:                    # (every value on the way read once)
        if len(ctx.uses.get(v, [])) != 1:
            return f"{e.primitive.name} of a per-channel value read elsewhere too"
        v = ctx.producer[v].invars[0]
    why = single_leaf(ctx, r.source, "a bias on the way")
    if why:
        return why
    dims = tuple(d for d, n in enumerate(r.source.aval.shape) if n != 1)
    ctx.biases.append((ctx.leaves[r.source], dims))
    return axis


def _additive(ctx, v, channels: int, depth: int):
    """The leaves a per-channel value is linear in (each scaled with the channels makes it
    scaled: ``β − μ·γ/√(σ²+ε)`` through ``β`` and ``μ``): ``[(leaf, its channel axis)]``, or
    what it is instead. Every value on the way is read once, each leaf nowhere else."""
    if is_zero(ctx, v):
        return []
    if v in ctx.leaves:
        why = single_leaf(ctx, v, "a bias on the way")
        dims = [d for d, n in enumerate(v.aval.shape) if n != 1]
        if why or len(dims) != 1 or v.aval.shape[dims[0]] != channels:
            return why or "a bias leaf that is not one value per channel"
        return [(v, dims[0])]
    p = ctx.producer.get(v)
    if p is None or depth > 16 or len(ctx.uses.get(v, [])) != 1:
        return "a per-channel value that is not computed from parameter leaves alone"
    name = p.primitive.name
    if name in SHAPES or name == "neg":
        return _additive(ctx, p.invars[0], channels, depth + 1)
    if name in ("add", "sub"):
        a = _additive(ctx, p.invars[0], channels, depth + 1)
        b = _additive(ctx, p.invars[1], channels, depth + 1)
        return a if isinstance(a, str) else b if isinstance(b, str) else a + b
    if name in ("mul", "div"):        # (a linear term times a factor left as it is)
        for k in ((0, 1) if name == "mul" else (0,)):
            got = _additive(ctx, p.invars[k], channels, depth + 1)
            if not isinstance(got, str):
                return got
    return f"a per-channel value computed by {name} (not linear in parameter leaves)"


def _product(ctx, e, pos, axis):
    """x·c, x/c: any factor that is not the scaled value commutes with the scale."""
    if e.primitive.name == "div" and pos == 1:
        return "a division by the channels"
    return axis


def _max(ctx, e, pos, axis):
    """max(x, 0): ReLU."""
    if is_zero(ctx, _other(e, pos)):
        return axis
    return "max with a value other than 0 (not a ReLU)"


def _reduce(ctx, e, pos, axis):
    axes = tuple(e.params["axes"])
    if any(a in axes for a in each(axis)):
        return f"{e.primitive.name} over the channels"
    return one(tuple(a - sum(r < a for r in axes) for a in each(axis)))


def _window(ctx, e, pos, axis):
    """Pooling (sum, max): a window of one along the channels."""
    p = e.params
    if isinstance(axis, tuple):
        return "pooling while the channels are split over axes"
    if p["window_dimensions"][axis] != 1 or p["window_strides"][axis] != 1 or \
            tuple(p["padding"][axis]) != (0, 0):
        return "pooling across channels"
    return axis


def _pad(ctx, e, pos, axis):
    if pos != 0 or not is_zero(ctx, e.invars[1]):
        return "padding with a value other than 0"
    if isinstance(axis, tuple):
        return "padding while the channels are split over axes"
    if tuple(e.params["padding_config"][axis]) != (0, 0, 0):
        return "padding along the channels"
    return axis


def _transpose(ctx, e, pos, axis):
    return permuted(e.params["permutation"], axis)


def _reshape(ctx, e, pos, axis):
    """A reshape that keeps the channels whole and in order: split over consecutive axes
    (heads) or merged back (:func:`hlofold._base.channel_axes.reshaped`)."""
    return reshaped(e.invars[0].aval.shape, e.outvars[0].aval.shape, axis)


def _broadcast(ctx, e, pos, axis):
    """A broadcast copies each channel along new axes: the channel axis moves; a new axis
    among the channel's repeats them (:func:`hlofold._base.channel_axes.broadcast`)."""
    return broadcast(e.params["broadcast_dimensions"], e.invars[0].aval.shape,
                     e.outvars[0].aval.shape, axis)


def call_rule(ctx, e, pos, axis):
    """A jit or custom-derivative call (ReLU is one): followed through its body
    (:func:`hlofold._quant.core.pair_walk.through_body`; ``ctx`` is the pair walk's view, read
    again over the body)."""
    body = C.call_body(e)[1]
    if body is None or len(e.outvars) != 1:
        return f"a {e.primitive.name} with several outputs"
    inner = body.jaxpr
    uses, producer = index_uses(inner)
    lits = {iv: (o.val if isinstance(o, C.Literal) else ctx.literals[o])
            for iv, o in zip(inner.invars, e.invars)
            if isinstance(o, C.Literal) or o in ctx.literals}
    sub = dataclasses.replace(ctx, jaxpr=inner, uses=uses, producer=producer, leaves={},
                              biases=[], literals=lits)
    return through_body(sub, inner.invars[pos], axis, e.primitive.name,
                        f"(inside {e.params.get('name', e.primitive.name)})")


def _cast(ctx, e, pos, axis):
    """A cast between float types keeps the channels; one to an integer type rounds."""
    if not (is_float(e.params["new_dtype"]) and is_float(e.invars[0].aval.dtype)):
        return f"convert_element_type to {np.dtype(e.params['new_dtype']).name} (not a float)"
    return axis


RULES = {"add": _bias, "sub": _bias, "mul": _product, "div": _product, "max": _max,
         "reduce_sum": _reduce, "reduce_max": _reduce, "reduce_window_sum": _window,
         "reduce_window_max": _window, "pad": _pad, "transpose": _transpose,
         "reshape": _reshape, "squeeze": _reshape, "expand_dims": _reshape,
         "broadcast_in_dim": _broadcast, "convert_element_type": _cast,
         **{p: (lambda ctx, e, pos, axis: axis) for p in _PASS}}
# the rules a channel repeated over an axis (``Mapped``) passes: it has no bias, no pooling
MAPPED = ops.names(lambda o: o.shape is not None or o.affine in ("mul", "div", "neg")
                   or o.rounding == "always")
