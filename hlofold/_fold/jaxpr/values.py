"""Known values and provenance in a jaxpr scope (the values half of ``_fold.jaxpr.fold._Scope``).

* :meth:`ScopeValues.value`: the concrete value of a variable when it is known at transform
  time (constants, and values computed from them: evaluated on the host with the NumPy rules
  of ``_fold.jaxpr.host``, one per primitive, else with ``jax.ensure_compile_time_eval``), else None; a
  value computed from an input not known now is None at once (a cheap sweep says so);
* :meth:`ScopeValues.names`: the program inputs (or named constants) a value derives from;
* :meth:`ScopeValues.sources`: the program inputs a value is computed from (a bit set);
* :meth:`ScopeValues.from_root`: whether a value is computed from a root's output (an
  activation, never a parameter).

All are memoized per scope; the last two (and the known-ness test) are one sweep over the
equations in program order, the value a memoized walk back (``_fold.core.chain.postorder``): programs
can be deeper than Python's stack.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hlofold import _compat as C
from hlofold._fold.core.chain import postorder
from .host import evaluate as host_evaluate, flushes as host_flushes
from .nested import contains_root
from .patterns import PATTERNS

# Largest constant sub-computation evaluated at transform time (elements per output).
_MAX_CONST_EVAL = 1 << 26
_MISSING = object()


def NONE():
    """The known-value thunk of an input not known at transform time."""
    return None


class ScopeValues:
    """Reads ``producer``, ``jaxpr``, ``known``/``known_thunks``, ``origins``/``name_thunks``,
    ``activation``, ``maybe_known`` and ``swept`` (set by the scope's ``_index``)."""

    def _backward(self, atom, memo: dict, literal, leaf, combine):
        """Memoized walk from ``atom`` back to the inputs (``_fold.core.chain.postorder``): ``leaf(v)``
        gives the value of a variable without a producer in this scope,
        ``combine(eqn, input_values)`` the values of an equation's outputs."""
        if isinstance(atom, C.Literal):
            return literal(atom)
        producer = self.producer

        def inputs_of(v):
            prod = producer.get(v)
            return () if prod is None else [u for u in prod[1].invars if isinstance(u, C.Var)]

        def settle(v):
            prod = producer.get(v)
            if prod is None:
                memo[v] = leaf(v)
                return
            eqn = prod[1]
            ins = [literal(u) if isinstance(u, C.Literal) else memo[u] for u in eqn.invars]
            for o, val in zip(eqn.outvars, combine(eqn, ins)):
                memo[o] = val
        return postorder(atom, memo, inputs_of, settle)

    def value(self, atom) -> Any:
        """Concrete value of ``atom`` if it is known at transform time, else None."""
        if not self._may_be_known(atom):
            return None
        def leaf(v):
            return self.known_thunks[v]() if v in self.known_thunks else None

        flushed = self.flushed

        def combine(eqn, vals):
            if all(x is not None for x in vals) and _evaluable(eqn):
                out = host_evaluate(eqn, vals)      # NumPy: no XLA compile per op
                if out is None:
                    with jax.ensure_compile_time_eval():
                        out = C.bind_eqn(eqn, vals)
                    if any(C.is_tracer(o) for o in out):
                        out = None     # (a primitive that stages even here: a collective)
                if out is not None and not host_flushes(eqn, vals, out):
                    return out
                if out is not None:
                    flushed.update(eqn.outvars)
            elif any(isinstance(u, C.Var) and u in flushed for u in eqn.invars):
                flushed.update(eqn.outvars)
            return [None] * len(eqn.outvars)
        return self._backward(atom, self.known, lambda a: a.val, leaf, combine)

    def _swept(self, atom, memo: dict, leaf, combine, literal):
        """``memo[atom]``, computed by a sweep over the equations in program order (they are
        topologically sorted) up to ``atom``'s producer, from where the last sweep of
        ``memo`` stopped: each equation once, no stack. ``leaf(v)``: a variable without a
        producer; ``combine(eqn, input values)``: the value of an equation's outputs."""
        if isinstance(atom, C.Literal):
            return literal
        got = memo.get(atom, _MISSING)
        if got is not _MISSING:
            return got
        prod = self.producer.get(atom)
        if prod is None:
            memo[atom] = got = leaf(atom)
            return got
        eqns, start = self.jaxpr.eqns, self.swept.get(id(memo), 0)
        for j in range(start, prod[0] + 1):
            eqn = eqns[j]
            ins = []
            for u in eqn.invars:
                if isinstance(u, C.Literal):
                    ins.append(literal)
                else:
                    val = memo.get(u, _MISSING)
                    if val is _MISSING:
                        memo[u] = val = leaf(u)
                    ins.append(val)
            val = combine(eqn, ins)
            for o in eqn.outvars:
                memo[o] = val
        self.swept[id(memo)] = max(start, prod[0] + 1)
        return memo[atom]

    def flushes(self, atom) -> bool:
        """Whether :meth:`value` left ``atom`` unknown because its host value depends on
        subnormal numbers a backend flushes (``_fold.core.rules.flushes_differently``)."""
        return isinstance(atom, C.Var) and atom in self.flushed

    def names(self, atom) -> frozenset:
        """Names of the program inputs (or named constants) that ``atom`` derives from."""
        def leaf(v):
            return self.name_thunks[v]() if v in self.name_thunks else frozenset()
        return self._swept(atom, self.origins, leaf, _union, _EMPTY)

    def sources(self, atom) -> int:
        """The program inputs ``atom`` is computed from, as a bit set (constants are no
        source: a value known now links nothing); one sweep, no bound."""
        def leaf(v):
            return self.source_thunks[v]() if v in self.source_thunks else 0
        return self._swept(atom, self.source_bits, leaf, _or, 0)

    def from_root(self, atom) -> bool:
        """Whether ``atom`` is computed from the output of a pattern root (a convolution),
        directly or through nested jaxprs: then it is an activation, never a parameter."""
        def combine(eqn, vals):
            return eqn.primitive.name in PATTERNS or any(vals) or contains_root(eqn)
        return self._swept(atom, self.activation, lambda v: False, combine, False)

    def _may_be_known(self, atom) -> bool:
        """False when ``atom`` is computed from an input whose value is not known at
        transform time (then :meth:`value` is None without walking back)."""
        def leaf(v):
            return v in self.known or self.known_thunks.get(v, NONE) is not NONE
        return self._swept(atom, self.maybe_known, leaf, lambda eqn, vals: all(vals), True)

    # ---- planning


_EMPTY: frozenset = frozenset()


def _union(eqn, sets) -> frozenset:
    """The union of ``sets``, a new set only where it is larger than the largest of them:
    the sweep over a program's activations (each reads the names of all parameters before
    it) would otherwise copy a growing set at every equation."""
    out = max(sets, key=len, default=_EMPTY)
    for x in sets:
        if x is not out and not x <= out:
            out = out | x
    return out


def _or(eqn, bits) -> int:
    out = 0
    for b in bits:
        out |= b
    return out


def _evaluable(eqn) -> bool:
    if eqn.effects:
        return False
    for o in eqn.outvars:
        if int(np.prod(getattr(o.aval, "shape", ()), dtype=np.int64)) > _MAX_CONST_EVAL:
            return False
    return True
