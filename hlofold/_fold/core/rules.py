"""The safety rules a fold must pass, shared by the jaxpr and the StableHLO path.

Each rule takes plain values (dtypes, NumPy arrays) and returns ``None`` when the fold is safe,
or the reason it is refused, in words a user can act on. The IR adapters decide *where* a
rule applies; the rule itself lives here once.

* ``scale_refusal``: ``s`` must be finite (σ² = 0 with ε = 0, an inf or NaN γ would turn
  ``0·inf`` into NaN).
* ``precision_refusal``: the folded kernel is rounded to the kernel's dtype. When the chain
  computes in a wider type than the kernel (a bf16 conv with ``preferred_element_type=f32``,
  a bf16 conv followed by a float32 BatchNorm, an fp8 kernel), that rounding loses accuracy
  the unfolded program keeps, so the fold is refused.
* ``round_kernel``: ``K·s`` rounded to the kernel dtype must neither overflow nor
  underflow a whole output channel (fp16 and narrower).
* ``runtime_refusal``: a kernel rescaled in the graph (its parameters are not known at
  transform time) cannot be range-checked before it runs; for dtypes whose range is narrower
  than float32's that is refused.
* ``bias_map_refusal``: a shift in front of a padded convolution folds into a per-position
  bias map, read on every call; it must not cost more than the affine pass it removes.
* ``flushes_differently``: a value computed on the host (float64, IEEE subnormals) must not
  depend on numbers a backend flushes to zero (XLA:CPU and TPUs do: ``rsqrt`` of a
  subnormal σ² is inf there, finite on the host); where it does, the site is refused
  (``SUBNORMAL``).
* ``narrowing_cast``: a cast to a float type that cannot hold the chain's values exactly
  rounds them (or overflows): an affine op after it is not an affine image of the root's
  output, so the chain ends there.
* ``weight_like``: a root read the other way round (a dot's lhs as the weight, Equinox's
  ``W @ x``) is tried only for an operand that is a weight.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

import jax.numpy as jnp

from . import rescale
from hlofold._base.chain_rules import on_axis
from hlofold._base.reasons import Reason

_F32 = jnp.finfo(np.float32)


def scale_refusal(s, what: str = "scale s") -> str | None:
    """``s`` (float64, per channel or scalar) is not finite somewhere."""
    s = np.atleast_1d(np.asarray(s))
    if np.isfinite(s).all():
        return None
    bad = np.flatnonzero(~np.isfinite(s))
    if not bad.size:
        return None
    return Reason("not-finite", f"{what} is not finite at {bad.size} channel(s) (first: "
                  f"{bad[:5].tolist()}); folding would turn 0·inf into NaN")


@functools.lru_cache(maxsize=None)
def _float(dt) -> np.dtype | None:
    dt = np.dtype(dt)
    return dt if jnp.issubdtype(dt, jnp.floating) else None


@functools.lru_cache(maxsize=None)
def _tiny(kd: np.dtype) -> float:
    return float(jnp.finfo(kd).tiny)


def precision_refusal(kernel_dtype, math_dtypes, hint: str = "") -> str | None:
    """The chain computes in a float type wider than the (folded) kernel's dtype."""
    kd = np.dtype(kernel_dtype)
    widths = [d for d in map(_float, math_dtypes) if d is not None]
    if not widths:
        return None
    widest = max(widths, key=lambda d: d.itemsize)
    if widest.itemsize <= kd.itemsize:
        return None
    return Reason("precision", f"the kernel is {kd} but the chain computes in {widest}: K·s "
                  f"rounded to {kd} would lose accuracy the unfolded program keeps{hint}")


def round_kernel(k: np.ndarray, s, kd, axis: int) -> tuple[np.ndarray, str | None]:
    """``K·s`` computed in float64 and rounded once to ``kd`` (``s``: an array broadcasting
    against ``k``, or a list of them, multiplied together), and the reason to refuse it: it
    overflows, or underflows a whole output channel along ``axis`` (None: it is safe). The
    product is formed by :func:`rescale.scaled` (no kernel-sized float64 temporary, large
    kernels on every core); the float64 product is materialized only to explain a result
    with an inf, or with a value below the normal range of ``kd`` where ``K`` is not zero."""
    kd = np.dtype(kd)
    factors = list(s) if isinstance(s, (list, tuple)) else [s]
    kp_cast, suspect = rescale.scaled(k, factors, kd, _tiny(kd))
    if not suspect:
        return kp_cast, None
    with np.errstate(over="ignore", invalid="ignore"):
        kp = np.asarray(k, np.float64)
        for f in factors:
            kp = kp * f
    overflow = np.isfinite(kp) & ~np.isfinite(kp_cast)
    if overflow.any():
        return kp_cast, Reason("overflow", f"the rescaled kernel overflows {kd} at "
                                           f"{int(overflow.sum())} element(s)")
    lost = underflowing_channels(kp, kp_cast, axis)
    if lost.size:
        return kp_cast, Reason("underflow", f"the rescaled kernel underflows {kd} in {lost.size} "
                               f"output channel(s) (first: {lost[:5].tolist()}): K·s falls "
                               f"below the {kd} normal range (unfolded, conv·s is rounded "
                               "instead)")
    return kp_cast, None


