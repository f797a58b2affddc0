"""Spellings the walks read in another form, rewritten before a scope is planned.

A norm's scale applied as ``jnp.einsum("...k,k->...k", y, scale)`` (MaxText's RMSNorm and
LayerNorm) is a ``dot_general`` that contracts nothing: every output element is one product
``y[..., k] · scale[k]``, with the batch axis ``k`` moved first (and moved back by the
``transpose`` einsum puts after it). It is no layer, but the root patterns would read it as
one (its "kernel" the scale) and the chain walks would stop at it. :func:`products` rewrites
each such ``dot_general`` — one operand made of batch axes only — into the same values
spelled as the walks read them: ``x · broadcast(scale)`` in ``x``'s layout, in the dot's
result type, then the dot's transpose (composed with einsum's back: none is left).
Each output element is the same single product, so nothing changes but the spelling; a
scope where nothing folds returns its original program (``_fold.jaxpr.fold``).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from hlofold import _compat as C
from hlofold._fold.core.patterns import product_layout


def _as_product(eqn):
    """:func:`hlofold._fold.core.patterns.product_layout` of a float ``dot_general``."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lc or rc or not lb or eqn.params.get("out_sharding") is not None:
        return None                      # (every layer contracts: read nothing more)
    avals = [getattr(v, "aval", None) for v in eqn.invars]
    if any(a is None or not jnp.issubdtype(a.dtype, jnp.floating)
           for a in avals + [eqn.outvars[0].aval]):
        return None
    return product_layout(len(avals[0].shape), len(avals[1].shape), lc, rc, lb, rb)


def _product_fn(x_first: bool, dims: tuple, vperm: tuple, out_dtype):
    """``x · broadcast(v)`` in ``x``'s own layout, in the dot's result type."""
    def product(a, b):
        x, v = (a, b) if x_first else (b, a)
        if vperm != tuple(range(len(vperm))):
            v = lax.transpose(v, vperm)
        x = lax.convert_element_type(x, out_dtype)
        v = lax.convert_element_type(v, out_dtype)
        return lax.mul(x, lax.broadcast_in_dim(v, x.shape, dims))
    return product


def _inlined(closed, invars, out, source_info) -> list:
    """``closed``'s equations reading ``invars``, its one output written to ``out``."""
    body = closed.jaxpr
    env = dict(zip(body.invars, invars))
    env[body.outvars[0]] = out
    rd = lambda a: env.get(a, a) if isinstance(a, C.Var) else a   # noqa: E731
    eqns = []
    for e in body.eqns:
        outs = [env.setdefault(o, C.new_var(o.aval)) for o in e.outvars]
        eqns.append(e.replace(invars=[rd(a) for a in e.invars], outvars=outs,
                              source_info=source_info))
    return eqns


def _transpose(x, perm, out, source_info) -> list:
    closed = C.trace(lambda a: lax.transpose(a, perm), [x.aval])
    return _inlined(closed, [x], out, source_info)


def products(closed: C.ClosedJaxpr) -> C.ClosedJaxpr:
    """``closed`` with each ``dot_general`` that is a product by a vector of batch axes
    (:func:`_as_product`) written as ``x · broadcast(v)`` in ``x``'s layout, then the
    transpose to the dot's layout — composed with a transpose that reads it alone (einsum's
    back to ``...k``: then none is left); ``closed`` itself where it has none (nested jaxprs
    are rewritten when their scopes are planned)."""
    jaxpr = closed.jaxpr
    found = [(_as_product(e) if e.primitive.name == "dot_general" else None)
             for e in jaxpr.eqns]
    if not any(found):
        return closed
    readers: dict = {}           # a variable -> the equations reading it
    for e in jaxpr.eqns:
        for a in e.invars:
            if isinstance(a, C.Var):
                readers.setdefault(a, []).append(e)
    outputs = {a for a in jaxpr.outvars if isinstance(a, C.Var)}   # (keep their layout)
    sub: dict = {}           # a result -> the variable holding its values now
    pending: dict = {}       # a dot's result read by one transpose -> (product, perm)
    rd = lambda a: sub.get(a, a) if isinstance(a, C.Var) else a   # noqa: E731
    eqns = []
    for e, f in zip(jaxpr.eqns, found):
        if f is None and e.primitive.name == "transpose" and e.invars[0] in pending:
            t, p1 = pending.pop(e.invars[0])
            q = tuple(p1[k] for k in e.params["permutation"])
            if q == tuple(range(len(q))):
                sub[e.outvars[0]] = t
            else:
                eqns.extend(_transpose(t, q, e.outvars[0], e.source_info))
            continue
        if f is None:
            ins = [rd(a) for a in e.invars]
            eqns.append(e if all(x is y for x, y in zip(ins, e.invars)) else
                        e.replace(invars=ins))
            continue
        xi, perm, vi, vb, xb = f
        x, v, out = rd(e.invars[xi]), rd(e.invars[vi]), e.outvars[0]
        order = sorted(range(len(vb)), key=lambda k: xb[k])
        fn = _product_fn(xi == 0, tuple(xb[k] for k in order), tuple(vb[k] for k in order),
                         out.aval.dtype)
        t = C.new_var(x.aval.update(dtype=out.aval.dtype, weak_type=False))
        ins = [x, v] if xi == 0 else [v, x]
        eqns.extend(_inlined(C.trace(fn, [a.aval for a in ins]), ins, t, e.source_info))
        if perm == tuple(range(len(perm))):
            sub[out] = t
        elif out not in outputs and len(rs := readers.get(out, [])) == 1 and \
                rs[0].primitive.name == "transpose":
            pending[out] = (t, perm)
        else:
            eqns.extend(_transpose(t, perm, out, e.source_info))
    outvars = [rd(a) for a in jaxpr.outvars]
    return C.closed_jaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), closed.consts)
