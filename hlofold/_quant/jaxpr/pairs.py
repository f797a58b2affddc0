"""Pairs for cross-layer equalization (:mod:`hlofold._quant.core.equalize`) read from a jaxpr.

A pair starts at a convolution or dot whose kernel is a parameter leaf and follows its output
channel, equation by equation, to the next convolution or dot whose activations it is and
whose kernel is a leaf too. Each equation on the way must commute with a positive
per-channel scale: :data:`RULES` has one entry per primitive (how the channel axis moves
through it, or why the pair stops there). Every value on the path is read once (a residual
add, a second reader, would see the scaled channels), and the two kernels and every bias
scaled with them are leaves read nowhere else.
"""
from __future__ import annotations

import dataclasses

from hlofold import _compat as C
from hlofold._base.chain_rules import Refusal
from hlofold._quant.core.equalize import Pair, Second, exact_in, stops_here
from hlofold._base.channel_axes import REPEATED, Mapped, read_by_kernel, settled, through_dot
from hlofold._ir.jaxpr.uses import index_uses
from .pair_rules import (CALLS, MAPPED, NOT_HOMOGENEOUS, ROUNDING, RULES, Ctx, call_rule,
                         cast_leaf, is_zero, leaf_of, single_leaf, varying_axis)
from hlofold._fold.jaxpr.patterns import PATTERNS



@dataclasses.dataclass
class Refused:
    """A first layer whose pair was not formed: its kernel leaf, where, and why."""

    kernel: int
    eqn: object
    reason: str
    where: str = ""          # (a scan body's: which stack)


@dataclasses.dataclass
class Found:
    """A pair, the equation it starts at, and the value its second layers read (its channel
    axis): what calibration measures for smoothing. ``low``: a value from the first
    layer's output to the second layers' input is of a low-precision float (then its scales
    are powers of two)."""

    pair: Pair
    eqn: object
    end: object
    end_axis: int
    low: bool = False


def find_pairs(jaxpr, n_leaves: int, norms: bool = False, leaves: dict | None = None,
               outputs: str = "a program output") -> tuple[list[Found], list[Refused]]:
    """Every pair of the top level of ``jaxpr`` whose inputs begin with ``n_leaves``
    parameter leaves (keys of the pairs: leaf indices), starting at a layer (a convolution
    or dot whose kernel is a leaf) — and with ``norms``, at a norm's scale too (a leaf
    vector multiplied into the activations: γ); and the starts refused. Second layers
    claimed by an earlier pair are not paired again. ``leaves`` (var -> leaf index) says
    which variables are leaves instead (a scan body's rows of them); ``outputs`` names
    what the jaxpr's outputs are in the reasons."""
    uses, producer = index_uses(jaxpr)
    if leaves is None:
        leaves = {v: i for i, v in enumerate(jaxpr.invars[:n_leaves])}
    found, refused, claimed = [], [], set()
    for e in jaxpr.eqns:
        ctx = Ctx(jaxpr, uses, producer, leaves, [], outputs=outputs)
        start = layer_start(ctx, e) or (_norm_start(ctx, e) if norms else None)
        if start is None:
            continue
        if isinstance(start[0], str):
            refused.append(Refused(start[1], e, start[0]))
            continue
        k1, axis, out_axis = start
        got = _follow(ctx, e.outvars[0], axis)
        if isinstance(got, str):
            refused.append(Refused(leaves[k1], e, got))
            continue
        seconds, end, end_axis, low = got
        if any(sec.key in claimed for sec in seconds):
            continue
        claimed.update(sec.key for sec in seconds)
        found.append(Found(Pair(str(leaves[k1]), out_axis, seconds,
                                [(str(i), ax) for i, ax in ctx.biases]), e, end, end_axis,
                           low))
    return found, refused


