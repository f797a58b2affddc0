"""What each parameter a folded site absorbed was — a normalization's scale (γ), shift (β),
mean (μ) and variance (σ²), and the ε added to σ² — read from the parameter-only computation
each of the chain's steps applies (``fold_params``' report: a quantizer's own passes, such as
AIMET's high-bias absorption, read β and γ by their roles, whatever the leaves are called).

A step's operand gives its leaves a role by the step's kind (:data:`ROLE_OF_STEP`); inside
that computation, leaves under ``rsqrt``/``sqrt`` are the variance (a constant added to it is
ε), and inside a shift a term subtracted or multiplied by the scale is a mean (Keras writes
a BN as ``x·inv + (−μ·inv + β)``, TF as ``x·inv + (β − μ·inv)``). Multiplicative steps are
read first, so a leaf read by several steps keeps the role of its scale.
"""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops

ROLE_OF_STEP = {"mul": "scale", "div": "scale", "sub": "mean", "add": "shift"}
_ORDER = ("mul", "div", "sub", "add")
_VARIANCE = ops.names(lambda o: o.exponent in (-0.5, 0.5))     # rsqrt(σ² + ε), sqrt(…)


def site_roles(steps, producer, leaf_of: dict, value) -> tuple[dict[int, str], float | None]:
    """``({leaf index: role}, ε)`` for a site's affine ``steps`` (back and front);
    ``producer(var)``: its equation or None; ``leaf_of``: parameter var -> leaf index;
    ``value(var)``: a constant's value or None."""
    roles: dict[int, str] = {}
    eps: set[float] = set()
    seen: set = set()

    def walk(v, role: str, depth: int) -> None:
        if depth > 64 or isinstance(v, C.Literal) or (v, role) in seen:
            return
        seen.add((v, role))
        if v in leaf_of:
            roles.setdefault(leaf_of[v], role)
            return
        e = producer(v)
        if e is None:
            return
        name = e.primitive.name
        if name in _VARIANCE:
            role = "variance"
        elif name == "add" and role == "variance":
            for u in e.invars:
                c = _constant(u, producer, leaf_of, value)
                if c is not None:
                    eps.add(c)
        elif name == "sub" and role == "shift":
            walk(e.invars[0], "shift", depth + 1)
            walk(e.invars[1], "mean", depth + 1)
            return
        elif name in ("mul", "div") and role == "shift":
            role = "mean"            # μ·inv inside the shift (the scale's leaves are read)
        for u in e.invars:
            walk(u, role, depth + 1)

    for kind in _ORDER:
        for step in steps:
            if step.kind == kind:
                walk(step.operand.source, ROLE_OF_STEP[kind], 0)
    return roles, (eps.pop() if len(eps) == 1 else None)


def _constant(u, producer, leaf_of, value) -> float | None:
    """A scalar constant operand (a literal, a closed-over value, through casts and
    broadcasts), else None."""
    for _ in range(8):
        if isinstance(u, C.Literal):
            x = np.asarray(u.val)
            break
        if u in leaf_of:
            return None
        e = producer(u)
        if e is None:
            x = value(u)
            if x is None:
                return None
            x = np.asarray(x)
            break
        if e.primitive.name not in ("convert_element_type", "broadcast_in_dim", "reshape"):
            return None
        u = e.invars[0]
    else:
        return None
    return float(x.reshape(-1)[0]) if x.size and np.all(x == x.reshape(-1)[0]) else None
