"""Whether a fold crosses a call boundary: the rule both IRs apply to decide which calls
(a ``@jax.jit`` helper, a ``jax.checkpoint`` body; a private ``func.call`` on StableHLO)
to inline before folding.

A fold joins a layer (conv/dot) and per-channel arithmetic. Where one of them is inside a
call and the other outside — a convolution in a jitted helper whose BatchNorm the caller
applies, a norm's scale applied before a helper that holds the projection — neither scope
sees both, so the call is inlined first (what XLA does with it anyway, so the compiled
program computes the same values). Each adapter classifies its ops (:data:`LAYER`,
:data:`AFFINE`, :data:`PASS` or None) and says how to step from a value to its producer and
to its one reader; the rule follows shape ops and casts (:data:`PASS`) on both sides of the
boundary and asks whether a layer meets per-channel arithmetic across it.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

LAYER, AFFINE, PASS = "layer", "affine", "pass"
_LIMIT = 64              # shape ops followed at most, on either side


def made_by(v, producer: Callable[[Any], Any], kind: Callable[[Any], str | None],
            operand: Callable[[Any], Any], through: Callable | None = None) -> str | None:
    """The kind of op that makes ``v``, looking through :data:`PASS` ops (``producer(v)``:
    the op or None for an input; ``operand(op)``: the value a pass op passes) and, with
    ``through``, into the calls that return it (``through(call, v)``: ``(the value the
    body returns for v, the body's producer)``, or None: a call nested in a call, whose
    layer's per-channel arithmetic is applied by the outermost caller)."""
    for _ in range(_LIMIT):
        op = producer(v)
        if op is None:
            return None
        k = kind(op)
        if k is None and through is not None and (inner := through(op, v)) is not None:
            v, producer = inner
            continue
        if k != PASS:
            return k
        v = operand(op)
    return None


def read_by(v, readers: Callable[[Any], list], kind: Callable[[Any], str | None],
            result: Callable[[Any], Any]) -> str | None:
    """The kind of the one op that reads ``v``, looking through :data:`PASS` ops (None where
    ``v`` is an output or has several readers, unless all are layers: ``readers(v)`` lists
    ops, None for an output)."""
    for _ in range(_LIMIT):
        rs = readers(v)
        if len(rs) > 1 and all(r is not None and kind(r) == LAYER for r in rs):
            return LAYER        # (a norm's output read by q, k and v: the forward fold's)
        if len(rs) != 1 or rs[0] is None:
            return None
        k = kind(rs[0])
        if k != PASS:
            return k
        v = result(rs[0])
    return None


def crosses(pairs: Iterable[tuple]) -> bool:
    """Whether any ``(kind outside, kind inside)`` pair across a boundary — an operand made
    outside and read inside, or a result made inside and read outside — joins a layer and
    per-channel arithmetic."""
    return any({a, b} == {LAYER, AFFINE} for a, b in pairs)