def underflowing_channels(kp: np.ndarray, kp_cast: np.ndarray, axis: int) -> np.ndarray:
    """Output channels whose rescaled kernel slice loses more to rounding than rounding to
    normal numbers can lose (4 ulps, L1-relative): ``K·s`` fell into the subnormal range or
    to zero, e.g. a tiny BN scale in fp16. Rounding normal numbers loses at most half an ulp,
    so only underflow is flagged, never ordinary rounding."""
    if kp.size == 0:
        return np.zeros(0, np.int64)
    fi = jnp.finfo(kp_cast.dtype)
    eps = float(fi.eps)
    axes = tuple(a for a in range(kp.ndim) if not on_axis(a, axis))
    # rounding loses more than half an ulp only below the normal range: without a nonzero
    # product rounded there (the common case, one cheap pass), no channel underflows
    with np.errstate(invalid="ignore"):
        small = np.abs(kp_cast) < float(fi.tiny)
    if not small.any() or not (small & (kp != 0)).any():
        return np.zeros(0, np.int64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.sum(np.abs(kp_cast.astype(np.float64) - kp), axis=axes)
        norm = np.sum(np.abs(kp), axis=axes)
        return np.flatnonzero((norm > 0) & (err > 4 * eps * norm))


def runtime_refusal(kernel_dtype) -> str | None:
    """A kernel of this dtype rescaled in the graph cannot be range-checked first."""
    kd = np.dtype(kernel_dtype)
    if _float(kd) is None or jnp.finfo(kd).maxexp >= _F32.maxexp:   # bf16: float32's range
        return None
    return Reason("unchecked-range", f"the {kd} kernel would be rescaled in the graph, where "
                  f"K·s cannot be checked for overflow or underflow of {kd} before it runs; "
                  "fold with the parameters known (freeze=, constants, or a prepare step)")


def bias_map_refusal(map_elems: int, front_elems: int, fused_with: str | None) -> str | None:
    """A bias map is one output's worth of elements (batch 1), read on every call. Folding
    pays where the affine it removes is a pass of its own over at least as many elements;
    an affine computed in the same loop as the op producing its input (XLA fuses elementwise
    ops) costs nothing to remove, so the map would only add work."""
    what = "a shift in front of a padded convolution needs a per-position bias map, and "
    if fused_with is not None:
        return Reason("bias-map", f"{what}the affine is computed in one loop with the "
                      f"{fused_with} producing its input (nothing to save) while the map adds "
                      f"a read of {map_elems} elements per call")
    if map_elems > front_elems:
        return Reason("bias-map", f"{what}the map ({map_elems} elements, read per call) costs "
                      f"more than the affine pass it removes ({front_elems} elements)")
    return None


SUBNORMAL = Reason("subnormal", "a value computed at transform time from these parameters "
                   "depends on numbers that are subnormal in their float type; backends that "
                   "flush subnormals to zero (XLA:CPU, TPUs) compute it otherwise (rsqrt of a "
                   "subnormal variance is inf there), so folding would change the result")


def has_subnormal(a) -> bool:
    """Whether the float array ``a`` holds numbers subnormal in its type (never for another:
    an integer, or an extended dtype — a PRNG key — which NumPy cannot even hold)."""
    dt = getattr(a, "dtype", None)
    if dt is not None and not jnp.issubdtype(dt, jnp.floating):
        return False
    a = np.asarray(a)
    if _float(a.dtype) is None or not a.size:
        return False
    return bool(np.any((a != 0) & (np.abs(a) < _tiny(a.dtype))))


def _flushed(a):
    a = np.asarray(a)
    if _float(a.dtype) is None:
        return a
    return np.where(np.abs(a) < _tiny(a.dtype), np.zeros_like(a) * np.sign(a), a)


def flushes_differently(fn, ins, out) -> bool:
    """Whether the float op ``fn`` (inputs ``ins``, result ``out`` as the host computed it,
    IEEE subnormals honoured) comes out otherwise on a backend that flushes subnormal inputs
    and results to zero. Costs one scan for subnormals unless there are some."""
    if not (has_subnormal(out) or any(has_subnormal(a) for a in ins)):
        return False
    with np.errstate(all="ignore"):
        alt = _flushed(np.asarray(fn(*[_flushed(a) for a in ins])).astype(np.asarray(out).dtype))
    return not np.array_equal(alt, _flushed(out), equal_nan=True)


def narrowing_cast(src, dst, exact_from=None) -> Reason | None:
    """A cast ``src`` → ``dst`` between float types that rounds (fewer mantissa bits) or
    overflows (a smaller range): the chain ends there, the value after it is not an affine
    image of the root's output. ``exact_from``: the narrowest type the value has been since
    the root with nothing absorbed (a cast back to a type holding it is exact)."""
    src, dst = np.dtype(src), np.dtype(dst)
    holds = lambda a, b: (jnp.finfo(a).nmant >= jnp.finfo(b).nmant     # noqa: E731
                          and jnp.finfo(a).maxexp >= jnp.finfo(b).maxexp
                          and jnp.finfo(a).minexp <= jnp.finfo(b).minexp)
    if holds(dst, src) or (exact_from is not None and holds(dst, np.dtype(exact_from))):
        return None
    return Reason("narrowing", f"a cast {src} → {dst} can round or overflow the chain "
                  "value: what follows it is not a per-channel affine image of the root's "
                  "output")


WEIGHT_CONE = 3                                   # ops looked at on each side
WEIGHT_LAYOUT = frozenset({"transpose", "reshape", "convert"})


def weight_like(cone_kinds: Callable, from_root: bool, other_cone_kinds: Callable) -> bool:
    """Whether an operand not known now is the weight of its root (the prepare step binds
    it): it is an input through at most :data:`WEIGHT_CONE` layout ops (``cone_kinds``: the
    kinds of the ops computing it, None beyond the bound), not computed from a root's
    output, and the other operand is computed by more ops (the activations; None beyond).
    The two cones are given as functions computing them, asked only when the answer still
    depends on them."""
    if from_root:
        return False
    kinds = cone_kinds()
    return kinds is not None and all(k in WEIGHT_LAYOUT for k in kinds) and \
        other_cone_kinds() is None
