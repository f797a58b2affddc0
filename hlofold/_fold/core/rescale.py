"""The rescaled kernel ``K·f₁·f₂…``: the exact product rounded once to the kernel's dtype.

NumPy, in float64, rounded once into the kernel's dtype (:func:`round_once`), in cache-sized chunks of
``K`` (:data:`CHUNK` elements): no temporary as large as the kernel, and the range check reads
each chunk while it is still in cache. A large kernel's chunks are shared among this
process's cores (NumPy's loops release the GIL; :data:`PARALLEL_MIN`), with no compile and no
memory beyond the result — on a 0.5 B decoder the rescale then costs what writing its result
into fresh memory costs. The result is allocated 64-byte aligned, which is what JAX's CPU
client needs to place a NumPy array without a copy (``jax.device_put`` aliases it).

:func:`scaled` returns ``(K·s rounded, suspect)``: ``suspect`` False means no element is
infinite and none fell below the kernel dtype's normal range where ``K`` is not zero (the
caller then works out, from the exact product, whether that is an overflow or a lost output
channel). ``K`` may be a ``jax.Array`` on the CPU: it is read without a copy.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK = 1 << 16            # elements of K per step (a float64 block of it fits in cache)
PARALLEL_MIN = 1 << 20     # elements; below, one thread (a task costs ~50 µs to hand over)
_ALIGN = 64                # bytes: JAX's CPU client aliases NumPy arrays aligned so


def scaled(k, factors: list, kd, tiny: float) -> tuple[np.ndarray, bool]:
    """``K·f₁·f₂…`` (each factor broadcasting against ``K``) rounded once to ``kd``, and
    whether an element may be out of ``kd``'s normal range (see the module docstring)."""
    kd = np.dtype(kd)
    k = np.asarray(k)
    fs = [np.asarray(f) for f in factors]
    # a factor of ones (the output side of a fold with nothing after its root) changes
    # nothing, not even the rounding: left out
    fs = [f for f in fs if not (f.size == 1 and f.ndim <= k.ndim and f.reshape(()) == 1)]
    if len(fs) == 1 and kd == k.dtype == np.float32 and fs[0].dtype == np.float64:
        with np.errstate(over="ignore"):
            f32 = fs[0].astype(np.float32)
        if np.array_equal(f32, fs[0]):
            # a float32 factor (RMSNorm's γ): the product of two float32 numbers is exact
            # in float64, and IEEE float32 multiplication rounds that exact product once,
            # as _product would: the same bits, at float32 speed (no float64 loop)
            fs = [f32]
    shape = np.broadcast_shapes(k.shape, *[f.shape for f in fs])
    n_out = math.prod(shape)
    # (aligned where a copy would matter: JAX copies a small array anyway)
    out = aligned_empty(shape, kd) if n_out >= CHUNK else np.empty(shape, kd)
    if n_out == 0:
        return out, False
    if n_out <= CHUNK or shape != k.shape or out.ndim == 0:
        # one chunk (or a factor widening K, or a scalar): in one go
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            _product(k, fs, out)
            return out, _suspect(out, k if shape == k.shape else None, tiny)
    k2, fs2, out2 = _as_rows(k, fs, out)
    step = max(1, CHUNK // max(1, out2[0].size))
    n = out2.shape[0]
    workers = _workers() if n_out >= PARALLEL_MIN else 1
    per = -(-n // workers)
    per = -(-per // step) * step                # whole chunks per worker
    parts = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
    if len(parts) == 1:
        return out, _chunks(k2, fs2, out2, 0, n, step, tiny)
    flags = list(_pool().map(lambda p: _chunks(k2, fs2, out2, p[0], p[1], step, tiny), parts))
    return out, any(flags)


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialized array whose data starts on a :data:`_ALIGN`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _as_rows(k: np.ndarray, fs: list, out: np.ndarray):
    """Views of ``K``, the factors and the result with the leading axes along which every
    factor is constant merged into one (a conv kernel's spatial axes: rows to share among
    workers); a factor that varies along the first axis is sliced with it (see _chunks)."""
    fs = [f.reshape((1,) * (k.ndim - f.ndim) + f.shape) for f in fs]
    lead = 0
    while lead < k.ndim - 1 and all(f.shape[lead] == 1 for f in fs):
        lead += 1
    if lead <= 1 or not k.flags.c_contiguous:      # (merging would copy K)
        return k, fs, out
    m = math.prod(k.shape[:lead])
    return (k.reshape((m,) + k.shape[lead:]), [f.reshape((1,) + f.shape[lead:]) for f in fs],
            out.reshape((m,) + k.shape[lead:]))


def _chunks(k, fs, out, lo: int, hi: int, step: int, tiny: float) -> bool:
    """Rows ``lo:hi`` of the result, a chunk of ``step`` rows at a time; whether one of them
    may be out of range."""
    bad = False
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for i in range(lo, hi, step):
            j = min(hi, i + step)
            o = out[i:j]
            _product(k[i:j], [f if f.shape[0] == 1 else f[i:j] for f in fs], o)
            bad = bad or _suspect(o, k[i:j], tiny)
    return bad


def _product(k, fs, out) -> None:
    """``out[...] = K·f₁·f₂…`` formed in float64 and rounded once into ``out``'s dtype
    (call under ``np.errstate``: an overflow is the range check's to report)."""
    if len(fs) == 1 and out.dtype == k.dtype == fs[0].dtype == np.float32:
        np.multiply(k, fs[0], out=out)        # exact product rounded once (see scaled)
        return
    if len(fs) == 1 and out.dtype.itemsize >= 4:
        # NumPy's buffered loop: float64, rounded as it writes
        np.multiply(k, fs[0], dtype=np.float64, casting="unsafe", out=out)
        return
    y = np.asarray(k, np.float64)
    for f in fs:
        y = y * f
    out[...] = round_once(y, out.dtype)


def round_once(y: np.ndarray, kd) -> np.ndarray:
    """``y`` (float64) rounded once to ``kd``. ml_dtypes converts float64 to bfloat16 (and
    the float8 types) through float32: two roundings, wrong in the last bit now and then
    (a product just above a midpoint lands on it, then rounds to even). So types narrower
    than float32 are reached through float32 rounded *to odd* (truncate, set the last bit
    where inexact), which the second rounding to nearest-even rounds as the exact value
    would be: float32 keeps more than two bits beyond every narrower type's mantissa."""
    kd = np.dtype(kd)
    if kd.itemsize >= 4:
        return y.astype(kd)
    t = y.astype(np.float32)
    back = t.astype(np.float64)
    inexact = back != y
    bits = t.view(np.uint32)
    bits -= (inexact & (np.abs(back) > np.abs(y))).astype(np.uint32)
    bits |= inexact.astype(np.uint32)
    return t.astype(kd)


def _suspect(out: np.ndarray, k, tiny: float) -> bool:
    """An inf in ``out``, or a value below ``tiny`` where ``K`` is not zero (``k`` None: K is
    not aligned with ``out``, any such value counts)."""
    a = np.abs(out)
    if np.isinf(a).any():
        return True
    small = a < tiny
    return bool(small.any() and (k is None or (small & (k != 0)).any()))


def _workers() -> int:
    try:
        return max(1, min(16, len(os.sched_getaffinity(0))))
    except AttributeError:                      # (not Linux)
        return max(1, min(16, os.cpu_count() or 1))


_lock = threading.Lock()
_pools: dict = {}


def _pool() -> ThreadPoolExecutor:
    """This process's pool (one per pid: a forked child starts its own, its parent's threads
    are not in it). Safe to share among threads: callers only submit to it."""
    with _lock:
        pool = _pools.get(os.getpid())
        if pool is None:
            _pools.clear()
            pool = _pools[os.getpid()] = ThreadPoolExecutor(_workers(), "hlofold-rescale")
        return pool
