"""Folding inside nested jaxprs: one rule per higher-order primitive.

``NESTED_RULES[primitive name](scope, eqn, label)`` folds the jaxprs ``eqn`` carries and says
how to rebuild it: ``None`` when nothing changed, else ``(params, at, consts)`` — the new
parameters, and constants (hoisted out of the folded bodies) to insert as new inputs at
position ``at`` — or ``(params, operands)``, every operand given: an outer atom, or a
:class:`~hlofold._fold.jaxpr.stacks.NewValue` (a scanned stack's folded kernels, its unused
operands dropped). ``scope.child(closed, outer, known_mask, label)`` folds
one nested jaxpr whose inputs are the ``outer`` atoms (``known_mask``: which are followed in
as known values; ``values=``: values given instead, ``sites=``: where its records go);
``scope.value(atom)`` is an outer atom's value when known. A primitive without an entry gets
:func:`other_rule`: every closed jaxpr in its parameters is folded with nothing known. Every
read of an equation's parameters goes through ``_compat``.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from hlofold import _compat as C
from .canonical import products
from hlofold._ir.jaxpr.uses import index_uses
from .patterns import PATTERNS
from .steps import AFFINE_STEPS, PASS_STEPS
from hlofold._fold.core.boundary import AFFINE, LAYER, PASS, crosses, made_by, read_by
from hlofold._base.reasons import reason_kind
from hlofold._base.report import REFUSED
from hlofold._fold.core.stacks import layers_differ, mark_layers
from .stacks import stacked_scan

Rule = Callable[[Any, Any, str], "tuple | None"]


def call_rule(scope, eqn, label):
    """jit/pjit, closed_call, custom_jvp/vjp calls: the body sees the call's operands."""
    key, sub = C.call_body(eqn)
    if sub is None:
        return None
    new = scope.child(sub, eqn.invars, [True] * len(eqn.invars), label)
    if new is sub:
        return None
    body, consts = leading_consts(new)
    if consts:       # hoisted, as the other rules do: new parameter values, same program
        params = C.with_call_consts(eqn, body, len(consts))
        if params is not None:
            return params, 0, consts
    return {**eqn.params, key: new}, 0, []       # (its constants stay in its body)


def remat_rule(scope, eqn, label):
    sub = C.closed_jaxpr(C.remat_body(eqn), ())
    new = scope.child(sub, eqn.invars, [True] * len(eqn.invars), label)
    if new is sub:
        return None
    open_j, consts = C.hoist_consts(new)
    return C.with_remat_body(eqn.params, open_j), 0, consts


def cond_rule(scope, eqn, label):
    """Each branch folded; their hoisted constants become leading operands of all."""
    ops = eqn.invars[1:]
    branches = C.cond_branches(eqn)
    news = [scope.child(b, ops, [True] * len(ops), f"cond[{k}]") for k, b in enumerate(branches)]
    if all(n is b for n, b in zip(news, branches)):
        return None
    all_consts = [c for n in news for c in n.consts]
    offs = np.cumsum([0] + [len(n.consts) for n in news]).tolist()
    in_avals = [C.shape_struct(v.aval) for v in ops]
    const_avals = [_struct(c) for c in all_consts]
    new_branches = tuple(with_leading_consts(n, offs[k], offs[k + 1], const_avals, in_avals)
                         for k, n in enumerate(news))
    return C.with_cond_branches(eqn.params, new_branches), 1, all_consts


