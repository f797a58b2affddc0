"""The per-op rules of a pair's path on StableHLO (:mod:`hlofold._quant.stablehlo.pairs`): how a
positive per-channel scale on an op's input reaches its output — the channel axis it moves
to, or why the path stops there — one entry per op in :data:`RULES` (the words of the jaxpr
rules, ``hlofold._quant.jaxpr.pair_rules``); and what reads a constant through shapes and calls.
A channel is an axis, or a tuple of axes where it is split over several (attention's heads;
:mod:`hlofold._base.channel_axes`).
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from hlofold import _compat as C
from hlofold._base.chain_rules import Refusal
from hlofold._base.channel_axes import (Mapped, as_block, broadcast, each, one, permuted,
                                        reshaped, whole_block)
from hlofold._quant.core.pair_walk import through_body
from hlofold._fold.stablehlo.forward import op_ints
from hlofold._ir.stablehlo.ir import (attr_dims, constant_attr, constant_values, is_float, op_name,
                                      owner_op, shape_of)
from hlofold._ir.stablehlo import ops
from hlofold._ir.stablehlo.module import private_body
from hlofold._fold.stablehlo.patterns import resolve

ir, stablehlo, _ = C.mlir()

NOT_HOMOGENEOUS = ops.names(lambda o: o.homogeneous is False)
ROUNDING = ops.names(lambda o: o.rounding == "always")


@dataclasses.dataclass
class Weight:
    """A constant a pair scales: its op, for each axis of the value the layer reads the
    constant's axis (a transpose between), and the op that reads it (where it is)."""

    const: object
    axes: tuple
    reader: object = None
    converted: bool = False       # read through a float-to-float convert (bf16 -> f32)


@dataclasses.dataclass
class Ctx:
    weights: dict                 # key -> Weight (filled as pairs are read)
    keys: dict                    # constant op -> key
    biases: list                  # (key, axis) of the pair being read

    def key(self, w: Weight) -> str:
        k = self.keys.setdefault(w.const, f"c{len(self.keys)}")
        self.weights[k] = w
        return k



def uses(v) -> list:
    return [(u.owner, u.operand_number) for u in v.uses]


def single(v) -> bool:
    u = uses(v)
    return len(u) == 1 and op_name(u[0][0]) != "func.return"


def weight(v, reader=None) -> Weight | None:
    """``v`` (read by ``reader``) as a constant read once (through transposes, sharding
    constraints and float converts read once: a bfloat16 weight widened for the layer), or
    None."""
    axes = list(range(len(shape_of(v))))
    converted = False
    while True:
        if not single(v):
            return None
        op = owner_op(v)
        if op is None:
            return None
        if op_name(op) == "stablehlo.constant":
            return Weight(op, tuple(axes), reader, converted)
        if op_name(op) == "stablehlo.convert" and is_float(v) and is_float(op.operands[0]):
            v, converted = op.operands[0], True       # (scaled by powers of two: exact)
            continue
        if op_name(op) == "sdy.sharding_constraint":  # (the same values: a jit's shardings)
            v = op.operands[0]
            continue
        if op_name(op) != "stablehlo.transpose":
            return None
        perm = attr_dims(op, "permutation")
        axes = [perm[a] for a in axes]
        v = op.operands[0]


# a called function's arguments -> the values the call passes (while a call is followed);
# one list per thread: folds in several threads follow their calls at the same time
_LOCAL = threading.local()


def passed() -> list:
    """This thread's ``(argument, value passed)`` of the calls being followed."""
    got = getattr(_LOCAL, "passed", None)
    if got is None:
        got = _LOCAL.passed = []
    return got


def constant(v):
    """The value of ``v`` where it is a constant (through broadcasts, converts, reshapes,
    and into a call's operands; the values repeat), else None."""
    for _ in range(16):
        op = owner_op(v)
        if op is None:
            v = next((o for a, o in reversed(passed()) if a == v), None)
            if v is None:
                return None
            continue
        if op_name(op) == "stablehlo.constant":
            attr = constant_attr(op)
            return None if attr is None else constant_values(attr)
        if ops.of(op_name(op)).shape not in ("broadcast", "cast", "reshape"):
            return None
        v = op.operands[0]
    return None