def layer_start(ctx, e):
    """``(kernel var, output channel axis, kernel output axis)`` of a layer whose kernel is a
    leaf; ``(why, leaf index)`` for a shared one; None for anything else."""
    pat = PATTERNS.get(e.primitive.name)
    if pat is None:
        return None
    info = pat.inspect_root(e)
    if isinstance(info, Refusal):
        return None
    k1 = cast_leaf(ctx, e.invars[info.kernel_index])
    if k1 is None:                 # (the weight on the lhs: Equinox's W @ x)
        info = next((a for a in pat.alternatives(e)
                     if cast_leaf(ctx, e.invars[a.kernel_index]) is not None), None)
        if info is None:
            return None
        k1 = cast_leaf(ctx, e.invars[info.kernel_index])
    why = single_leaf(ctx, k1, "its kernel")
    if why:
        return why, ctx.leaves[k1]
    if not isinstance(info.kernel_axis, int):    # a multi-head kernel: channels over a Block
        return k1, tuple(info.channel_axis.axes), tuple(info.kernel_axis.axes)
    return k1, info.channel_axis, info.kernel_axis


def _norm_start(ctx, e):
    """A norm's scale: ``x·γ`` with γ a leaf vector (through reshapes and broadcasts) whose
    one axis is the product's channel axis."""
    if e.primitive.name != "mul":
        return None
    out = e.outvars[0].aval.shape
    for k, g in enumerate(e.invars):
        shape = getattr(getattr(g, "aval", None), "shape", ())
        axis = varying_axis(ctx.producer, g, len(out)) if len(shape) == len(out) else None
        if axis is None or axis < 0 or shape[axis] != out[axis] or \
                not isinstance(e.invars[1 - k], C.Var):
            continue
        g = leaf_of(g, ctx.leaves, ctx.producer, ctx.uses)
        gdims = [d for d, n in enumerate(g.aval.shape) if n != 1] if g is not None else []
        if g is not None and len(gdims) == 1 and g.aval.shape[gdims[0]] == out[axis]:
            why = single_leaf(ctx, g, "the norm's scale")
            return (why, ctx.leaves[g]) if why else (g, axis, gdims[0])
    return None


def _follow(ctx, v, axis: int):
    """From the first layer's output ``v`` (channel ``axis``) to the layers that read it:
    ``([Second], the value they read, its channel axis, whether a value on the way is of a
    low-precision float)``, or why not."""
    low = False
    for _ in range(10_000):
        low = low or exact_in(v.aval.dtype)
        u = ctx.uses.get(v, [])
        if any(e is None for e, _ in u):
            return f"its output is {ctx.outputs} before another layer reads it"
        if len(u) == 3 and (leaky_out := leaky(ctx, u)) is not None:
            v = leaky_out                             # (the channel axis stays)
            continue
        if len(u) > 1:
            seconds = [second_layer(ctx, e, pos, axis) for e, pos in u]
            if all(not isinstance(x, str) for x in seconds):
                return seconds, v, axis, low      # (q, k and v; gate and up)
            return (f"its output is read {len(u)} times, not only by layers (a residual or "
                    f"another reader would see the scaled channels)")
        if not u:
            return "its output is not read"
        e, pos = u[0]
        name = e.primitive.name
        if name in PATTERNS:
            got = second_layer(ctx, e, pos, axis)
            if not isinstance(got, str):
                return [got], v, axis, low
            through = _through_dot(ctx, e, pos, axis)
            if through is None:
                return got
            v, axis = e.outvars[0], through
            continue
        if name in ROUNDING:     # (it rounds: only powers of two pass exactly)
            low, v = True, e.outvars[0]
            continue
        rule = RULES.get(name)
        if rule is None and name in CALLS:
            rule = call_rule
        if isinstance(axis, Mapped) and name not in MAPPED and name not in CALLS:
            axis = settled(axis)
            if isinstance(axis, Mapped):
                return REPEATED.format(op=name)
        if rule is None:
            return stops_here(name, name in NOT_HOMOGENEOUS, "on the way")
        got = rule(ctx, e, pos, axis)
        if isinstance(got, str):
            return got
        v, axis = e.outvars[0], got
    return "the path is too long"


