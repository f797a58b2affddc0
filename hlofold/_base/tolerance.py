"""The one tolerance model of hlofold: when a folded output counts as the original's.

Used by ``hlofold.fold(..., verify=True)``, by ``hlofold.verify`` (and the CLI's ``verify``)
and by the test suite. A folded program computes the same sums in another order and rounds
the kernel once more (``K·s`` instead of ``conv(x, K)·s``), so its error against the original
grows like rounding noise over the longest accumulation ``L`` (the largest
``C_in/G · kernel window`` of a convolution, or contraction size of a dot) and with the depth
``D`` (accumulating ops one after another on the longest path):

    max|folded − original| ≤ min(eps·(8 + 2·√L)·(D + 1), 1/8) · max|original| + eps·1e-3

over the finite values, with NaN/inf at the same places; non-float outputs compare exactly.
Each **slice** of the output along an axis of up to 65,536 entries (a channel, a token, a
class) must also stay within 1/8 of its own ``max|original|`` plus a quarter of that bound:
a fold wrong in one channel of small magnitude errs by that channel's order, which the whole
output's scale would hide (in bf16 the bound is capped at 1/8 of the whole output's scale,
the error of a sign flipped in a channel 1/20 of it is not), while rounding, far below the
bound in any one slice, does not fail it.
``eps`` is the machine epsilon of the output's dtype or, when the convolutions and dots that
output is computed from run in a narrower float type (bf16/fp16 under float32 outputs: a
mixed-precision model's logits), of that type (``compute``, per output: a float32 output
beside a bf16 one keeps float32's): the fold rounds the kernel to the type it computes in,
and the original's own error is of that type's order; across backends (a GPU against the CPU original)
float32 may run as TF32 on tensor cores, so cross-backend checks use eps = 2⁻¹⁰ for float32
on GPUs. The relative part is capped at 1/8: a wrong fold (a wrong scale or bias) errs by
O(max|original|), which must always fail, also in bfloat16 over long accumulations.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


CAP = 1 / 8
_BLOCK = 1 << 16       # elements compared at a time
_SLICED = 1 << 22      # outputs up to this size are also compared slice by slice
_SLICE_AXIS = 65536    # axes up to this long are sliced


def eps(dtype, backend: str = "cpu", cross: bool = False, compute=None) -> float:
    """The rounding unit of the model for outputs of ``dtype`` (0 for non-float dtypes) from a
    program computing in ``compute`` (None: in the output's type)."""
    dt = np.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        return 0.0
    e = 2.0 ** -10 if cross and backend == "gpu" and dt == np.float32 else \
        float(jnp.finfo(dt).eps)
    if compute is not None and jnp.issubdtype(np.dtype(compute), jnp.floating):
        e = max(e, float(jnp.finfo(np.dtype(compute)).eps))
    return e


def narrowest(dtypes) -> np.dtype | None:
    """The float type of ``dtypes`` with the largest epsilon (None: no float type)."""
    floats = [np.dtype(d) for d in dtypes if d is not None
              and jnp.issubdtype(np.dtype(d), jnp.floating)]
    return max(floats, key=lambda d: float(jnp.finfo(d).eps), default=None)


def bound(dtype, scale: float, accumulation: int = 1, depth: int = 0, backend: str = "cpu",
          cross: bool = False, compute=None) -> float:
    """The largest ``max|Δ|`` the model allows for outputs of magnitude ``scale``."""
    e = eps(dtype, backend, cross, compute)
    rel = min(e * (8 + 2 * math.sqrt(max(accumulation, 1))) * (max(depth, 0) + 1), CAP)
    return rel * scale + e * 1e-3


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One output against its reference under the model."""
    max_abs: float
    max_rel: float             # max_abs / max|ref|
    eps_units: float           # max_abs / (eps · max|ref|)
    bound: float
    finite: float              # fraction of the values finite in both
    why: str | None            # None: within the model

    @property
    def passed(self) -> bool:
        return self.why is None


def compare(ref, out, accumulation: int = 1, depth: int = 0, backend: str = "cpu",
            cross: bool = False, compute=None) -> Comparison:
    """``out`` against ``ref`` under the model (see the module docstring)."""
    r, o = np.asarray(ref), np.asarray(out)
    if r.shape != o.shape or r.dtype != o.dtype:
        return Comparison(math.inf, math.inf, math.inf, 0.0, 0.0,
                          f"{o.dtype}{list(o.shape)} instead of {r.dtype}{list(r.shape)}")
    e = eps(r.dtype, backend, cross, compute)
    if e == 0.0:
        same = np.array_equal(r, o)
        return Comparison(0.0 if same else math.inf, 0.0 if same else math.inf, 0.0, 0.0,
                          1.0, None if same else "values differ")
    max_abs = scale = 0.0
    n_finite, same_specials = 0, True
    rf, of = r.reshape(-1), o.reshape(-1)
    for i in range(0, rf.size, _BLOCK):       # in blocks: no float64 copy of an output
        rb, ob = rf[i:i + _BLOCK].astype(np.float64), of[i:i + _BLOCK].astype(np.float64)
        finite = np.isfinite(rb) & np.isfinite(ob)
        n_finite += int(finite.sum())
        if finite.any():
            d = np.subtract(rb, ob, out=np.zeros_like(rb), where=finite)
            max_abs = max(max_abs, float(np.abs(d).max()))
            scale = max(scale, float(np.abs(rb, out=d, where=finite).max()))
        same_specials = same_specials and np.array_equal(np.isnan(rb), np.isnan(ob)) and \
            np.array_equal(np.where(np.isinf(rb), rb, 0), np.where(np.isinf(ob), ob, 0))
    tol = bound(r.dtype, scale, accumulation, depth, backend, cross, compute)
    why = None
    if not same_specials:
        why = "NaN/inf at other places"
    elif max_abs > tol:
        why = f"max|Δ| = {max_abs:.3g} > {tol:.3g}"
    elif 0 < r.size <= _SLICED and r.ndim and scale > 0:
        why = _slice_mismatch(r, o, tol)
    return Comparison(max_abs, max_abs / scale if scale else 0.0,
                      max_abs / (e * scale) if scale else 0.0, tol,
                      n_finite / r.size if r.size else 1.0, why)


def _slice_mismatch(r, o, tol: float) -> str | None:
    """The slice (along an axis of up to ``_SLICE_AXIS`` entries) whose error exceeds a
    quarter of ``tol`` (the whole output's bound) plus ``CAP`` of its own ``max|original|``."""
    rb, ob = r.astype(np.float64), o.astype(np.float64)
    finite = np.isfinite(rb) & np.isfinite(ob)
    d = np.where(finite, np.abs(rb - ob), 0.0)
    a = np.where(finite, np.abs(rb), 0.0)
    for axis, n in enumerate(r.shape):
        if not 1 < n <= _SLICE_AXIS:
            continue
        others = tuple(i for i in range(r.ndim) if i != axis)
        err, loc = d.max(axis=others), a.max(axis=others)
        lim = CAP * loc + tol / 4
        over = np.nonzero(err > lim)[0]
        if over.size:
            j = int(over[np.argmax((err / lim)[over])])
            return (f"slice {j} of axis {axis}: max|Δ| = {err[j]:.3g} > {lim[j]:.3g} "
                    f"(1/8 of the slice's max|original| {loc[j]:.3g}, and 1/4 of the bound)")
    return None


def mismatch(ref, out, accumulation: int = 1, depth: int = 0, compute=None) -> str | None:
    """Why ``out`` is not ``ref`` under the model (None: it is)."""
    return compare(ref, out, accumulation, depth, compute=compute).why


def random_inputs(specs, seed: int = 0, signed: bool = False) -> list[np.ndarray]:
    """Inputs for checking a module: integers and booleans 0/1, floats in [0.5, 1.5]
    (positive: an input may be a BatchNorm variance, whose rsqrt must not be NaN), or with
    ``signed`` from a standard normal (both sides of a ReLU: the activations of a model)."""
    rng = np.random.default_rng(seed)
    out = []
    for sp in specs:
        dt = np.dtype(sp.dtype)
        if np.issubdtype(dt, np.integer) or dt == np.bool_:
            out.append(rng.integers(0, 2, sp.shape).astype(dt))
        elif signed:
            out.append(rng.standard_normal(sp.shape).astype(dt))
        else:
            out.append(rng.uniform(0.5, 1.5, sp.shape).astype(dt))
    return out