def scan_rule(scope, eqn, label):
    """The body, with the scan's constants followed in as known (the carry is not); where
    scanned operands (stacked parameters) are known too, one fold per layer, restacked
    (:func:`~hlofold._fold.jaxpr.stacks.stacked_scan`)."""
    sub, nc = C.scan_body(eqn)
    stacked = stacked_scan(scope, eqn, label)
    if isinstance(stacked, tuple):   # rebuilt, or () : planned for fold_params, unchanged
        return stacked or None
    recs: list = []
    new = scope.child(sub, eqn.invars, [k < nc for k in range(len(eqn.invars))], label,
                      sites=recs)
    # one record per site of the body, for every layer; where the layers did not fold
    # alike (``stacked``: why), a site left for its unknown weights says that instead
    for rec in mark_layers(recs, C.scan_layout(eqn)[2]):
        if stacked is not None and rec.status == REFUSED and \
                reason_kind(rec.reason) == "weights-not-known":
            rec.reason = layers_differ(stacked)
    scope.sites.extend(recs)
    if new is sub:
        return None
    body, consts = leading_consts(new)
    return C.with_scan_body(eqn.params, body, len(consts)), 0, consts


def while_rule(scope, eqn, label):
    """The body (not the condition), with its constants followed in as known."""
    sub, cn, bn = C.while_body(eqn)
    body_outer = eqn.invars[cn:]
    new = scope.child(sub, body_outer, [k < bn for k in range(len(body_outer))], label)
    if new is sub:
        return None
    body, consts = leading_consts(new)
    return C.with_while_body(eqn.params, body, len(consts)), cn, consts


def other_rule(scope, eqn, label):
    """Any other primitive carrying closed jaxprs: fold inside with nothing known."""
    new_params, changed = dict(eqn.params), False
    for key, val in eqn.params.items():
        if C.is_closed_param(eqn, key, val):
            new = scope.child(val, [None] * len(val.jaxpr.invars), [False] * len(val.jaxpr.invars),
                        f"{label}.{key}")
            if new is not val:
                new_params[key], changed = new, True
    return (new_params, 0, []) if changed else None


NESTED_RULES: dict[str, Rule] = {
    **{name: call_rule for name in C.JIT_NAMES},
    "custom_jvp_call": call_rule,
    "custom_vjp_call": call_rule,
    "custom_vjp_call_jaxpr": call_rule,
    "checkpoint": remat_rule,
    "remat": remat_rule,
    "remat2": remat_rule,
    "cond": cond_rule,
    "scan": scan_rule,
    "while": while_rule,
}


def dtype_of(c):
    return getattr(c, "dtype", np.asarray(c).dtype)


def _struct(c) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(c), dtype_of(c))


def subjaxprs(eqn):
    """The jaxprs ``eqn`` carries in its parameters (open ones as they are)."""
    for x, closed in C.param_jaxprs(eqn):
        yield x.jaxpr if closed else x


def contains_root(eqn) -> bool:
    """Whether a nested jaxpr of ``eqn`` holds a pattern root (searched once per jaxpr)."""
    for j in subjaxprs(eqn):
        got = _ROOT_CACHE.get(id(j))     # (read once: another thread may clear it)
        if got is None or got[0] is not j:
            if len(_ROOT_CACHE) > 4096:
                _ROOT_CACHE.clear()
            got = (j, any(e.primitive.name in PATTERNS or contains_root(e) for e in j.eqns))
            _ROOT_CACHE[id(j)] = got
        if got[1]:
            return True
    return False


_ROOT_CACHE: dict[int, tuple[Any, bool]] = {}


def leading_consts(closed: C.ClosedJaxpr) -> tuple[C.ClosedJaxpr, list]:
    """``closed`` as a constant-free jaxpr taking its constants as leading inputs, and
    their values (no retrace)."""
    jaxpr, consts = C.hoist_consts(closed)
    return C.closed_jaxpr(jaxpr, ()), consts


def with_leading_consts(closed: C.ClosedJaxpr, lo: int, hi: int, const_avals, in_avals):
    """Rebuild ``closed`` (whose consts are ``all_consts[lo:hi]``) as a const-free closed
    jaxpr taking ``(*all_consts, *inputs)``."""
    n = len(const_avals)

    def fn(*a):
        return C.eval_jaxpr(closed.jaxpr, a[lo:hi], *a[n:])

    return jax.make_jaxpr(fn)(*const_avals, *in_avals)


