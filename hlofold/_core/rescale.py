"""The rescaled kernel ``K·f₁·f₂…``: the exact product rounded once to the kernel's dtype.

Two ways, with the same result:

* small kernels: NumPy, in float64, rounded into the kernel's dtype as it is written (one
  factor: NumPy's buffered loop; several, or a dtype NumPy cannot round into: blocks of
  ``K`` along its leading axis) — no temporary as large as the kernel;
* kernels of :data:`XLA_MIN` elements or more: one XLA program on the host CPU
  (``convert → multiply in float64 → convert`` fused, on every core, in blocks of
  :data:`XLA_BLOCK` elements: no temporary beyond one block), 6–10× faster than NumPy's
  buffered loop on a 0.5 B model, rounded once to the kernel's dtype as NumPy rounds
  (:func:`_round_once`). XLA:CPU flushes subnormal numbers to zero, so the program also
  reports whether any element may be out of the kernel dtype's normal range (an inf or NaN,
  a result below the normal range where ``K`` is not zero, a subnormal element of ``K``:
  read from the bits, which flushing does not touch); the caller then works the exact
  product out in NumPy, as for small kernels.

Both return ``(K·s rounded, suspect)``: ``suspect`` False means no element overflowed and
none fell below the normal range where ``K`` is not zero. The XLA way returns a
``jax.Array`` on the host CPU (NumPy reads it without a copy; placing it on a device or
handing it to a jitted program needs none either), and takes ``K`` as a ``jax.Array`` on the
CPU without a copy.
"""
from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

XLA_MIN = 1 << 22          # elements; below it one compile costs more than NumPy's loop
_CHUNK = 1 << 16
XLA_BLOCK = 1 << 20       # elements of K per step of the XLA program (see _blocked)


def scaled(k: np.ndarray, factors: list, kd, tiny: float) -> tuple[np.ndarray, bool]:
    """``K·f₁·f₂…`` (each factor broadcasting against ``K``) rounded once to ``kd``, and
    whether an element may be out of ``kd``'s normal range (see the module docstring)."""
    kd = np.dtype(kd)
    if np.size(k) >= XLA_MIN and _xla_can(np.dtype(k.dtype), kd, factors):
        try:
            return _scaled_xla(k, factors, kd, tiny)
        except ValueError:      # no placement here (tracing inside shard_map): NumPy
            pass
    out = scaled_numpy(k, factors, kd)
    return out, may_be_out_of_range(out, k, tiny)


def _xla_can(k_dtype: np.dtype, kd: np.dtype, factors: list) -> bool:
    shape = np.broadcast_shapes(*[np.shape(f) for f in factors]) if factors else ()
    return (jnp.issubdtype(k_dtype, jnp.floating) and jnp.issubdtype(kd, jnp.floating)
            and k_dtype.itemsize in (1, 2, 4, 8) and len(shape) <= 8)


def _scaled_xla(k, factors, kd, tiny):
    cpu = jax.local_devices(backend="cpu")[0]     # this process's: no other takes part
    lead, fs = _blocked(np.shape(k), [np.asarray(f, np.float64) for f in factors])
    rows = _rows(int(np.prod(np.shape(k)[:lead])), int(np.prod(np.shape(k)[lead:])))
    key = (np.shape(k), np.dtype(k.dtype), kd, tiny, lead, rows, tuple(f.shape for f in fs))
    with jax.ensure_compile_time_eval(), jax.enable_x64(True):   # (placed, not staged)
        fs = [jax.device_put(f, cpu) for f in fs]
        k = k if _on_cpu(k) else jax.device_put(k, cpu)
    with jax.enable_x64(True):
        # compiled outside ensure_compile_time_eval, where scalars the program's tracing
        # makes would be built eagerly and kept as its constants; a Compiled runs on its
        # arguments, also inside an outer trace. After the first, this is a cache hit.
        program = _rescale.lower(k, fs, kd=kd, tiny=float(tiny), lead=lead,
                                 rows=rows).compile()
        if key not in _compiled:    # a new program: its compile's memory goes back
            _compiled.add(key)      # before the result is placed
            release_freed()
        out, suspect = program(k, fs)
        return out, bool(suspect)


_compiled: set = set()


def release_freed() -> None:
    """Hand the memory the C allocator keeps after XLA's compiles and runs back to the
    system (glibc's ``malloc_trim``; elsewhere nothing), so that a rescaled kernel is not
    placed on top of it: preparing parameters then grows the process by the new kernels and
    little else."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _blocked(shape: tuple, factors: list) -> tuple[int, list]:
    """The program walks ``K`` in blocks of :data:`XLA_BLOCK` elements or fewer along its
    leading ``lead`` axes taken as one (a full-size mask of the range check would otherwise be
    a temporary a quarter of a float32 kernel's size: XLA:CPU does not fuse a reduction with
    its operand). Returns ``lead`` and the factors with those axes merged as ``K``'s are."""
    fs = [f.reshape((1,) * (len(shape) - f.ndim) + f.shape) for f in factors]
    if not shape or 0 in shape or \
            np.broadcast_shapes(shape, *[f.shape for f in fs]) != tuple(shape):
        return 0, factors            # one block (empty, or a factor widening K: not blocked)
    lead = 1
    while lead < len(shape) - 1 and int(np.prod(shape[lead:])) > XLA_BLOCK:
        lead += 1
    merged = int(np.prod(shape[:lead]))
    return lead, [f.reshape((1,) + f.shape[lead:]) if all(d == 1 for d in f.shape[:lead]) else
                  np.broadcast_to(f, shape[:lead] + f.shape[lead:]).reshape(
                      (merged,) + f.shape[lead:]) for f in fs]