def is_zero(v) -> bool:
    x = constant(v)
    return x is not None and bool(np.all(x == 0))


def _bias(ctx, op, pos, axis):
    """x + b, x − b with b a constant vector per channel (divided by the scale too)."""
    name = op_name(op).split(".")[-1]
    if name == "subtract" and pos == 1:
        return "a subtraction from the channels"
    b = op.operands[1 - pos]
    if is_zero(b):
        return axis
    shape = shape_of(op.results[0])
    blk = as_block(axis, shape) if isinstance(axis, tuple) else None
    if isinstance(axis, tuple):
        r = resolve(b, shape, blk, explain=False) if blk is not None else None
        if r is None or isinstance(r, Refusal) or not whole_block(r, blk):
            return f"{name} of a value while the channels are split over axes"
    else:
        r = resolve(b, shape, axis, explain=False)
        if isinstance(r, Refusal) or r.axis is None or r.block is not None:
            return (f"{name} of a value that is not one per channel (a residual add ties "
                    f"channels)")
    v = b
    for _ in range(16):                        # (every value on the way read once)
        if v == r.value:
            break
        if not single(v) or owner_op(v) is None:
            return f"{name} of a per-channel value read elsewhere too"
        v = owner_op(v).operands[0]
    src = r.value
    if blk is not None and single(src) and owner_op(src) is not None and \
            op_name(owner_op(src)) == "stablehlo.reshape":
        src = owner_op(src).operands[0]     # (a folded bias, flat: row-major over the block)
    w = weight(src, op)
    if w is None:
        return f"{name} of a per-channel value that is not a constant read once"
    if blk is None:
        ctx.biases.append((ctx.key(w), w.axes[r.axis]))
    else:                              # (its axes over the block, in order)
        dims = [d for d, n in enumerate(shape_of(src)) if n != 1]
        ctx.biases.append((ctx.key(w), one(tuple(w.axes[d] for d in dims))))
    return axis


def _product(ctx, op, pos, axis):
    if op_name(op) == "stablehlo.divide" and pos == 1:
        return "a division by the channels"
    return axis


def _max(ctx, op, pos, axis):
    return axis if is_zero(op.operands[1 - pos]) else \
        "max with a value other than 0 (not a ReLU)"


def _body(op) -> str | None:
    ops = [op_name(o) for o in op.regions[0].blocks[0].operations]
    return ops[0] if len(ops) == 2 else None


def _sum_or_max(op, pos, what: str) -> str | None:
    """Why a ``reduce``/``reduce_window`` does not commute with a positive scale: not a sum
    or a max of its operand, or from a value other than 0 (−∞ for a max); None if it does."""
    if pos != 0 or len(op.results) != 1 or _body(op) not in ("stablehlo.add",
                                                             "stablehlo.maximum"):
        return f"a {what} that is not a sum or a max"
    init = constant(op.operands[1])
    if init is None or not (np.all(init == 0) or (_body(op) == "stablehlo.maximum"
                                                  and np.all(np.isneginf(init)))):
        return f"a {what} from a value other than 0"
    return None


def _window(ctx, op, pos, axis):
    """Pooling (sum, max) with a window of one along the channels, from 0 or −∞."""
    why = _sum_or_max(op, pos, "pooling")
    if why:
        return why
    if isinstance(axis, tuple):
        return "pooling while the channels are split over axes"
    r = len(shape_of(op.results[0]))
    win = op_ints(op, "window_dimensions")
    st = op_ints(op, "window_strides", [1] * r)
    pad = op_ints(op, "padding", [0] * (2 * r))
    if win[axis] != 1 or st[axis] != 1 or pad[2 * axis:2 * axis + 2] != [0, 0]:
        return "pooling across channels"
    return axis


def _reduce(ctx, op, pos, axis):
    why = _sum_or_max(op, pos, "reduction")
    if why:
        return why
    dims = attr_dims(op, "dimensions")
    if any(a in dims for a in each(axis)):
        return "a reduction over the channels"
    return one(tuple(a - sum(d < a for d in dims) for a in each(axis)))


def _pad(ctx, op, pos, axis):
    if pos != 0 or not is_zero(op.operands[1]):
        return "padding with a value other than 0"
    if isinstance(axis, tuple):
        return "padding while the channels are split over axes"
    if any(attr_dims(op, a)[axis] for a in ("edge_padding_low", "edge_padding_high",
                                            "interior_padding")):
        return "padding along the channels"
    return axis


