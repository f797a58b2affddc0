"""The rescaled kernel: the product in float64, rounded once into the kernel dtype, in
chunks shared among threads, gives the bits of the whole product rounded at once, and says
when the product may leave the kernel dtype's normal range.

``rescale.PARALLEL_MIN`` is lowered to 0 and ``rescale.CHUNK`` to a few elements here, so
kernels of test size are split into many chunks over several workers."""
import os
import threading
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hlofold._fold.core import rescale, rules

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, ml_dtypes.float8_e4m3fn]


@pytest.fixture
def chunked(monkeypatch):
    monkeypatch.setattr(rescale, "PARALLEL_MIN", 0)
    monkeypatch.setattr(rescale, "CHUNK", 64)
    monkeypatch.setattr(rescale, "_workers", lambda: 3)
    monkeypatch.setattr(rescale, "_pools", {})


def _tiny(kd):
    return float(ml_dtypes.finfo(kd).tiny)


def _whole(k, fs, kd):
    """The reference: the whole product in float64, then rounded once."""
    with np.errstate(over="ignore"):
        y = np.asarray(k, np.float64)
        for f in fs:
            y = y * f
        return y.astype(kd)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n_factors", [1, 2])
def test_chunks_match_the_whole_product_bit_for_bit(chunked, dtype, n_factors):
    rng = np.random.default_rng(0)
    # normal numbers of every dtype here (float8's normal range starts at 2**-6)
    k = (rng.choice([-1, 1], (3, 3, 16, 64)) * rng.uniform(0.1, 4, (3, 3, 16, 64))).astype(dtype)
    # factors with many significant bits: the product must be rounded once, not twice
    fs = [rng.uniform(0.3, 3.0, (1, 1, 1, 64)) * (1 + 2.0 ** -40) for _ in range(n_factors)]
    out, suspect = rescale.scaled(k, fs, np.dtype(dtype), _tiny(dtype))
    assert isinstance(out, np.ndarray) and not suspect
    ref = _whole(k, fs, np.dtype(dtype))
    assert out.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES[1:3] + DTYPES[4:], ids=lambda d: np.dtype(d).name)
def test_rounded_once_near_halfway(chunked, dtype):
    """Just below (above) the midpoint of two neighbours the product rounds down (up):
    rounding to float32 first would land on the midpoint and then round to even."""
    info = ml_dtypes.finfo(dtype)
    lo = np.arange(1, 200, dtype=np.float64).astype(dtype)            # normal numbers
    lo = np.unique(lo[np.isfinite(lo.astype(np.float64))])
    uint = np.dtype(f"uint{8 * lo.dtype.itemsize}")
    hi = (lo.view(uint) + 1).astype(uint).view(lo.dtype)                # next one up
    lo, hi = lo[np.isfinite(hi.astype(np.float64))], hi[np.isfinite(hi.astype(np.float64))]
    mid = (lo.astype(np.float64) + hi.astype(np.float64)) / 2
    eps = 2.0 ** -36
    for side, want in ((1 - eps, lo), (1 + eps, hi)):
        k = np.ones((mid.size,), dtype)
        out, _ = rescale.scaled(k, [mid * side], np.dtype(dtype), float(info.tiny))
        np.testing.assert_array_equal(np.asarray(out).astype(np.float64),
                                      want.astype(np.float64))


def test_takes_a_cpu_array_without_a_copy_and_gives_one_jax_places_without_a_copy(chunked):
    k = jax.device_put(np.linspace(-2, 2, 4096, dtype=np.float32).reshape(64, 64),
                       jax.devices("cpu")[0])
    s = np.linspace(0.5, 1.5, 64)
    out, suspect = rescale.scaled(k, [s], np.dtype(np.float64), _tiny(np.float64))
    assert not suspect
    np.testing.assert_array_equal(out, np.asarray(k, np.float64) * s)
    assert np.asarray(k).ctypes.data == k.unsafe_buffer_pointer()       # K read in place
    # the result is aligned so that JAX's CPU client aliases it: a leaf placed from it is
    # no second copy of the kernel (fold_params's peak memory)
    out, _ = rescale.scaled(k, [s], np.dtype(np.float32), _tiny(np.float32))
    assert out.ctypes.data % 64 == 0
    placed = jax.device_put(out, jax.devices("cpu")[0])
    assert placed.unsafe_buffer_pointer() == out.ctypes.data


