"""Residual streams for cross-layer equalization, the IR-agnostic walk.

A pair (:mod:`.equalize`) ends where its path is read twice or added to another activation:
a residual add would see the scaled channels. But every value that meets such an add can be
scaled *together*: a ResNet stage's stream (``x + conv2(relu(conv1(x)))``, ReLU after the
add), a MobileNetV2 stage's (``x + project(...)``) is the sum of the outputs of a few layers
— the *writers* (the stem or a downsample convolution, the blocks' last convolutions) —
carried through adds, ReLU, pooling and the biases of folded BatchNorms, and read only by
layers — the *readers* (the next blocks' first convolutions, a downsample convolution, the
head). Dividing every writer's output channel ``i`` (and every bias added on the way) by
``s_i > 0`` and multiplying every reader's input channel ``i`` by it computes the same
outputs: each value of the stream is scaled by ``s`` and every op on it commutes with that.
The scale equalizes the largest writer's range with the largest reader's, as for a pair
(:func:`.equalize.ranges` with :attr:`.equalize.Pair.writers`).

:func:`walk` follows one stream from a writer through every use of every value in it; each
adapter reads its IR into a :class:`Graph` (its uses, its ops' kinds, its layers, its own
per-op rules of a pair's path, the layers a value is the sum of); :func:`step` — what one op
does with the stream — is written here once. Anything else reading the stream — the
program's output, an op that is not positively homogeneous, a product of two of its values
— and the stream is left, with the reason.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

from hlofold._base.reasons import Reason
from .equalize import Pair

PASSED = -2          # the position of a use that passes the value as it is (LeakyReLU's select)
NOT_LINEAR = "a product of two values of the stream (not linear in its scale)"
TWO_AXES = "its channels reach an add along two different axes"


@dataclasses.dataclass
class Writer:
    """A layer whose output is part of the stream: its kernel's key and output-channel
    axis, the op, and the value with its channel axis."""

    key: str
    out_axis: object
    op: object
    value: object
    axis: object


@dataclasses.dataclass
class Step:
    """What one op does with the stream's value: ``second`` (a layer reading it: a reader,
    :class:`.equalize.Second`), or ``out``/``axis`` (the value it makes, in the stream),
    with ``other`` (the other operand of an add of two activations: in the stream too) or
    ``apart`` (the other factor of a product: must not be in the stream)."""

    out: object = None
    axis: object = None
    second: object = None
    other: object = None
    apart: object = None


class Graph(Protocol):
    """An adapter's reading of its IR for :func:`walk`."""

    outputs: str          # what a use by the program's return is, in the reasons

    def ident(self, op):
        """A hashable identity of ``op`` (the same for every handle on it)."""

    def uses(self, v) -> list:
        """``[(op, operand position)]`` reading ``v``; ``(None, -1)`` for the return."""

    def name(self, op) -> str:
        """The op's name, for the reasons."""

    def kind(self, op) -> str:
        """``"add"``, ``"product"`` (a multiply or a divide), or ``""`` for any other op."""

    def operands(self, op) -> list:
        """The op's operands (None for a literal)."""

    def result(self, op):
        """The op's (one) result."""

    def shape(self, v) -> tuple:
        """A value's shape."""

    def is_data(self, v) -> bool:
        """Whether ``v`` is computed from the program's inputs (an activation)."""

    def reader(self, op, pos: int, axis):
        """The layer ``op`` reading the stream at operand ``pos`` (a :class:`.equalize.
        Second`), why it cannot be one, or None where ``op`` is no layer."""

    def rule(self, op, pos: int, axis):
        """The adapter's per-op rule of a pair's path: the channel axis of the op's result,
        or why the path stops there."""

    def origins(self, v) -> list[Writer] | str:
        """The layers whose outputs ``v`` is computed from (back through the ops a stream
        passes), or why it is not such a value."""


def with_leaky(u: list, leaky) -> list:
    """``u`` (a value's uses) with LeakyReLU's three — the comparison with 0, the product
    by the slope, the select — as one use of the select at :data:`PASSED`, where
    ``leaky(three uses)`` (the adapter's reading of the pattern) gives the select."""
    names = [x for x in u if x[0] is not None]
    if len(names) > 8:             # (a value read by many ops is no activation's input)
        return u
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            for k in range(j + 1, len(names)):
                three = [names[i], names[j], names[k]]
                sel = leaky(three)
                if sel is not None:
                    return [x for x in u if all(x is not t for t in three)] + [(sel, PASSED)]
    return u


@dataclasses.dataclass
class Left:
    """Why a stream was not formed; ``joined``: whether the walk met an add of two
    activations (else the start's value is only read twice — GELU's ``x·Φ(x)`` — and the
    pair's own reason says more)."""

    reason: str
    joined: bool


@dataclasses.dataclass
class Stream:
    """A stream: its writers (the first one the walk started from), its readers, the value
    the first reader reads with its channel axis, and every value of it (whose types say
    whether its scales must be powers of two)."""

    writers: list
    readers: list
    end: object
    end_axis: object
    values: list = dataclasses.field(default_factory=list)


