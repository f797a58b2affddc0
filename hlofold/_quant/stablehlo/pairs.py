"""Pairs for cross-layer equalization (:mod:`hlofold._quant.core.equalize`) read from StableHLO,
for a function whose weights are constants (bound with ``params=``, or constants of the
module; the fold's kernels and biases are constants too).

The walk is :mod:`hlofold._quant.core.pair_walk`'s, as on a jaxpr; this module reads a
function for it (:class:`Path`): a pair starts at a ``convolution`` or ``dot_general`` whose
kernel is a constant read once (directly or through a ``transpose``: PyTorch's Linear) and
ends at the next convolutions or dots that read it as their activations, with constant
kernels too. How the channels move through each op on the way is
:data:`~.pair_rules.RULES`' (one entry per op, with the words of the jaxpr rules). The norm
sites of smoothing (:func:`norm_sites`) and the layers left in loops are read here too.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from hlofold import _compat as C
from hlofold._base.chain_rules import Refusal
from hlofold._base.channel_axes import Mapped, each, one, read_by_kernel, through_dot
from hlofold._fold.stablehlo.forward import input_channel
from hlofold._fold.core.patterns import RootInfo
from hlofold._fold.stablehlo.patterns import dot_dims, root_info
from hlofold._ir.stablehlo import ops
from hlofold._ir.stablehlo.build import GUARD, STACK, marked
from hlofold._ir.stablehlo.ir import (attr_dims, elem_type, float_dtype, location, op_name,
                                      owner_op, shape_of)
from hlofold._quant.core import pair_walk
from hlofold._quant.core.equalize import Pair, Second, exact_in
from hlofold._quant.core.pair_walk import Found, Refused, Start
from .pair_rules import MAPPED, NOT_HOMOGENEOUS, ROUNDING, RULES, Ctx, leaky, uses, weight

ir, stablehlo, _ = C.mlir()

ROOTS = ops.names(lambda o: o.layer is not None)


@dataclasses.dataclass
class Path(Ctx):
    """A function read for the pair walk (:class:`hlofold._quant.core.pair_walk.PathIR`);
    the rules of :mod:`.pair_rules` read it as their :class:`~.pair_rules.Ctx`."""

    outputs: str = "a program output"

    def readers(self, v):
        return [(None, -1) if op_name(o) == "func.return" else (o, p) for o, p in uses(v)]

    def name(self, op):
        return op_name(op)

    def result(self, op):
        return op.results[0]

    def low(self, v):
        return exact_in(float_dtype(elem_type(v)) or np.float32)

    def leaky(self, three):
        return None if any(o is None for o, _ in three) else leaky(three)

    def is_layer(self, op):
        return op_name(op) in ROOTS

    def rounds(self, op):
        return op_name(op) in ROUNDING

    def rule(self, op):
        name = op_name(op)
        rule = RULES.get(name)
        if rule is None:
            return None
        if len(op.results) != 1:
            return lambda *_: f"{name} with several results"
        return functools.partial(rule, self)

    def keeps_mapped(self, op):
        return op_name(op) in MAPPED

    def not_homogeneous(self, op):
        return op_name(op) in NOT_HOMOGENEOUS

    def through_dot(self, op, pos, axis):
        return _through_dot(op, pos, axis)

    def input_channel(self, op, pos):
        return input_channel(op, pos) if pos == 0 or op_name(op) != "stablehlo.convolution" \
            else Refusal("a convolution reading the channels as its kernel")

    def second_kernel(self, op, pos, in_axis):
        return _second_kernel(self, op, pos, in_axis)

    def second_over_axes(self, op, pos, axis):
        return _second_over_axes(self, op, pos, axis)

    def start(self, op):
        got = layer_start(op) if op_name(op) in ROOTS else None
        return (got, None) if isinstance(got, str) else got

    def bias_keys(self):
        return list(self.biases)



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
    """The layer ``op`` reading the channels (``axis``) at operand ``pos`` as a
    :class:`Second`, or why not (:func:`hlofold._quant.core.pair_walk.second_layer`)."""
    return pair_walk.second_layer(ctx, op, pos, axis)


def _second_kernel(ctx, op, pos, in_axis):
    """The layer ``op`` contracting the channels at operand ``pos``: its kernel a constant
    read once."""
    k = op.operands[1 - pos]
    w = weight(k, op)
    if w is None:
        return f"the next {op_name(op)}'s kernel is not a constant read once"
    info = root_info(op) if pos == 0 else None
    if pos == 0 and not isinstance(info, RootInfo):
        return f"the next {op_name(op)}'s kernel is not read as a layer's"
    free = [a for a in range(len(shape_of(k))) if a != in_axis]
    if pos == 1 and len(free) != 1:
        return f"the next {op_name(op)}'s kernel (its lhs) has {len(free)} free dimensions"
    # (a multi-head kernel, (d, heads, head_dim): its input rows are what is scaled; any of
    # its output axes serves to read them, as on the jaxpr path)
    ka = info.kernel_axis if pos == 0 else None
    out = (ka if isinstance(ka, int) else ka.axes[0]) if pos == 0 else free[0]
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


def layer_start(op):
    """The :class:`~hlofold._quant.core.pair_walk.Start` of a layer whose kernel is a
    constant read once (a multi-head kernel's: tuples of axes; the kernel a
    :class:`~.pair_rules.Weight`); a reason for a shared one; None for no layer."""
    info = root_info(op)
    if not isinstance(info, RootInfo) or op_name(op) not in ROOTS:
        return None
    w = weight(op.operands[info.kernel_index], op)
    if w is None:           # a constant read elsewhere too; else no layer (q @ kᵀ)
        return "its kernel is a constant read elsewhere too (a shared weight)" if \
            _constant_behind(op.operands[info.kernel_index]) else None
    if not isinstance(info.kernel_axis, int):    # a multi-head kernel: channels over a Block
        return Start(w, tuple(info.channel_axis.axes),
                     tuple(w.axes[a] for a in info.kernel_axis.axes))
    return Start(w, info.channel_axis, w.axes[info.kernel_axis])


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
    """Every pair in ``func``'s body (top level), the starts refused
    (:func:`hlofold._quant.core.pair_walk.find_pairs`), and the weights the pairs name (key ->
    :class:`~.pair_rules.Weight`)."""
    ctx = Path({}, {}, [])
    found, refused = pair_walk.find_pairs(ctx, func.regions[0].blocks[0].operations)
    return found, refused, ctx.weights


def norm_sites(func, weights: dict, taken: set) -> list[Found]:
    """Values a norm computes (a ``multiply`` by a value per token: after the fold, ``x·r``
    with γ moved forward into the layers) read by layers alone, along one channel axis, with
    constant kernels read once (keys not in ``taken``): smoothing puts ``·(1/s)`` there. Each site's start
    key is ``"norm:<n>"`` (no weight yet: its values start as ones)."""
    ctx = Path(weights, {w.const: k for k, w in weights.items()}, [])
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
