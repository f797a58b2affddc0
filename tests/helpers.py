"""Assertions shared by the tests: numeric closeness and the structure of folded programs."""
from __future__ import annotations

import numpy as np

import hlofold._compat as C

SCALING = {"mul", "sub", "div", "neg"}


def walk_eqns(closed, fallbacks=False):
    """Every equation of ``closed`` and of every jaxpr nested in it; the fallback branch of
    a folded site's run-time guard (its original equations) only with ``fallbacks``."""
    from hlofold._jaxpr_emit import is_guard
    jaxpr = closed.jaxpr if isinstance(closed, C.ClosedJaxpr) else closed
    for eqn in jaxpr.eqns:
        yield eqn, jaxpr
        if is_guard(eqn) and not fallbacks:
            yield from walk_eqns(eqn.params["branches"][1])
            continue
        for v in eqn.params.values():
            subs = v if isinstance(v, (tuple, list)) else [v]
            for s in subs:
                if isinstance(s, (C.ClosedJaxpr, C.Jaxpr)):
                    yield from walk_eqns(s, fallbacks)


def conv_consumers(closed, root="conv_general_dilated"):
    """For each root equation, the primitive names of the equations reading its output."""
    out = []
    for eqn, jaxpr in walk_eqns(closed):
        if eqn.primitive.name != root:
            continue
        y = eqn.outvars[0]
        users = [e.primitive.name for e in jaxpr.eqns if any(v is y for v in e.invars)]
        if any(v is y for v in jaxpr.outvars):
            users.append("<output>")
        out.append(users)
    return out


def assert_no_scaling_after_convs(closed, root="conv_general_dilated"):
    cons = conv_consumers(closed, root)
    assert cons, "no convolution found"
    for users in cons:
        assert not (set(users) & SCALING), f"a conv output still feeds {users}"


def primitives(closed) -> list[str]:
    return [e.primitive.name for e, _ in walk_eqns(closed)]


def max_err(ref, out) -> float:
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    assert ref.shape == out.shape, (ref.shape, out.shape)
    return float(np.max(np.abs(ref - out))) if ref.size else 0.0


def assert_close(ref, out, rtol=1e-5, atol=1e-6):
    """max|Δ| ≤ rtol·max|ref| + atol (float32 rounding of a folded program)."""
    import jax
    for r, o in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        bound = rtol * float(np.max(np.abs(np.asarray(r, np.float64)))) + atol
        err = max_err(r, o)
        assert err <= bound, f"max|Δ| = {err:.3g} > {bound:.3g}"