def step(g: Graph, op, pos: int, axis) -> Step | str:
    """What ``op`` does with the stream's value at operand ``pos`` (channel ``axis``): a
    layer reads it; an add of two activations joins the other operand's writers; a product
    keeps its other factor apart; any other op passes it by the pair rules, or stops it."""
    if pos == PASSED:
        return Step(g.result(op), axis)
    if not isinstance(axis, int):
        return f"{g.name(op)} reads a stream whose channels are split over axes"
    got = g.reader(op, pos, axis)
    if got is not None:
        return got if isinstance(got, str) else Step(second=got)
    ins = g.operands(op)
    other = ins[1 - pos] if len(ins) == 2 else None
    kind = g.kind(op)
    if kind == "add" and other is not None and g.is_data(other):
        out = g.result(op)
        if g.shape(other) != g.shape(out) or g.shape(ins[pos]) != g.shape(out):
            return "an add of activations that broadcasts one of them"
        return Step(out, axis, other=other)
    got = g.rule(op, pos, axis)
    if isinstance(got, str):
        return got
    return Step(g.result(op), got, apart=other if kind == "product" else None)


def walk(g: Graph, start: Writer, limit: int = 100_000) -> Stream | Left:
    """The stream ``start``'s output is part of, followed through every use of every value
    in it, or why it cannot be scaled as one."""
    why = _walk(g, start, limit, joined := [])
    return Left(why, bool(joined)) if isinstance(why, str) else why


def _walk(g, start, limit, joins):
    writers, readers, ends = {g.ident(start.op): start}, [], []
    seen, work, done, apart = {start.value: start.axis}, [(start.value, start.axis)], \
        set(), []

    def reach(v, axis):
        if v in seen:
            return None if seen[v] == axis else TWO_AXES
        seen[v] = axis
        work.append((v, axis))
        return None
    while work:
        if len(done) > limit:
            return "the stream is too long"
        v, axis = work.pop()
        for op, pos in g.uses(v):
            if op is None:
                return f"the stream is {g.outputs}"
            if (g.ident(op), pos) in done:
                continue
            done.add((g.ident(op), pos))
            st = step(g, op, pos, axis)
            if isinstance(st, str):
                return st
            if st.second is not None:
                readers.append(st.second)
                ends.append((v, axis))
                continue
            if st.other is not None:
                joins.append((st.other, axis))
                if st.other not in seen:
                    got = g.origins(st.other)
                    if isinstance(got, str):
                        return got
                    for w in got:
                        if g.ident(w.op) not in writers:
                            writers[g.ident(w.op)] = w
                            why = reach(w.value, w.axis)
                            if why:
                                return why
            if st.apart is not None:
                apart.append(st.apart)
            why = reach(st.out, st.axis)
            if why:
                return why
    if any(o not in seen for o, _ in joins):
        return ("something other than layers' outputs is added into the stream (a value the "
                "walk from them does not reach)")
    if any(seen[o] != a for o, a in joins):
        return TWO_AXES
    if any(x in seen for x in apart):
        return NOT_LINEAR
    if not readers:
        return "no layer reads the stream"
    return Stream(list(writers.values()), readers, *ends[0], list(seen))


def summands(values: list, origins, depth: int) -> list[Writer] | str:
    """The writers behind each of ``values`` (the activation operands of an op between a
    layer and the stream), by ``origins(value, depth)``; or the first reason one is not."""
    out = []
    for x in values:
        got = origins(x, depth + 1)
        if isinstance(got, str):
            return got
        out += got
    return out


def streams(starts: list, walk_from, firsts: set, ident, refused: list, op_of) -> list:
    """The streams from ``starts`` (``[(refusal, Writer)]``: layers whose pair was refused,
    in program order), each walked by ``walk_from(writer) -> (Stream | Left, biases)`` once
    — a start another stream took is not walked again. Returns ``[(refusal, Pair,
    Stream)]``; ``refused`` (each item's ``reason``, its op ``op_of(item)``) loses the layers
    a stream took, and a start whose stream is left says why (where it met an add: else its
    pair's reason, "read twice", says more)."""
    out, covered = [], {}
    for r, w in starts:
        if ident(w.op) in covered:
            continue
        got, biases = walk_from(w)
        if isinstance(got, Left):
            if got.joined:
                covered[ident(w.op)] = Reason("pair-stream", "its output joins a residual "
                                              f"stream that is left: {got.reason}")
            continue
        keys = [x.key for x in got.writers]
        if firsts & set(keys) or len(set(keys)) < len(keys):
            covered[ident(w.op)] = Reason("pair-stream", "its output joins a residual stream "
                                                     "whose writers are paired")
            continue
        covered.update({ident(x.op): None for x in got.writers})
        first, rest = got.writers[0], got.writers[1:]
        out.append((r, Pair(first.key, first.out_axis, got.readers, list(biases),
                            [(x.key, x.out_axis) for x in rest]), got))
    kept = []
    for r in refused:
        op = op_of(r)
        why = covered.get(ident(op), "") if op is not None else ""
        if why is None:
            continue
        if why:
            r.reason = why
        kept.append(r)
    refused[:] = kept
    return out