@pytest.mark.parametrize("case", ["subnormal_k", "underflow", "overflow", "zero_k"])
def test_suspect_is_raised_where_the_product_leaves_the_normal_range(chunked, case):
    kd = np.dtype(np.float32)
    k = np.ones((8, 8), np.float32)
    s = np.ones(8)
    if case == "subnormal_k":
        k[3, 3] = np.float32(1e-40)       # a subnormal element of K, in a middle chunk
    elif case == "underflow":
        s[2] = 1e-42
    elif case == "overflow":
        s[5] = 1e39
    else:                                  # an exact zero of K stays zero: nothing to flag
        k[:, 1] = 0
        s[1] = 1e-42
    out, suspect = rescale.scaled(k, [s], kd, _tiny(kd))
    assert suspect == (case != "zero_k")
    np.testing.assert_array_equal(out, _whole(k, [s], kd))


@pytest.mark.parametrize("case", ["random", "subnormal", "overflow", "zero_k", "not_float32"])
def test_a_float32_factor_is_multiplied_in_float32_with_the_same_bits(chunked, monkeypatch,
                                                                      case):
    """A factor whose values are float32 numbers (RMSNorm's γ): the product of two float32
    numbers is exact in float64, so one float32 multiply (IEEE: the exact product rounded
    once) gives the float64 path's bits and range verdict, subnormal and infinite products
    included. A factor with more bits keeps the float64 path."""
    seen = []
    real = rescale._product
    monkeypatch.setattr(rescale, "_product",
                        lambda k, fs, out: seen.append(fs[0].dtype) or real(k, fs, out))
    rng = np.random.default_rng(1)
    k = rng.standard_normal((40, 64)).astype(np.float32)
    g = rng.standard_normal(64).astype(np.float32).astype(np.float64)
    if case == "subnormal":
        g[3] = 2.0 ** -130                # float32 subnormal products, rounded
    elif case == "overflow":
        g[5] = 2.0 ** 127                 # |k| > 2 overflows
    elif case == "zero_k":
        k[:, 7], g[7] = 0, 2.0 ** -140
    elif case == "not_float32":
        g = g * (1 + 2.0 ** -40)
    out, suspect = rescale.scaled(k, [g[None, :]], np.dtype(np.float32), _tiny(np.float32))
    np.testing.assert_array_equal(out.view(np.uint32), _whole(k, [g], np.float32).view(np.uint32))
    assert suspect == (case in ("subnormal", "overflow"))
    assert set(seen) == {np.dtype(np.float64 if case == "not_float32" else np.float32)}


