"""Accuracy of low-precision folding, measured against a float32 reference.

In bf16/fp16 the folded kernel ``K ⊙ s`` is rounded to the kernel dtype once, where the
unfolded program rounds ``conv(x, K)`` and then each BN op. Neither equals the float32
result; what matters is whether folding makes the error worse. ``float32_reference`` runs
the *same* program with every bf16/fp16 value carried in float32 instead, and
``measure`` compares the unfolded and folded programs against it.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlofold import _compat as C
from hlofold._ir.jaxpr import ops
from hlofold._fold.jaxpr.nested import subjaxprs

_LOW = (np.dtype(jnp.bfloat16), np.dtype(np.float16))
_REMAT = ops.names(lambda o: o.call == "remat")
_CALLS = ops.names(lambda o: o.call is not None)


class ReferenceUnavailable(Exception):
    """The program holds constructs the float32 interpreter does not handle."""


def _is_low(dtype) -> bool:
    try:
        return np.dtype(dtype) in _LOW
    except TypeError:
        return False


def _up(x):
    return lax.convert_element_type(x, jnp.float32) if _is_low(getattr(x, "dtype", None)) else x


def _eval_f32(jaxpr: C.Jaxpr, consts: Sequence[Any], *args):
    env: dict[Any, Any] = {}

    def read(a):
        if isinstance(a, C.Literal):      # its aval's dtype, not its Python value's
            return np.float32(a.val) if _is_low(a.aval.dtype) else a.val
        return env[a]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = _up(c)
    for v, a in zip(jaxpr.invars, args):
        env[v] = _up(a)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        prim, params = eqn.primitive.name, eqn.params
        if prim == "convert_element_type" and _is_low(params["new_dtype"]):
            outs = [lax.convert_element_type(invals[0], jnp.float32)]   # from any dtype
        elif prim in _CALLS:
            if prim in _REMAT:
                outs = _eval_f32(C.remat_body(eqn), (), *invals)
            elif (sub := C.call_body(eqn)[1]) is not None:
                outs = _eval_f32(sub.jaxpr, sub.consts, *invals)
            else:
                raise ReferenceUnavailable(f"{prim} without a jaxpr")
        else:
            if any(True for _ in subjaxprs(eqn)):
                raise ReferenceUnavailable(f"{prim} (control flow) is not interpreted")
            for key in ("preferred_element_type", "dtype"):   # dot/conv; iota and friends
                if _is_low(params.get(key)):
                    params = {**params, key: np.dtype(np.float32)}
            outs = C.bind_eqn(eqn, invals, params)
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, C.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def float32_reference(closed: C.ClosedJaxpr):
    """A jitted function computing ``closed`` with bf16/fp16 carried in float32."""
    return jax.jit(lambda *a: _eval_f32(closed.jaxpr, closed.consts, *a))


def measure(original: C.ClosedJaxpr, folded_fn, leaves: Sequence[Any]) -> dict:
    """Max errors of the unfolded and folded programs against the float32 reference.

    Returns a JSON-ready dict; ``ratio`` is folded error / unfolded error (≤ 1: folding did
    not make the low-precision program less accurate).
    """
    try:
        ref = float32_reference(original)(*leaves)
    except ReferenceUnavailable as e:
        return {"reference": None, "reason": str(e)}
    unfolded = jax.jit(C.jaxpr_as_fun(original))(*leaves)
    folded = folded_fn(*leaves)
    err_u = err_f = scale = 0.0
    sq_u = sq_f = 0.0
    n = 0
    for r, u, f in zip(ref, unfolded, folded):
        if not jnp.issubdtype(jnp.result_type(r), jnp.floating):
            continue
        r64 = np.asarray(r, np.float64)
        du = np.abs(np.asarray(u, np.float64) - r64)
        df = np.abs(np.asarray(f, np.float64) - r64)
        err_u, err_f = max(err_u, float(du.max(initial=0))), max(err_f, float(df.max(initial=0)))
        sq_u, sq_f, n = sq_u + float(np.sum(du ** 2)), sq_f + float(np.sum(df ** 2)), n + du.size
        scale = max(scale, float(np.max(np.abs(r64), initial=0)))
    return {"reference": "float32", "max_abs_err_unfolded": err_u,
            "max_abs_err_folded": err_f, "max_abs_ref": scale,
            "rms_err_unfolded": (sq_u / n) ** 0.5 if n else 0.0,
            "rms_err_folded": (sq_f / n) ** 0.5 if n else 0.0,
            "rel_err_unfolded": err_u / scale if scale else 0.0,
            "rel_err_folded": err_f / scale if scale else 0.0,
            "ratio": err_f / err_u if err_u else (0.0 if err_f == 0 else float("inf"))}
