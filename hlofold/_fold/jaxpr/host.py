"""NumPy evaluation of transform-time values, one rule per primitive.

:func:`hlofold.fold_jaxpr` computes what it can at transform time — a BatchNorm's scale
``γ·rsqrt(σ² + ε)`` and shift from frozen or prepared statistics. Dispatching each of those
operations to XLA compiles one small executable per primitive, shape and dtype: on a
ResNet-50 that was most of a first call. The elementwise and shape primitives that
normalization arithmetic uses are evaluated here with NumPy instead. A floating-point
result is computed in float64 and rounded once to the equation's dtype, which for ``+ − × ÷``
and ``sqrt`` is exactly the IEEE result of the operation in that dtype (float64 carries more
than twice the bits of float32); ``rsqrt``, ``exp`` and ``log`` are at least as accurate as
XLA's. Anything else (and any result whose type does not come out as the equation says)
returns ``None``: the caller binds the primitive with JAX.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from hlofold._fold.core.rules import flushes_differently, has_subnormal


def _f64(fn: Callable, *names: str) -> Callable:
    """An elementwise rule computed in float64 (for floating-point results); ``names``: the
    equation params it reads (others, e.g. ``accuracy``, do not change the exact result)."""
    def rule(vals, params, out_dtype):
        if not np.issubdtype(out_dtype, np.floating) or params.get("accuracy") is not None:
            return None
        return fn(*[np.asarray(v, np.float64) for v in vals], **{n: params[n] for n in names})
    rule.arithmetic = True
    return rule


def _shape(fn: Callable) -> Callable:
    """A rule that only moves elements (any dtype)."""
    return lambda vals, params, out_dtype: fn(np.asarray(vals[0]), **params)


def _broadcast_in_dim(x, shape, broadcast_dimensions, **_):
    expanded = [1] * len(shape)
    for src, dst in enumerate(broadcast_dimensions):
        expanded[dst] = x.shape[src]
    return np.broadcast_to(x.reshape(expanded), shape)


def _reshape(x, new_sizes, dimensions=None, **_):
    if dimensions is not None:
        return None
    return x.reshape(new_sizes)


def _convert(vals, params, out_dtype):
    return np.asarray(vals[0]).astype(out_dtype)


# primitive name -> rule(input values, equation params, result dtype) -> value or None
RULES: dict[str, Callable] = {
    "add": _f64(lambda a, b: a + b),
    "sub": _f64(lambda a, b: a - b),
    "mul": _f64(lambda a, b: a * b),
    "div": _f64(lambda a, b: a / b),
    "max": _f64(lambda a, b: np.maximum(a, b)),
    "min": _f64(lambda a, b: np.minimum(a, b)),
    "neg": _f64(lambda a: -a),
    "abs": _f64(np.abs),
    "sqrt": _f64(np.sqrt),
    "rsqrt": _f64(lambda a: 1.0 / np.sqrt(a)),
    "exp": _f64(np.exp),
    "log": _f64(np.log),
    "square": _f64(np.square),
    "integer_pow": _f64(lambda a, y: a ** y, "y"),
    "pow": _f64(lambda a, b: a ** b),
    "reshape": _shape(_reshape),
    "broadcast_in_dim": _shape(_broadcast_in_dim),
    "squeeze": _shape(lambda x, dimensions: np.squeeze(x, tuple(dimensions))),
    "transpose": _shape(lambda x, permutation: np.transpose(x, permutation)),
    "copy": _shape(lambda x: x.copy()),
    "copy_p": _shape(lambda x: x.copy()),
    # the same values with another type (shard_map's varying axes, a sharding)
    "pvary": _shape(lambda x, **_: x),
    "reshard": _shape(lambda x, **_: x),
    "mesh_cast": _shape(lambda x, **_: x),
    "convert_element_type": _convert,
}


def flushes(eqn, vals: Sequence[Any], out: Sequence[Any]) -> bool:
    """Whether ``out`` (``eqn`` on ``vals``, as :func:`evaluate` or JAX computed it) depends on
    subnormal numbers a backend would flush (``_fold.core.rules.flushes_differently``); an
    equation without a NumPy rule here is flagged when any of its values is subnormal."""
    rule = RULES.get(eqn.primitive.name)
    if rule is not None and not getattr(rule, "arithmetic", False):
        return False                   # moves elements only
    if rule is None or len(out) != 1:
        return any(has_subnormal(v) for v in list(vals) + list(out))
    dt = np.asarray(out[0]).dtype
    return flushes_differently(
        lambda *a: np.asarray(rule(a, dict(eqn.params), dt)).astype(dt), vals, out[0])


def evaluate(eqn, vals: Sequence[Any]) -> list[Any] | None:
    """``eqn`` applied to the concrete ``vals`` with NumPy, or None (not covered here)."""
    rule = RULES.get(eqn.primitive.name)
    if rule is None or len(eqn.outvars) != 1:
        return None
    aval = eqn.outvars[0].aval
    out_dtype = np.dtype(aval.dtype)
    with np.errstate(all="ignore"):
        out = rule(vals, dict(eqn.params), out_dtype)
        if out is None:
            return None
        out = np.asarray(out).astype(out_dtype, copy=False)
    if out.shape != tuple(aval.shape):
        return None
    return [out]
