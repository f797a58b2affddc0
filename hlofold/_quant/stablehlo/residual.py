"""Residual streams for cross-layer equalization read from StableHLO: the adapter of
:mod:`hlofold._quant.core.streams`, the twin of ``hlofold._quant.jaxpr.residual``.

A layer whose pair was refused (its output meets a residual add, is read twice) starts a
walk of the stream it is part of; each op on it is read by the pair rules
(:data:`~.pair_rules.RULES`: ReLU, pooling, a folded BatchNorm's bias, private functions
entered), a layer reading it with a constant kernel read once is a reader
(:func:`~.pairs.second_layer`), and an ``add`` of two activations joins the layers the
other operand is computed from. A formed stream is one
:class:`~hlofold._quant.core.equalize.Pair` with several writers; its starts leave the refusals.
"""
from __future__ import annotations

import numpy as np

from hlofold._quant.core.equalize import exact_in, stops_here
from hlofold._quant.core.streams import Writer, streams, summands, walk, with_leaky
from hlofold._ir.stablehlo.ir import elem_type, float_dtype, op_name, owner_op, shape_of
from hlofold._quant.core.pair_walk import Found, Start
from .pair_rules import uses
from .pairs import Path, layer_start, second_layer

def data_values(func) -> set:
    """The values of ``func``'s top level computed from its arguments (activations; a
    constant's broadcast, a bias computed from constants, is not one)."""
    block = func.regions[0].blocks[0]
    data = set(block.arguments)
    for op in block.operations:
        if any(v in data for v in op.operands):
            data.update(op.results)
    return data


class _Graph:
    """The function read for :func:`hlofold._quant.core.streams.walk`."""

    outputs = "a program output"

    def __init__(self, ctx: Path, data: set):
        self.ctx, self.data = ctx, data

    def ident(self, op):
        return op.operation

    def uses(self, v):
        return with_leaky([(None, -1) if op_name(o) == "func.return" else (o, p)
                           for o, p in uses(v)], self._leaky)

    def _leaky(self, three):
        out = self.ctx.leaky(three)
        return None if out is None else owner_op(out)

    def name(self, op):
        return op_name(op)

    def kind(self, op):
        return {"stablehlo.add": "add", "stablehlo.multiply": "product",
                "stablehlo.divide": "product"}.get(op_name(op), "")

    def operands(self, op):
        return list(op.operands)

    def result(self, op):
        return op.results[0]

    def shape(self, v):
        return tuple(shape_of(v))

    def is_data(self, v):
        return v in self.data

    def reader(self, op, pos, axis):
        return second_layer(self.ctx, op, pos, axis) if self.ctx.is_layer(op) else None

    def rule(self, op, pos, axis):
        rule = self.ctx.rule(op)
        if rule is None or len(op.results) != 1:
            return stops_here(op_name(op), self.ctx.not_homogeneous(op), "on the stream")
        return rule(op, pos, axis)

    def origins(self, v, depth: int = 0):
        op = owner_op(v)
        if op is None:
            return "a program input is added into the stream"
        start = self.ctx.start(op)
        if start is not None:
            if not isinstance(start, Start):
                return f"a layer writing into the stream: {start[0]}"
            w, axis, out_axis = start.kernel, start.axis, start.out_axis
            if not isinstance(axis, int):
                return "a layer writing into the stream has its channels over several axes"
            return [Writer(self.ctx.key(w), out_axis, op, op.results[0], axis)]
        acts = [x for x in op.operands if x in self.data]
        if not acts or depth > 64:
            return f"{op_name(op)}'s output, not a layer's, is added into the stream"
        return summands(acts, self.origins, depth)


def find_streams(func, found: list, refused: list, weights: dict) -> list[Found]:
    """The residual streams of ``func``'s top level, each started from a layer whose pair
    ``refused`` holds (:func:`hlofold._quant.core.streams.streams`); the refusals of the layers a
    stream took are removed, those of a stream left say why. ``found``: the pairs (their first kernels are
    not taken again); ``weights``: the pairs' weights (the streams' are added)."""
    data = data_values(func)
    keys = {w.const: k for k, w in weights.items()}
    starts = []
    for r in refused:
        start = layer_start(r.at) if r.at is not None else None
        if isinstance(start, Start) and isinstance(start.axis, int):
            key = Path(weights, keys, []).key(start.kernel)
            starts.append((r, Writer(key, start.out_axis, r.at, r.at.results[0],
                                     start.axis)))

    def walk_from(w):
        ctx = Path(weights, keys, [])
        return walk(_Graph(ctx, data), w), ctx.biases
    got = streams(starts, walk_from, {f.pair.first for f in found}, lambda op: op.operation,
                  refused, lambda r: r.at)
    return [Found(pair, r.at, s.end, s.end_axis,
                  any(exact_in(float_dtype(elem_type(v)) or np.float32) for v in s.values))
            for r, pair, s in got]