def _transpose(ctx, op, pos, axis):
    return permuted(attr_dims(op, "permutation"), axis)


def _reshape(ctx, op, pos, axis):
    """A reshape that keeps the channels whole and in order: split over consecutive axes
    (heads) or merged back (:func:`hlofold._base.channel_axes.reshaped`)."""
    return reshaped(shape_of(op.operands[0]), shape_of(op.results[0]), axis)


def _broadcast(ctx, op, pos, axis):
    dims = attr_dims(op, "broadcast_dimensions")
    if any(shape_of(op.results[0])[dims[a]] != shape_of(op.operands[0])[a]
           for a in (axis.axes if isinstance(axis, Mapped) else each(axis))):
        return "a broadcast along the channels"
    return broadcast(dims, shape_of(op.operands[0]), shape_of(op.results[0]), axis)


def _same(ctx, op, pos, axis):
    """Negation, a cast between float types: the channels stay (a cast to an integer type
    rounds: no path)."""
    if not is_float(op.results[0]):
        return f"{op_name(op)} to a type that is not floating point"
    return axis


def _call(ctx, op, pos, axis):
    """A call of a private function (``jax.nn.relu`` exports as one): followed through its
    body to its return (:func:`hlofold._quant.core.pair_walk.through_body`; ``ctx`` is the
    pair walk's view), its arguments standing for the values passed."""
    body = private_body(op)
    if body is None or len(op.results) != 1:
        return "a call of a function hlofold does not enter (public, or several results)"
    args, stack = list(zip(body.arguments, op.operands)), passed()
    stack.extend(args)
    try:
        return through_body(ctx, body.arguments[pos], axis, op_name(op),
                            "(inside a called function)")
    finally:
        del stack[len(stack) - len(args):]


RULES = {"stablehlo.add": _bias, "stablehlo.subtract": _bias, "stablehlo.multiply": _product,
         "stablehlo.divide": _product, "stablehlo.maximum": _max, "stablehlo.negate": _same,
         "stablehlo.reduce_window": _window, "stablehlo.reduce": _reduce,
         "stablehlo.pad": _pad, "stablehlo.transpose": _transpose,
         "stablehlo.reshape": _reshape,
         "stablehlo.broadcast_in_dim": _broadcast, "stablehlo.convert": _same,
         "func.call": _call,
         "sdy.sharding_constraint": _same}     # (where the values live: the same values)
# the rules a channel repeated over an axis (``Mapped``) passes: it has no bias, no pooling
MAPPED = ops.names(lambda o: o.shape in ("transpose", "reshape", "broadcast", "cast",
                                         "constraint") or o.affine in ("mul", "div", "neg")
                   or o.call is not None or o.rounding == "always")


def _is_select(op) -> bool:
    """A ``select``, or a call of a private function that is one select of its arguments in
    order (``jnp.where`` exports as one)."""
    if op_name(op) == "stablehlo.select":
        return True
    body = private_body(op) if op_name(op) == "func.call" else None
    ops = list(body.operations) if body is not None else []
    return len(ops) == 2 and op_name(ops[0]) == "stablehlo.select" and \
        list(ops[0].operands) == list(body.arguments) and ops[1].operands[0] == ops[0].result


def leaky(u):
    """LeakyReLU / PReLU, ``select(x >= 0, x, a·x)``: its result, or None."""
    by = {("select" if _is_select(o) else op_name(o)): (o, p) for o, p in u}
    cmp, mul, sel = by.get("stablehlo.compare"), by.get("stablehlo.multiply"), \
        by.get("select")
    if cmp is None or mul is None or sel is None or len(u) != 3 or cmp[1] != 0 or \
            not is_zero(cmp[0].operands[1]) or str(ir.Attribute(
                cmp[0].attributes["comparison_direction"])).split()[-1].rstrip(">") \
            not in ("GE", "GT"):
        return None
    c, m, s = cmp[0].results[0], mul[0].results[0], sel[0]
    if s.operands[0] != c or s.operands[2] != m or sel[1] != 1 or \
            not single(c) or not single(m):
        return None
    return s.results[0]