def inline_calls(closed: C.ClosedJaxpr, at: set[int]) -> C.ClosedJaxpr:
    """``closed`` with the call equations at indices ``at`` (jit/pjit, closed_call; for
    reading, ``checkpoint``: :func:`inline_all`) replaced by their bodies, every body
    variable fresh (one body may be called twice), the bodies' constants appended as
    constvars. Inputs and outputs stay the same variables. This is what the StableHLO path
    does to a private ``func.call`` a chain continues into. A jit's shardings
    (:func:`hlofold._compat.call_constraints`) become sharding constraints on its operands
    and results, as JAX lowers them."""
    jaxpr = closed.jaxpr
    constvars, consts = list(jaxpr.constvars), list(closed.consts)
    sub: dict = {}          # an inlined call's output -> the body's atom for it

    def read(a):
        return sub.get(a, a) if isinstance(a, C.Var) else a

    eqns = []
    for i, eqn in enumerate(jaxpr.eqns):
        if i not in at:
            ins = [read(a) for a in eqn.invars]
            eqns.append(eqn if all(x is y for x, y in zip(ins, eqn.invars)) else
                        eqn.replace(invars=ins))
            continue
        body = _body(eqn)
        env: dict = {}
        for v, c in zip(body.jaxpr.constvars, body.consts):
            env[v] = C.new_var(v.aval)
            constvars.append(env[v])
            consts.append(c)
        cons = C.call_constraints(eqn) or ((), ())   # a jit's shardings: constraints
        ins = list(map(read, eqn.invars))
        for k, sh in enumerate(cons[0]):
            ins[k] = ins[k] if sh is None else _constrained(ins[k], sh, eqns)
        env.update(zip(body.jaxpr.invars, ins))

        def rd(a, env=env):
            return env.get(a, a) if isinstance(a, C.Var) else a
        for e in body.jaxpr.eqns:
            outs = []
            for o in e.outvars:
                if not isinstance(o, C.DropVar):
                    env[o] = C.new_var(o.aval)
                outs.append(env.get(o, o))
            eqns.append(e.replace(invars=[rd(a) for a in e.invars], outvars=outs))
        for k, (o, r) in enumerate(zip(eqn.outvars, body.jaxpr.outvars)):
            sh = cons[1][k] if k < len(cons[1]) else None
            if not isinstance(o, C.DropVar):
                sub[o] = rd(r) if sh is None else _constrained(rd(r), sh, eqns)
    new = jaxpr.replace(constvars=constvars, eqns=eqns,
                        outvars=[read(a) for a in jaxpr.outvars])
    return C.closed_jaxpr(new, consts)


def _constrained(a, sharding, eqns: list):
    """``a`` under a sharding constraint (the equation appended to ``eqns``)."""
    out = C.new_var(a.aval)
    eqns.append(C.constraint_eqn(a, out, sharding))
    return out


def _body(eqn) -> C.ClosedJaxpr:
    if eqn.primitive.name in C.REMAT_NAMES:
        return C.closed_jaxpr(C.remat_body(eqn), ())
    return C.call_body(eqn)[1]


def inline_crossed(closed: C.ClosedJaxpr) -> C.ClosedJaxpr:
    """``closed`` with the calls of :func:`crossed_calls` inlined (and those that inlining
    brings to its top level), or ``closed`` itself."""
    for _ in range(4):
        crossed = crossed_calls(closed.jaxpr)
        if not crossed:
            break
        closed = inline_calls(closed, crossed)
    return closed


def _kind(e):
    name = e.primitive.name
    return LAYER if name in PATTERNS else AFFINE if name in AFFINE_STEPS else \
        PASS if name in PASS_STEPS else None


