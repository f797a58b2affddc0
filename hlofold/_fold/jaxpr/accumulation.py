"""``(L, D)`` of a jaxpr for the tolerance model (:mod:`hlofold._base.tolerance`): the longest
accumulation of its conv/dot equations and the most of them on one path."""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops
from hlofold._base.tolerance import narrowest
from .nested import subjaxprs

_ACCUMULATING = ops.names(lambda o: o.layer is not None)
# calls whose body sees the call's operands one for one (followed input by input)
_CALLS = ops.names(lambda o: o.call in ("jit", "custom"))


def accumulation_of(jaxpr) -> tuple[int, int]:
    """``(L, D)`` of a jaxpr: the longest accumulation of its conv/dot equations and the
    most of them on one path (nested jaxprs counted where they are called)."""
    depth: dict = {}
    longest, deepest = 1, 0
    for e in jaxpr.eqns:
        d = max((depth.get(v, 0) for v in e.invars if isinstance(v, C.Var)), default=0)
        acc = _eqn_accumulation(e)
        inner = [accumulation_of(j) for j in subjaxprs(e)]
        longest = max([longest, acc] + [a for a, _ in inner])
        d += (e.primitive.name in _ACCUMULATING) + max((k for _, k in inner),
                                                       default=0) * _trips(e)
        for o in e.outvars:
            depth[o] = d
        deepest = max(deepest, d)
    return longest, deepest



def output_profiles(jaxpr, given=None) -> list[tuple[int, int, np.dtype | None]]:
    """``(L, D, compute)`` of each output of a jaxpr, from the convs/dots that output is
    computed from alone (a float32 output beside a bf16 one is measured as float32); the
    bodies of calls (jit, custom_jvp/vjp) followed input by input, other nested jaxprs
    (loops, branches) counted whole where they run. ``given``: the inputs' profiles."""
    none = (1, 0, None)
    state: dict = dict(zip(jaxpr.invars, given or ()))
    for e in jaxpr.eqns:
        ins = [state.get(v, none) for v in e.invars if isinstance(v, C.Var)]
        body = C.call_body(e)[1] if e.primitive.name in _CALLS else None
        if body is not None and len(body.jaxpr.invars) == len(e.invars):
            outs = output_profiles(body.jaxpr, [state.get(v, none) if isinstance(v, C.Var)
                                                else none for v in e.invars])
            state.update(zip(e.outvars, outs))
            continue
        acc = max((s[0] for s in ins), default=1)
        d = max((s[1] for s in ins), default=0)
        found = [s[2] for s in ins]
        if e.primitive.name in _ACCUMULATING:
            acc, d = max(acc, _eqn_accumulation(e)), d + 1
            found += [v.aval.dtype for v in (*e.invars[:2], *e.outvars)]
        for j in subjaxprs(e):
            a, k, c = tolerance_profile(j)
            acc, d = max(acc, a), d + k * _trips(e)
            found.append(c)
        out = (acc, d, narrowest(found))
        for o in e.outvars:
            state[o] = out
    return [state.get(v, none) if isinstance(v, C.Var) else none for v in jaxpr.outvars]


def tolerance_profile(jaxpr) -> tuple[int, int, np.dtype | None]:
    """``(L, D, compute)`` of a jaxpr: what :mod:`hlofold._base.tolerance` measures a fold by
    (:func:`accumulation_of`, :func:`computes_in`)."""
    return (*accumulation_of(jaxpr), computes_in(jaxpr))


def computes_in(jaxpr) -> np.dtype | None:
    """The narrowest float type a conv/dot of ``jaxpr`` (nested jaxprs included) reads or
    writes: the precision the program computes in (``_base.tolerance``'s ``compute``)."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name in _ACCUMULATING:
            found += [v.aval.dtype for v in (*e.invars[:2], *e.outvars)]
        found += [d for j in subjaxprs(e) if (d := computes_in(j)) is not None]
    return narrowest(found)


def _trips(e) -> int:
    """How many times ``e`` runs its body one after another: a scan's length (its layers
    are as deep as the same layers unrolled), else once."""
    if e.primitive.name == "scan":
        try:
            return max(1, C.scan_layout(e)[2])
        except C.CompatError:
            return 1
    return 1


def _eqn_accumulation(e) -> int:
    if e.primitive.name == "conv_general_dilated":
        k = e.invars[1].aval.shape
        out_feat = k[e.params["dimension_numbers"].rhs_spec[0]]
        return int(np.prod(k)) // max(1, out_feat)
    if e.primitive.name == "dot_general":
        (lc, _), _ = e.params["dimension_numbers"]
        return int(np.prod([e.invars[0].aval.shape[d] for d in lc], dtype=np.int64))
    return 1
