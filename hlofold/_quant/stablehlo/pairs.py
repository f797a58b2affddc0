"""Pairs for cross-layer equalization (:mod:`hlofold._quant.core.equalize`) read from StableHLO:
the twin of ``_quant.jaxpr.pairs`` for a function whose weights are constants (bound with
``params=``, or constants of the module; the fold's kernels and biases are constants too).

A pair starts at a ``convolution`` or ``dot_general`` whose kernel is a constant (directly or
through a ``transpose``: PyTorch's Linear) and follows its output channel, op by op, to the
next convolutions or dots that read it as their activations, with constant kernels too.
Each op on the way must commute with a positive per-channel scale: ``pair_rules.RULES`` has one
entry per op (the channel axis it moves to, or why the pair stops there), with the words of
the jaxpr rules. Every value on the way is read once (a residual add would see the scaled
channels), and every constant scaled is read by the pair alone. Channels split over several
axes (attention's heads: a reshape, transposes, a batch axis of ``probs @ v``, merged back)
are followed as on the jaxpr path (:mod:`hlofold._base.channel_axes`).
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from hlofold import _compat as C
from hlofold._base.chain_rules import Refusal
from hlofold._base.channel_axes import (REPEATED, Mapped, each, one, read_by_kernel, settled,
                                        through_dot)
from hlofold._quant.core.equalize import Pair, Second, exact_in, stops_here
from hlofold._ir.stablehlo import ops
from hlofold._ir.stablehlo.build import GUARD, STACK, marked
from hlofold._fold.stablehlo.forward import input_channel
from hlofold._ir.stablehlo.ir import (attr_dims, elem_type, float_dtype, location, op_name,
                                      owner_op, shape_of)
from .pair_rules import MAPPED, NOT_HOMOGENEOUS, ROUNDING, RULES, Ctx, leaky, uses, weight
from hlofold._fold.stablehlo.patterns import dot_dims, root_info

ir, stablehlo, _ = C.mlir()

ROOTS = ops.names(lambda o: o.layer is not None)


@dataclasses.dataclass
class Found:
    """A pair, the op it starts at, and the value its second layers read (its channel axis):
    what calibration measures for smoothing. A norm site's start is the value itself (no
    op: the smoothing scale goes into a multiply put there)."""

    pair: Pair
    op: object
    end: object = None
    end_axis: int = 0
    low: bool = False          # a value between the layers is of a low-precision float


@dataclasses.dataclass
class Refused:
    key: str | None
    op: object
    reason: str



def _second_over_axes(ctx, op, pos, axis):
    """A dot reading channels split over axes, contracting exactly those (an output
    projection's (heads, head_dim, d) kernel): a second layer, its input rows over them."""
    why = f"the next {op_name(op)} reads the channels split over axes"
    if op_name(op) != "stablehlo.dot_general":
        return why
    k = op.operands[1 - pos]
    lb, lc, rb, rc = dot_dims(op)
    got = read_by_kernel((lc, rc), (lb, rb), len(shape_of(k)), pos, axis)
    if got is None:
        return why
    w = weight(k, op)
    if w is None:
        return f"the next {op_name(op)}'s kernel is not a constant read once"
    return Second(ctx.key(w), one(tuple(w.axes[a] for a in each(got[0]))), w.axes[got[1]],
                  channels=axis.positions() if isinstance(axis, Mapped) else None)


def second_layer(ctx, op, pos, axis):
    if isinstance(axis, Mapped):      # (a repeat the layer contracts; else copies it keeps)
        got, plain = _second_over_axes(ctx, op, pos, axis), settled(axis)
        return second_layer(ctx, op, pos, plain) if isinstance(got, str) and \
            not isinstance(plain, Mapped) else got
    if isinstance(axis, tuple):
        return _second_over_axes(ctx, op, pos, axis)
    ch = input_channel(op, pos) if pos == 0 or op_name(op) != "stablehlo.convolution" else \
        Refusal("a convolution reading the channels as its kernel")
    if isinstance(ch, Refusal):
        return f"the next {op_name(op)}: {ch.reason}"
    act_axis, in_axis = ch
    if act_axis != axis:
        return f"the next {op_name(op)} does not contract the channel axis"
    k = op.operands[1 - pos]
    w = weight(k, op)
    if w is None:
        return f"the next {op_name(op)}'s kernel is not a constant read once"
    info = root_info(op) if pos == 0 else None
    if pos == 0 and not isinstance(info, tuple):
        return f"the next {op_name(op)}'s kernel is not read as a layer's"
    free = [a for a in range(len(shape_of(k))) if a != in_axis]
    if pos == 1 and len(free) != 1:
        return f"the next {op_name(op)}'s kernel (its lhs) has {len(free)} free dimensions"
    # (a multi-head kernel, (d, heads, head_dim): its input rows are what is scaled; any of
    # its output axes serves to read them, as on the jaxpr path)
    out = (info[2] if isinstance(info[2], int) else info[2].axes[0]) if pos == 0 else free[0]
    groups = ir.IntegerAttr(op.attributes["feature_group_count"]).value \
        if "feature_group_count" in op.attributes else 1
    return Second(ctx.key(w), w.axes[in_axis], w.axes[out], int(groups))


def _through_dot(op, pos, axis):
    """A ``dot_general`` of two activations that contracts none of the channel axes
    (attention's ``probs @ v``, heads a batch axis): linear in each channel, which moves to
    its output position; else None."""
    if op_name(op) != "stablehlo.dot_general" or _constant_behind(op.operands[1 - pos]):
        return None
    lb, lc, rb, rc = dot_dims(op)
    return through_dot([len(shape_of(o)) for o in op.operands], (lc, rc), (lb, rb), pos, axis)


def _follow(ctx, v, axis: int):
    """From the first layer's output ``v`` (channel ``axis``) to the layers that read it:
    ``([Second], the value they read, its channel axis, whether a value on the way is of a
    low-precision float)``, or why not."""
    low = False
    for _ in range(10_000):
        low = low or exact_in(float_dtype(elem_type(v)) or np.float32)
        u = uses(v)
        if any(op_name(o) == "func.return" for o, _ in u):
            return "its output is a program output before another layer reads it"
        if len(u) == 3 and (lk := leaky(u)) is not None:
            v = lk
            continue
        if len(u) > 1:
            seconds = [second_layer(ctx, o, p, axis) if op_name(o) in ROOTS else "x"
                       for o, p in u]
            if all(not isinstance(x, str) for x in seconds):
                return seconds, v, axis, low
            return (f"its output is read {len(u)} times, not only by layers (a residual or "
                    f"another reader would see the scaled channels)")
        if not u:
            return "its output is not read"
        op, pos = u[0]
        name = op_name(op)
        if name in ROOTS:
            got = second_layer(ctx, op, pos, axis)
            if not isinstance(got, str):
                return [got], v, axis, low
            through = _through_dot(op, pos, axis)
            if through is None:
                return got
            v, axis = op.results[0], through
            continue
        if name in ROUNDING:     # (it rounds: only powers of two pass exactly)
            low, v = True, op.results[0]
            continue
        rule = RULES.get(name)
        if isinstance(axis, Mapped) and name not in MAPPED:
            axis = settled(axis)
            if isinstance(axis, Mapped):
                return REPEATED.format(op=name)
        if rule is None:
            return stops_here(name, name in NOT_HOMOGENEOUS, "on the way")
        if len(op.results) != 1:
            return f"{name} with several results"
        got = rule(ctx, op, pos, axis)
        if isinstance(got, str):
            return got
        v, axis = op.results[0], got
    return "the path is too long"


def layer_start(op):
    """``(Weight, output channel axis, kernel output axis)`` of a layer whose kernel is a
    constant read once (a multi-head kernel's: tuples of axes); a reason for a shared one;
    None for no layer."""
    info = root_info(op)
    if not isinstance(info, tuple) or op_name(op) not in ROOTS:
        return None
    w = weight(op.operands[info[1]], op)
    if w is None:           # a constant read elsewhere too; else no layer (q @ kᵀ)
        return "its kernel is a constant read elsewhere too (a shared weight)" if \
            _constant_behind(op.operands[info[1]]) else None
    if not isinstance(info[2], int):    # a multi-head kernel: channels over a Block
        return w, tuple(info[0].axes), tuple(w.axes[a] for a in info[2].axes)
    return w, info[0], w.axes[info[2]]


def _per_token(v, axis: int) -> bool:
    """Whether ``v`` is the same along ``axis`` (a norm's ``rsqrt`` per token, broadcast)."""
    op = owner_op(v)
    if op is None or op_name(op) != "stablehlo.broadcast_in_dim":
        return False
    dims = attr_dims(op, "broadcast_dimensions")
    return axis not in dims or shape_of(op.operands[0])[dims.index(axis)] == 1


def _constant_behind(v) -> bool:
    """Whether ``v`` is a constant, through transposes and converts."""
    for _ in range(8):
        op = owner_op(v)
        if op is None or ops.of(op_name(op)).shape not in ("transpose", "cast"):
            return op is not None and op_name(op) == "stablehlo.constant"
        v = op.operands[0]
    return False


def find_pairs(func) -> tuple[list[Found], list[Refused], dict]:
    """Every pair in ``func``'s body (top level), the starts refused, and the weights the
    pairs name (key -> :class:`Weight`). Second layers claimed by an earlier pair are not
    paired again."""
    ctx = Ctx({}, {}, [])
    found, refused, claimed = [], [], set()
    for op in func.regions[0].blocks[0].operations:
        start = layer_start(op) if op_name(op) in ROOTS else None
        if start is None:
            continue
        if isinstance(start, str):
            refused.append(Refused(None, op, start))
            continue
        w, axis, out_axis = start
        ctx.biases = []
        got = _follow(ctx, op.results[0], axis)
        k1 = ctx.key(w)
        if isinstance(got, str):
            refused.append(Refused(k1, op, got))
            continue
        seconds, end, end_axis, low = got
        if any(s.key in claimed for s in seconds):
            continue
        claimed.update(s.key for s in seconds)
        found.append(Found(Pair(k1, out_axis, seconds, list(ctx.biases)), op, end, end_axis,
                           low))
    return found, refused, ctx.weights


def norm_sites(func, weights: dict, taken: set) -> list[Found]:
    """Values a norm computes (a ``multiply`` by a value per token: after the fold, ``x·r``
    with γ moved forward into the layers) read by layers alone, along one channel axis, with
    constant kernels read once (keys not in ``taken``): smoothing puts ``·(1/s)`` there. Each site's start
    key is ``"norm:<n>"`` (no weight yet: its values start as ones)."""
    ctx = Ctx(weights, {w.const: k for k, w in weights.items()}, [])
    out = []
    for op in func.regions[0].blocks[0].operations:
        if op_name(op) != "stablehlo.multiply":
            continue
        v = op.results[0]
        u = uses(v)
        while len(u) == 1 and op_name(u[0][0]) == "sdy.sharding_constraint":
            v = u[0][0].results[0]          # (the layers read it where it is constrained)
            u = uses(v)
        if not u or any(op_name(o) not in ROOTS or o.parent != func for o, _ in u):
            continue
        o0, p0 = u[0]
        ch = input_channel(o0, p0) if p0 == 0 or op_name(o0) != "stablehlo.convolution" \
            else None
        if ch is None or isinstance(ch, Refusal):
            continue
        if not any(_per_token(x, ch[0]) for x in op.operands):
            continue                  # (a product of activations, a gate: no norm)
        seconds = [second_layer(ctx, o, p, ch[0]) for o, p in u]
        if any(isinstance(x, str) or x.key in taken for x in seconds):
            continue
        taken.update(x.key for x in seconds)
        out.append(Found(Pair(f"norm:{len(out)}", 0, seconds), op, v, ch[0],
                         exact_in(float_dtype(elem_type(v)) or np.float32)))
    return out


def layer(op) -> str:
    """The layer ``op`` belongs to, for people: its name stack without the op's own name
    (``Net/Conv_0``: Flax's module path, a Keras/TF/torch_xla layer), else the op's name."""
    name = location(op)[2] or ""
    parts = [p for p in name.split("/") if p and not p.startswith(("jit(", "pjit"))]
    if parts and parts[-1].split("[")[0] in (op_name(op).split(".")[-1],
                                             "conv_general_dilated", "dot_general"):
        parts = parts[:-1]
    return "/".join(parts) or op_name(op)


def where(op) -> str:
    file, line, _ = location(op)
    return f"{layer(op)} ({os.path.basename(file)}:{line})" if file else layer(op)


LOOP_LAYERS = ("{n} convolution/dot op(s) inside this loop are not paired: equalization and "
               "smoothing read the layers of a counted loop over known stacks (a scan over "
               "stacked weights, each layer with its own scales), which this loop is not")


NESTED_LAYERS = ("{n} convolution/dot op(s) inside this {what} are not paired: pairs are read "
                 "at a function's top level and in the layers of counted loops over known "
                 "stacks")


def loop_layers(func) -> list:
    """Each top-level op of ``func`` holding convolutions or dots in its regions (a
    ``while``, ``case``, ``sdy.manual_computation``; nested regions too) but a loop whose
    layers were paired: ``(the op, how many)``, to be reported as not paired."""
    out = []
    for op in func.regions[0].blocks[0].operations:
        if not len(op.regions) or marked(op, GUARD) or \
                (op_name(op) == "stablehlo.while" and marked(op, STACK)):
            continue     # (a loop whose layers were paired: .loop_pairs; a fold's guard)
        n, todo = 0, [op]
        while todo:
            for region in todo.pop().regions:
                for block in region.blocks:
                    for inner in block.operations:
                        n += op_name(inner) in ROOTS
                        todo.append(inner)
        if n:
            out.append((op, n))
    return out
