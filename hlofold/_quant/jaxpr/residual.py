"""Residual streams for cross-layer equalization read from a jaxpr: the adapter of
:mod:`hlofold._quant.core.streams`.

A layer whose pair was refused (its output meets a residual add, is read twice) starts a
walk of the stream it is part of; each equation on it is read by the pair rules
(:data:`~.pair_rules.RULES`: ReLU, pooling, a folded BatchNorm's arithmetic, whose biases
are scaled with the stream), a layer reading it with a leaf kernel is a reader
(:func:`~.pairs.second_layer`), and an add of two activations joins the layers the other
operand is computed from. A formed stream is one :class:`~hlofold._quant.core.equalize.Pair`
with several writers; its starts leave the refusals.
"""
from __future__ import annotations

import dataclasses

from hlofold import _compat as C
from hlofold._quant.core.equalize import exact_in, stops_here
from hlofold._quant.core.streams import Writer, streams, summands, walk, with_leaky
from hlofold._quant.core.pair_walk import Found, Start
from .pairs import Path, layer_start, second_layer, view

def data_values(jaxpr, leaves: dict) -> set:
    """The variables computed from the program's non-parameter inputs (activations; a
    bias or a norm's factor computed from leaves alone is not one)."""
    data = {v for v in jaxpr.invars if v not in leaves}
    for e in jaxpr.eqns:
        if any(isinstance(v, C.Var) and v in data for v in e.invars):
            data.update(e.outvars)
    return data


class _Graph:
    """The jaxpr read for :func:`hlofold._quant.core.streams.walk`."""

    def __init__(self, ctx: Path, data: set):
        self.ctx, self.data = ctx, data
        self.outputs = ctx.outputs

    def ident(self, e):
        return id(e)

    def uses(self, v):
        return with_leaky(self.ctx.uses.get(v, []), self._leaky)

    def _leaky(self, three):
        out = self.ctx.leaky(three)
        return None if out is None else self.ctx.producer[out]

    def name(self, e):
        return e.primitive.name

    def kind(self, e):
        return {"add": "add", "mul": "product", "div": "product"}.get(e.primitive.name, "")

    def operands(self, e):
        return [v if isinstance(v, C.Var) else None for v in e.invars]

    def result(self, e):
        return e.outvars[0]

    def shape(self, v):
        return v.aval.shape

    def is_data(self, v):
        return v in self.data

    def reader(self, e, pos, axis):
        return second_layer(self.ctx, e, pos, axis) if self.ctx.is_layer(e) else None

    def rule(self, e, pos, axis):
        rule = self.ctx.rule(e)
        if rule is None or len(e.outvars) != 1:
            return stops_here(e.primitive.name, self.ctx.not_homogeneous(e), "on the stream")
        return rule(e, pos, axis)

    def origins(self, v, depth: int = 0):
        p = self.ctx.producer.get(v)
        if p is None:
            return "a program input is added into the stream"
        start = layer_start(self.ctx, p)
        if start is not None:
            if not isinstance(start, Start):
                return f"a layer writing into the stream: {start[0]}"
            k, axis, out_axis = start.kernel, start.axis, start.out_axis
            if not isinstance(axis, int):
                return "a layer writing into the stream has its channels over several axes"
            return [Writer(str(self.ctx.leaves[k]), out_axis, p, p.outvars[0], axis)]
        acts = [x for x in p.invars if isinstance(x, C.Var) and x in self.data]
        if not acts or depth > 64:
            return f"{p.primitive.name}'s output, not a layer's, is added into the stream"
        return summands(acts, self.origins, depth)


def find_streams(jaxpr, n_leaves: int, found: list, refused: list,
                 outputs: str = "a program output") -> list[Found]:
    """The residual streams of ``jaxpr``'s top level, each started from a layer whose pair
    ``refused`` holds (:func:`hlofold._quant.core.streams.streams`); the refusals of the layers a
    stream took are removed, those of a stream left say why. ``found``: the pairs (their kernels are not
    taken again as a stream's first layer)."""
    leaves = {v: i for i, v in enumerate(jaxpr.invars[:n_leaves])}
    data = data_values(jaxpr, leaves)
    ctx = view(jaxpr, leaves, outputs)
    starts = []
    for r in refused:
        start = layer_start(ctx, r.at) if r.at is not None else None
        if isinstance(start, Start) and isinstance(start.axis, int):
            starts.append((r, Writer(ctx.key(start.kernel), start.out_axis, r.at,
                                     r.at.outvars[0], start.axis)))

    def walk_from(w):
        one = dataclasses.replace(ctx, biases=[])
        return walk(_Graph(one, data), w), one.bias_keys()
    got = streams(starts, walk_from, {f.pair.first for f in found}, id, refused,
                  lambda r: r.at)
    return [Found(pair, r.at, s.end, s.end_axis,
                  any(exact_in(v.aval.dtype) for v in s.values)) for r, pair, s in got]