@pytest.mark.parametrize("shape,axis", [((37, 24), 0), ((37, 24), 1), ((5, 3, 7, 16), 3),
                                        ((5, 3, 7, 16), 0), ((5, 3, 7, 16), 2), ((1, 300), 1),
                                        ((300,), 0)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_chunks_see_every_element(chunked, shape, axis, dtype):
    """Chunks of 64 elements over three workers: whole ones and a remainder, along merged
    leading axes; a factor along the chunked axis or across it; an overflow in the last
    element, or a value below the normal range in the first, is still seen."""
    rng = np.random.default_rng(2)
    k = rng.uniform(0.5, 2.0, shape).astype(dtype)
    f = rng.uniform(0.3, 3.0, shape[axis]) * (1 + 2.0 ** -40)
    f = f.reshape([-1 if a == axis else 1 for a in range(len(shape))])
    fs = [f, np.float64(0.75)]
    out, suspect = rescale.scaled(k, fs, np.dtype(dtype), _tiny(dtype))
    assert not suspect and out.shape == shape
    np.testing.assert_array_equal(out.view(np.uint8), _whole(k, fs, dtype).view(np.uint8))
    for where, value in ((-1, 1e30 if dtype == ml_dtypes.bfloat16 else 3e38), (0, 1e-30)):
        bad = k.copy()
        bad.reshape(-1)[where] = value
        scale = 1e10 if where == -1 else 1e-10
        assert rescale.scaled(bad, [np.full(f.shape, scale)], np.dtype(dtype), _tiny(dtype))[1]
    empty, _ = rescale.scaled(k[:0], [f[:0] if axis == 0 else f], np.dtype(dtype), 1e-30)
    assert empty.shape == (0,) + shape[1:]


def test_no_temporary_as_large_as_the_kernel(monkeypatch):
    """The float64 product and the range check's masks are chunk-sized (two factors: the
    float64 block path), so the rescale allocates the result and a few chunks per worker."""
    monkeypatch.setattr(rescale, "_workers", lambda: 2)
    monkeypatch.setattr(rescale, "_pools", {})
    k = np.ones((1024, 4096), np.float32)
    fs = [np.linspace(0.5, 1.5, 4096), np.float64(0.5)]
    tracemalloc.start()
    try:
        out, _ = rescale.scaled(k, fs, np.float32, 1e-38)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - out.nbytes < 2 * 4 * rescale.CHUNK * 8 <= k.nbytes // 4, peak - out.nbytes


@pytest.mark.filterwarnings("ignore:os.fork")       # the child runs NumPy only, not JAX
def test_shared_by_threads_and_after_fork(chunked):
    """Many threads rescale at once through the one pool; a forked child (whose parent's
    pool threads do not exist there) gets a pool of its own."""
    rng = np.random.default_rng(5)
    ks = [rng.uniform(0.5, 2, (64, 48)).astype(np.float32) for _ in range(16)]
    fs = [rng.uniform(0.5, 2, 48) for _ in range(16)]
    got = [None] * 16

    def work(i):
        got[i] = rescale.scaled(ks[i], [fs[i]], np.float32, 1e-38)[0]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(16):
        np.testing.assert_array_equal(got[i], _whole(ks[i], [fs[i]], np.float32))
    if not hasattr(os, "fork"):
        return
    pid = os.fork()
    if pid == 0:        # the child: exits 0 only if the rescale finished and is right
        ok = np.array_equal(rescale.scaled(ks[0], [fs[0]], np.float32, 1e-38)[0], got[0])
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_round_kernel_explains_out_of_range_products(chunked):
    k = np.ones((4, 4, 8, 8), np.float16)
    s = np.ones(8)
    s[3] = 1e6
    _, why = rules.round_kernel(k, s, np.float16, axis=3)
    assert why is not None and why.kind == "overflow" and "float16" in str(why)
    s = np.ones(8)
    s[6] = 1e-12
    kp, why = rules.round_kernel(k, s, np.float16, axis=3)
    assert why is not None and why.kind == "underflow" and "[6]" in str(why)
    # a subnormal element of K scaled by 1 is kept as it is (suspect, then explained: safe)
    k = np.full((4, 8), np.float16(1.0))
    k[0, 0] = np.float16(2.0 ** -20)
    kp, why = rules.round_kernel(k, np.full(8, 1.0), np.float16, axis=1)
    assert why is None and np.asarray(kp)[0, 0] == np.float16(2.0 ** -20)


def test_fold_numeric_with_chunked_rescale(chunked):
    import hlofold
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 3, 8, 16)), jnp.float32)
    s = jnp.asarray(rng.uniform(0.5, 2, 16), jnp.float32)
    t = jnp.asarray(rng.standard_normal(16), jnp.float32)

    def f(x, w, s, t):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y * s + t

    x = jnp.asarray(rng.standard_normal((2, 8, 8, 8)), jnp.float32)
    folded = hlofold.fold(f, freeze=(1, 2, 3))
    out = folded(x, w, s, t)
    assert folded.report(x, w, s, t).num_folded == 1
    np.testing.assert_allclose(out, f(x, w, s, t), rtol=1e-5, atol=1e-5)


def test_a_kernel_that_is_a_strided_view_is_not_copied(chunked):
    """A transposed view (OIHW read as WHIO): the chunks walk it as it is, right bits, and
    no copy of K is made to merge its axes. (Each of the 3 workers holds a row's
    temporaries and NumPy's cast buffers, ~0.1 K each here; a copy would be all of K.)"""
    rng = np.random.default_rng(7)
    k = rng.uniform(0.5, 2, (256, 64, 3, 24)).astype(np.float32).transpose(3, 2, 1, 0)
    s = rng.uniform(0.5, 2, 256)
    rescale.scaled(k[:1], [s], np.float32, 1e-38)        # the pool's threads started
    tracemalloc.start()
    try:
        out, bad = rescale.scaled(k, [s], np.float32, 1e-38)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not bad
    np.testing.assert_array_equal(out, _whole(k, [s], np.float32))
    assert peak - out.nbytes < k.nbytes // 2, peak - out.nbytes