def leaky(ctx, u):
    """LeakyReLU / PReLU, ``where(x >= 0, x, a·x)``: the comparison with 0, the product by
    a slope (one or one per channel), the select; its output, or None. Positive scales keep
    the sign, and the product commutes with them."""
    by = {e.primitive.name: (e, pos) for e, pos in u}
    cmp, mul, sel = by.get("ge") or by.get("gt"), by.get("mul"), by.get("select_n")
    if cmp is None or mul is None or sel is None or cmp[1] != 0 or \
            not is_zero(ctx, cmp[0].invars[1]):
        return None
    c, m, s = cmp[0].outvars[0], mul[0].outvars[0], sel[0]
    if s.invars[0] is not c or len(s.invars) != 3 or s.invars[1] is not m or sel[1] != 2 or \
            len(ctx.uses.get(c, [])) != 1 or len(ctx.uses.get(m, [])) != 1:
        return None
    return s.outvars[0]


def _through_dot(ctx, e, pos, axis):
    """A dot of two activations that contracts none of the channel axes (attention's
    ``probs @ v``, heads a batch axis): linear in each channel, which moves to its output
    position; else None."""
    if e.primitive.name != "dot_general" or cast_leaf(ctx, e.invars[1 - pos]) is not None:
        return None
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    return through_dot([len(x.aval.shape) for x in e.invars], (lc, rc), (lb, rb), pos, axis)


def _second_over_axes(ctx, e, pos, axis):
    """A dot reading channels split over axes, contracting exactly those (an output
    projection's (heads, head_dim, d) kernel): a second layer, its input rows over them."""
    k2 = cast_leaf(ctx, e.invars[1 - pos])
    if e.primitive.name != "dot_general" or k2 is None:
        return f"the next {e.primitive.name} reads the channels split over axes"
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    got = read_by_kernel((lc, rc), (lb, rb), len(k2.aval.shape), pos, axis)
    if got is None:
        return f"the next {e.primitive.name} reads the channels split over axes"
    return single_leaf(ctx, k2, "the next layer's kernel") or \
        Second(str(ctx.leaves[k2]), *got,
               channels=axis.positions() if isinstance(axis, Mapped) else None)


def second_layer(ctx, e, pos, axis):
    """The layer ``e`` reading the channels (``axis``) at operand ``pos`` as a
    :class:`Second` — its kernel a leaf read once, contracting the channels — or why not."""
    pat = PATTERNS.get(e.primitive.name)
    if pat is None:
        return f"{e.primitive.name} reads it besides the layers"
    if isinstance(axis, Mapped):      # (a repeat the layer contracts; else copies it keeps)
        got, plain = _second_over_axes(ctx, e, pos, axis), settled(axis)
        return second_layer(ctx, e, pos, plain) if isinstance(got, str) and \
            not isinstance(plain, Mapped) else got
    if isinstance(axis, tuple):
        return _second_over_axes(ctx, e, pos, axis)
    ch = pat.input_channel(e, pos)
    if isinstance(ch, Refusal):
        return f"the next {e.primitive.name}: {ch.reason}"
    act_axis, in_axis = ch
    if act_axis != axis:
        return f"the next {e.primitive.name} does not contract the channel axis"
    info = pat.inspect_root(e)
    if getattr(info, "kernel_index", None) != 1 - pos:     # (the weight on the lhs: W @ x)
        info = next((a for a in pat.alternatives(e) if a.kernel_index == 1 - pos), info)
    k2 = cast_leaf(ctx, e.invars[1 - pos])
    if isinstance(info, Refusal) or k2 is None or \
            getattr(info, "kernel_index", None) != 1 - pos:
        return f"the next {e.primitive.name}'s kernel is not a parameter leaf as it is"
    why = single_leaf(ctx, k2, "the next layer's kernel")
    if why:
        return why
    # (a multi-head kernel, (d, heads, head_dim): its input rows are what is scaled; any of
    # its output axes serves to read them)
    out = info.kernel_axis if isinstance(info.kernel_axis, int) else info.kernel_axis.axes[0]
    return Second(str(ctx.leaves[k2]), in_axis, out, int(e.params.get("feature_group_count", 1)))
