"""Pairs for cross-layer equalization (:mod:`hlofold._quant.core.equalize`) read from a jaxpr.

The walk is :mod:`hlofold._quant.core.pair_walk`'s; this module reads a jaxpr for it
(:class:`Path`): a pair starts at a convolution or dot whose kernel is a parameter leaf (or
at a norm's scale, a leaf vector) and ends at the next convolutions or dots whose
activations it is and whose kernels are leaves too, each read once. How the channels move
through each equation on the way is :data:`~.pair_rules.RULES`' (one entry per primitive).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from hlofold import _compat as C
from hlofold._base.chain_rules import Refusal
from hlofold._base.channel_axes import Mapped, read_by_kernel, through_dot
from hlofold._fold.jaxpr.patterns import PATTERNS
from hlofold._ir.jaxpr.uses import index_uses
from hlofold._quant.core import pair_walk
from hlofold._quant.core.equalize import Second, exact_in
from hlofold._quant.core.pair_walk import Found, Refused, Start
from .pair_rules import (CALLS, MAPPED, NOT_HOMOGENEOUS, ROUNDING, RULES, Ctx, call_rule,
                         cast_leaf, is_zero, leaf_with_offset, single_leaf, varying_axis)


@dataclasses.dataclass
class Path(Ctx):
    """The jaxpr read for the pair walk (:class:`hlofold._quant.core.pair_walk.PathIR`); the
    rules of :mod:`.pair_rules` read it as their :class:`~.pair_rules.Ctx`."""

    norms: bool = False              # a norm's scale starts a pair too

    def readers(self, v):
        return self.uses.get(v, [])

    def name(self, e):
        return e.primitive.name

    def result(self, e):
        return e.outvars[0]

    def low(self, v):
        return exact_in(v.aval.dtype)

    def leaky(self, three):
        return leaky(self, three)

    def is_layer(self, e):
        return e.primitive.name in PATTERNS

    def rounds(self, e):
        return e.primitive.name in ROUNDING

    def rule(self, e):
        name = e.primitive.name
        rule = RULES.get(name) or (call_rule if name in CALLS else None)
        return None if rule is None else functools.partial(rule, self)

    def keeps_mapped(self, e):
        return e.primitive.name in MAPPED or e.primitive.name in CALLS

    def not_homogeneous(self, e):
        return e.primitive.name in NOT_HOMOGENEOUS

    def through_dot(self, e, pos, axis):
        return _through_dot(self, e, pos, axis)

    def input_channel(self, e, pos):
        return PATTERNS[e.primitive.name].input_channel(e, pos)

    def second_kernel(self, e, pos, in_axis):
        return _second_kernel(self, e, pos, in_axis)

    def second_over_axes(self, e, pos, axis):
        return _second_over_axes(self, e, pos, axis)

    def start(self, e):
        got = layer_start(self, e) or (_norm_start(self, e) if self.norms else None)
        if got is None or isinstance(got, Start):
            return got
        return got[0], str(got[1])

    def key(self, kernel):
        return str(self.leaves[kernel])

    def bias_keys(self):
        return [(str(i), ax) for i, ax in self.biases]


def view(jaxpr, leaves: dict, outputs: str = "a program output", norms: bool = False) -> Path:
    """``jaxpr`` read for the pair walk, ``leaves`` (var -> leaf index) its parameter leaves."""
    uses, producer = index_uses(jaxpr)
    return Path(jaxpr, uses, producer, leaves, [], outputs=outputs, norms=norms)


def find_pairs(jaxpr, n_leaves: int, norms: bool = False, leaves: dict | None = None,
               outputs: str = "a program output") -> tuple[list[Found], list[Refused]]:
    """Every pair of the top level of ``jaxpr`` whose inputs begin with ``n_leaves``
    parameter leaves (keys of the pairs: leaf indices), starting at a layer (a convolution
    or dot whose kernel is a leaf) — and with ``norms``, at a norm's scale too (a leaf
    vector multiplied into the activations: γ); and the starts refused
    (:func:`hlofold._quant.core.pair_walk.find_pairs`). ``leaves`` (var -> leaf index) says
    which variables are leaves instead (a scan body's rows of them); ``outputs`` names
    what the jaxpr's outputs are in the reasons."""
    if leaves is None:
        leaves = {v: i for i, v in enumerate(jaxpr.invars[:n_leaves])}
    return pair_walk.find_pairs(view(jaxpr, leaves, outputs, norms), jaxpr.eqns)


def layer_start(ctx, e):
    """The :class:`~hlofold._quant.core.pair_walk.Start` of a layer whose kernel is a leaf;
    ``(why, leaf index)`` for a shared one; None for anything else."""
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
        return Start(k1, tuple(info.channel_axis.axes), tuple(info.kernel_axis.axes))
    return Start(k1, info.channel_axis, info.kernel_axis)


def _norm_start(ctx, e):
    """A norm's scale: ``x·γ`` with γ a leaf vector (through reshapes and broadcasts) whose
    one axis is the product's channel axis; or ``x·(γ + c)``, ``c`` a literal (Gemma's
    ``1 + scale``), then the pair's ``offset``."""
    if e.primitive.name != "mul":
        return None
    out = e.outvars[0].aval.shape
    for k, g in enumerate(e.invars):
        shape = getattr(getattr(g, "aval", None), "shape", ())
        axis = varying_axis(ctx.producer, g, len(out)) if len(shape) == len(out) else None
        if axis is None or axis < 0 or shape[axis] != out[axis] or \
                not isinstance(e.invars[1 - k], C.Var):
            continue
        g, offset = leaf_with_offset(g, ctx.leaves, ctx.producer, ctx.uses)
        gdims = [d for d, n in enumerate(g.aval.shape) if n != 1] if g is not None else []
        if g is not None and len(gdims) == 1 and g.aval.shape[gdims[0]] == out[axis]:
            why = single_leaf(ctx, g, "the norm's scale")
            if not why and offset and exact_in(g.aval.dtype):
                why = (f"the norm's scale is applied as γ + {offset:g} with γ in "
                       f"{np.dtype(g.aval.dtype).name}: (γ + {offset:g})/s − {offset:g} "
                       f"rounds there, even for powers of two")
            return (why, ctx.leaves[g]) if why else Start(g, axis, gdims[0], offset)
    return None


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


def _second_kernel(ctx, e, pos, in_axis):
    """The layer ``e`` contracting the channels at operand ``pos`` as a :class:`Second`: its
    kernel a leaf read once."""
    pat = PATTERNS[e.primitive.name]
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


def second_layer(ctx, e, pos, axis):
    """The layer ``e`` reading the channels (``axis``) at operand ``pos`` as a
    :class:`Second`, or why not (:func:`hlofold._quant.core.pair_walk.second_layer`)."""
    return pair_walk.second_layer(ctx, e, pos, axis)
