"""The tolerance of ``hlofold.fold(..., verify=True)``: when a folded output counts as the
original program's (NaN/inf at the same places, finite values within a bound by dtype)."""
from __future__ import annotations

import jax
import numpy as np


def verify_tolerance(dtype) -> tuple[float, float] | None:
    """``(rtol, atol)`` for ``fold(..., verify=True)``: an output of this dtype passes when
    ``max|Δ| ≤ rtol·max|ref| + atol`` over its finite values. ``None``: compared exactly.

    float32/float64 ``(1e-4, 1e-5)``; float16 ``(1e-2, 1e-3)`` (10 ulps); bfloat16
    ``(6e-2, 6e-3)`` (8 ulps): room for the rounding a fold moves through a deep network,
    far below the error of a wrong fold (a wrong scale or bias errs by O(max|ref|)).
    """
    dt = np.dtype(dtype)
    if dt == np.dtype(jax.numpy.bfloat16):
        return 6e-2, 6e-3
    if dt == np.dtype(np.float16):
        return 1e-2, 1e-3
    if jax.numpy.issubdtype(dt, jax.numpy.inexact):
        return 1e-4, 1e-5
    return None


def mismatch(ref, out) -> str | None:
    """Why ``out`` is not ``ref`` within :func:`verify_tolerance` (None: it is)."""
    r, o = np.asarray(ref), np.asarray(out)
    if r.shape != o.shape or r.dtype != o.dtype:
        return f"{o.dtype}{list(o.shape)} instead of {r.dtype}{list(r.shape)}"
    tol = verify_tolerance(r.dtype)
    if tol is None:
        return None if np.array_equal(r, o) else "values differ"
    r, o = r.astype(np.float64), o.astype(np.float64)
    if not (np.array_equal(np.isnan(r), np.isnan(o)) and
            np.array_equal(np.where(np.isinf(r), r, 0), np.where(np.isinf(o), o, 0))):
        return "NaN/inf at other places"
    fin = np.isfinite(r)
    if not fin.any():
        return None
    err = float(np.max(np.abs(r[fin] - o[fin])))
    bound = tol[0] * float(np.max(np.abs(r[fin]))) + tol[1]
    return None if err <= bound else f"max|Δ| = {err:.3g} > {bound:.3g}"