def crossed_calls(jaxpr) -> set[int]:
    """Indices of the calls of ``jaxpr`` a fold crosses (:func:`hlofold._fold.core.boundary.
    crosses`): forward-only checkpoints (:func:`hlofold._compat.forward_remat`) and jit
    calls that inlining loses nothing of (:func:`hlofold._compat.inlinable_call`: their
    shardings written as constraints) — a
    convolution in a ``@jax.jit`` helper whose BatchNorm the caller applies, a norm's scale
    applied before a helper holding the projection. Inlined (as JAX's lowering inlines
    checkpoints and XLA calls), their layers fold as any other; a gradient later taken of the
    folded program does not rematerialize an inlined checkpoint."""
    found = [(i, e) for i, e in enumerate(jaxpr.eqns)
             if C.forward_remat(e) or C.inlinable_call(e)]
    if not found:
        return set()
    first = lambda e: e.invars[0]           # noqa: E731
    result = lambda e: e.outvars[0]         # noqa: E731
    out = set()
    here_uses, here_prod = index_uses(jaxpr)

    def readers(uses):         # (None: an output)
        return lambda v: [e for e, _ in uses.get(v, [])] if isinstance(v, C.Var) else []

    def producer(prod):
        return lambda v: prod.get(v) if isinstance(v, C.Var) else None
    indexed: dict = {}             # a nested body -> its producers (read once)

    def through(call, v):          # (a call nested in the body: what it returns for v)
        if not (C.forward_remat(call) or C.inlinable_call(call)):
            return None
        inner = _call_jaxpr(call)
        if id(inner) not in indexed:
            indexed[id(inner)] = (inner, producer(index_uses(inner)[1]))
        b = inner.outvars[call.outvars.index(v)]
        return (b, indexed[id(inner)][1]) if isinstance(b, C.Var) else None
    for i, e in found:
        body = _call_jaxpr(e)
        b_uses, b_prod = index_uses(body)
        pairs = [(made_by(a, producer(here_prod), _kind, first, through),
                  read_by(b, readers(b_uses), _kind, result))
                 for a, b in zip(e.invars, body.invars) if isinstance(a, C.Var)]
        pairs += [(made_by(b, producer(b_prod), _kind, first, through),
                   read_by(o, readers(here_uses), _kind, result))
                  for o, b in zip(e.outvars, body.outvars) if isinstance(b, C.Var)]
        if crosses(pairs):
            out.add(i)
    return out


def _call_jaxpr(e):
    return C.remat_body(e) if e.primitive.name in C.REMAT_NAMES else C.call_body(e)[1].jaxpr


def _readable(eqn) -> bool:
    return C.remat_without_consts(eqn) or C.inlinable_call(eqn)


def inline_all(closed: C.ClosedJaxpr) -> C.ClosedJaxpr:
    """``closed`` to be *read* (the pairs of equalization, smoothing, rotation: they rewrite
    parameters, never this program): its inlinable calls (:func:`hlofold._compat.
    inlinable_call`) and ``checkpoint`` (remat) bodies inlined, bodies within bodies too, up
    to a depth of 16 — the layers of a ``@jax.jit`` helper or of ``nn.remat`` blocks pair
    with those around them. (Inlined, a ``checkpoint`` computes the same values; what it
    changes, what a gradient recomputes, is not run here.) The bodies of scans are read the
    same way, each inlined within itself (a layer stack of ``nn.remat`` layers)."""
    for _ in range(16):
        at = {i for i, e in enumerate(closed.jaxpr.eqns) if _readable(e)}
        if not at:
            break
        closed = inline_calls(closed, at)
    closed = products(closed)        # (a scale applied by einsum: the product it is)
    eqns = list(closed.jaxpr.eqns)
    for i, e in enumerate(eqns):
        if e.primitive.name != "scan":
            continue
        try:
            body = C.scan_body(e)[0]
        except C.CompatError:
            continue
        new = inline_all(body)
        if new is not body:
            eqns[i] = e.replace(params=C.with_scan_body(e.params, new, 0))
    if any(a is not b for a, b in zip(eqns, closed.jaxpr.eqns)):
        closed = C.closed_jaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)
    return closed