def _rows(n: int, row: int) -> int:
    """Rows of ``row`` elements per block: the largest divisor of ``n`` with at most
    :data:`XLA_BLOCK` elements (every block alike: one loop body, no remainder)."""
    rows = max(1, min(n, XLA_BLOCK // max(1, row)))
    return next(r for r in range(rows, 0, -1) if n % r == 0)


def _on_cpu(k) -> bool:
    return isinstance(k, jax.Array) and k.is_fully_addressable and \
        {d.platform for d in k.devices()} == {"cpu"}


@functools.partial(jax.jit, static_argnames=("kd", "tiny", "lead", "rows"))
def _rescale(k, factors, *, kd, tiny, lead, rows):
    shape = k.shape
    n = int(np.prod(shape[:lead])) // rows          # blocks (lead 0: one)
    if n == 1:
        return _rescale_block(k, factors, kd, tiny)

    def split(x):               # (merged leading axes) -> (blocks, rows, ...)
        return x.reshape((n, rows) + x.shape[1:] if x.shape[0] != 1 else (1,) + x.shape)
    fs = [split(f) for f in factors]

    def block(xs):              # a factor along the blocked axes comes with its block
        kb, along = xs
        it = iter(along)
        return _rescale_block(kb, [next(it) if f.shape[0] != 1 else f[0] for f in fs], kd, tiny)
    out, bad = jax.lax.map(block, (split(k.reshape((-1,) + shape[lead:])),
                                   [f for f in fs if f.shape[0] != 1]))
    return out.reshape(shape), jnp.any(bad)


def _rescale_block(k, factors, kd, tiny):
    y = k.astype(jnp.float64)
    for f in factors:
        y = y * f
    out = _round_once(y, kd)
    kdt = np.dtype(k.dtype)
    nbits = 8 * kdt.itemsize
    uint = jnp.dtype(f"uint{nbits}")
    mag = jax.lax.bitcast_convert_type(k, uint) & uint.type((1 << (nbits - 1)) - 1)
    a = jnp.abs(out)
    bad = (a == jnp.inf) | jnp.isnan(out) | ((mag != 0) & ((a < tiny) | (mag < uint.type(1 << int(
        jnp.finfo(kdt).nmant)))))
    return out, jnp.any(bad)


def _round_once(y, kd):
    """``y`` (float64) rounded once to ``kd``. XLA converts float64 to a type narrower than
    float32 through float32 (two roundings: wrong in the last bit now and then), so round to
    float32 *to odd* first (truncate, set the last bit where inexact), which the second
    rounding to nearest-even then rounds as the exact value would be: float32 keeps more
    than two bits beyond every narrower type's mantissa."""
    if np.dtype(kd).itemsize >= 4:
        return y.astype(kd)
    t = y.astype(jnp.float32)
    back = t.astype(jnp.float64)
    inexact = back != y
    bits = jax.lax.bitcast_convert_type(t, jnp.uint32)
    bits = jnp.where(inexact & (jnp.abs(back) > jnp.abs(y)), bits - jnp.uint32(1), bits)
    bits = jnp.where(inexact, bits | jnp.uint32(1), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(kd)


def scaled_numpy(k: np.ndarray, factors: list, kd) -> np.ndarray:
    """``K·f₁·f₂…`` in float64 with NumPy, rounded once into ``kd``. One factor: NumPy's
    buffered loop computes in float64 and casts as it writes; several: blocks of ``K`` along
    its leading axis (each factor broadcasts against ``K``, size 1 or full there), so no
    temporary is as large as the kernel."""
    out = np.empty(np.broadcast_shapes(np.shape(k), *[np.shape(f) for f in factors]), kd)
    with np.errstate(over="ignore", invalid="ignore"):
        try:
            if len(factors) == 1:
                return np.multiply(k, factors[0], dtype=np.float64, casting="unsafe", out=out)
        except TypeError:        # a dtype NumPy cannot round into directly: blocks below
            pass
        if out.ndim == 0:
            out[()] = np.prod([np.float64(np.asarray(k))] + [np.float64(f) for f in factors])
            return out
        rows = max(1, _CHUNK // max(1, out[0].size))
        for i in range(0, out.shape[0], rows):
            blk = np.array(k[i:i + rows] if np.shape(k)[0] != 1 else k, np.float64)
            for f in factors:
                f = np.asarray(f)
                blk = blk * (f if f.ndim == 0 or f.shape[0] == 1 else f[i:i + rows])
            out[i:i + rows] = blk.astype(kd)
    return out


def may_be_out_of_range(kp_cast: np.ndarray, k: np.ndarray, tiny: float) -> bool:
    """Whether ``kp_cast`` (``K·s`` rounded) holds an inf, or a value below ``tiny`` where
    ``K`` is not zero (an exact zero of the kernel stays zero: nothing to check). Read in
    cache-sized chunks: no temporary as large as the kernel."""
    same = np.shape(k) == kp_cast.shape
    flat = kp_cast.reshape(-1)
    kflat = np.asarray(k).reshape(-1) if same else None
    for i in range(0, flat.size, _CHUNK if same else max(flat.size, 1)):
        a = np.abs(flat[i:i + _CHUNK] if same else flat)
        if np.isinf(a).any():
            return True
        small = a < tiny
        if small.any() and (not same or (small & (kflat[i:i + _CHUNK] != 0)).any()):
            return True
    return False
