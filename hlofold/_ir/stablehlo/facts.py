"""Facts about ops that a StableHLO pass reads several times, kept for the pass.

A dot's dimension numbers or an op's location are read through the bindings (new Python
objects each time, microseconds per read), and the pass asks for them from several rules.
While :func:`op_facts` is active in a thread, :func:`op_fact` computes each fact once per
op, keyed by the op (its address in the IR). The pass erases no op while it is active, but
when it undoes a trial inlining, which calls :func:`forget_op_facts` (an erased op's address
may be reused by a new op).
"""
from __future__ import annotations

import contextlib
import threading

_facts = threading.local()


@contextlib.contextmanager
def op_facts():
    """Keep what :func:`op_fact` computes for the duration (this thread; nested: shared)."""
    if getattr(_facts, "memo", None) is not None:
        yield
        return
    _facts.memo = {}
    try:
        yield
    finally:
        _facts.memo = None


def forget_op_facts() -> None:
    memo = getattr(_facts, "memo", None)
    if memo is not None:
        memo.clear()


def op_fact(kind: str, op, compute):
    """``compute(op)``, computed once per op and ``kind`` while :func:`op_facts` is active."""
    memo = getattr(_facts, "memo", None)
    if memo is None:
        return compute(op)
    key = (kind, op)
    got = memo.get(key)
    if got is None:
        got = memo[key] = compute(op)
    return got
