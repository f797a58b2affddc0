"""The rescaled kernel: XLA on the host (large kernels) and NumPy (small ones) give the same
bits, and both say when the product may leave the kernel dtype's normal range.

``rescale.XLA_MIN`` is lowered to 0 here so the XLA way runs at test sizes."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hlofold._core import rescale, rules

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, ml_dtypes.float8_e4m3fn]


@pytest.fixture
def xla_always(monkeypatch):
    monkeypatch.setattr(rescale, "XLA_MIN", 0)


def _tiny(kd):
    return float(ml_dtypes.finfo(kd).tiny)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n_factors", [1, 2])
def test_xla_matches_numpy_bit_for_bit(xla_always, dtype, n_factors):
    rng = np.random.default_rng(0)
    # normal numbers of every dtype here (float8's normal range starts at 2**-6)
    k = (rng.choice([-1, 1], (3, 3, 16, 64)) * rng.uniform(0.1, 4, (3, 3, 16, 64))).astype(dtype)
    # factors with many significant bits: the product must be rounded once, not twice
    fs = [rng.uniform(0.3, 3.0, (1, 1, 1, 64)) * (1 + 2.0 ** -40) for _ in range(n_factors)]
    out, suspect = rescale.scaled(k, fs, np.dtype(dtype), _tiny(dtype))
    assert isinstance(out, jax.Array) and not suspect
    ref = rescale.scaled_numpy(k, fs, np.dtype(dtype))
    assert np.asarray(out).dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES[1:3] + DTYPES[4:], ids=lambda d: np.dtype(d).name)
def test_rounded_once_near_halfway(xla_always, dtype):
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


def test_xla_takes_a_cpu_array_and_a_wider_result_type(xla_always):
    k = jax.device_put(np.linspace(-2, 2, 4096, dtype=np.float32).reshape(64, 64),
                       jax.devices("cpu")[0])
    s = np.linspace(0.5, 1.5, 64)
    out, suspect = rescale.scaled(k, [s], np.dtype(np.float64), _tiny(np.float64))
    assert not suspect
    np.testing.assert_array_equal(np.asarray(out), np.asarray(k, np.float64) * s)


@pytest.mark.parametrize("case", ["subnormal_k", "underflow", "overflow", "zero_k"])
def test_suspect_is_raised_where_numpy_would_see_it(xla_always, case):
    kd = np.dtype(np.float32)
    k = np.ones((8, 8), np.float32)
    s = np.ones(8)
    if case == "subnormal_k":
        k[3, 3] = np.float32(1e-40)       # flushed by XLA:CPU: read from the bits
    elif case == "underflow":
        s[2] = 1e-42
    elif case == "overflow":
        s[5] = 1e39
    else:                                  # an exact zero of K stays zero: nothing to flag
        k[:, 1] = 0
        s[1] = 1e-42
    out, suspect = rescale.scaled(k, [s], kd, _tiny(kd))
    assert suspect == (case != "zero_k")
    assert suspect == rescale.may_be_out_of_range(rescale.scaled_numpy(k, [s], kd), k, _tiny(kd))


@pytest.mark.parametrize("shape,axis", [((37, 24), 0), ((37, 24), 1), ((5, 3, 7, 16), 3),
                                        ((5, 3, 7, 16), 0), ((1, 300), 1), ((300,), 0)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_blocks_give_numpys_bits_and_see_every_block(monkeypatch, xla_always, shape, axis, dtype):
    """Blocks of 64 elements: several whole ones and a remainder, along merged leading axes;
    a factor along the blocked axes or across them; an overflow in the last, partial block
    is still seen."""
    monkeypatch.setattr(rescale, "XLA_BLOCK", 64)
    rng = np.random.default_rng(2)
    k = rng.uniform(0.5, 2.0, shape).astype(dtype)
    f = rng.uniform(0.3, 3.0, shape[axis]) * (1 + 2.0 ** -40)
    f = f.reshape([-1 if a == axis else 1 for a in range(len(shape))])
    out, suspect = rescale.scaled(k, [f, np.float64(0.75)], np.dtype(dtype), _tiny(dtype))
    assert not suspect and np.shape(out) == shape
    ref = rescale.scaled_numpy(k, [f, np.float64(0.75)], np.dtype(dtype))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), ref.view(np.uint8))
    k.reshape(-1)[-1] = 1e30 if dtype == ml_dtypes.bfloat16 else 3e38
    big = np.full(f.shape, 1e10)
    assert rescale.scaled(k, [big], np.dtype(dtype), _tiny(dtype))[1]
    empty, _ = rescale.scaled(k[:0], [f[:0] if axis == 0 else f], np.dtype(dtype), 1e-30)
    assert np.shape(empty) == (0,) + shape[1:]


def test_the_range_check_needs_no_kernel_sized_temporary(monkeypatch):
    """The range check is a reduction; XLA:CPU does not fuse it with its operand, so
    unblocked its mask would be a temporary of one byte per element of K."""
    k = jnp.ones((1024, 4096), jnp.float32)
    lead, fs = rescale._blocked(k.shape, [np.ones(4096)])
    with jax.enable_x64(True):
        compiled = rescale._rescale.lower(
            k, [jnp.asarray(f) for f in fs], kd=np.dtype(np.float32), tiny=1e-38, lead=lead,
            rows=max(1, rescale.XLA_BLOCK // 4096)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= rescale.XLA_BLOCK + 4096 < k.size // 2, temp       # unblocked: k.size


def test_round_kernel_explains_on_the_xla_path(xla_always):
    k = np.ones((4, 4, 8, 8), np.float16)
    s = np.ones(8)
    s[3] = 1e6
    _, why = rules.round_kernel(k, s, np.float16, axis=3)
    assert why is not None and why.kind == "overflow" and "float16" in str(why)
    s = np.ones(8)
    s[6] = 1e-12
    kp, why = rules.round_kernel(k, s, np.float16, axis=3)
    assert why is not None and why.kind == "underflow" and "[6]" in str(why)
    # a subnormal element of K: the exact product is NumPy's (XLA:CPU would flush it)
    k = np.full((4, 8), np.float16(1.0))
    k[0, 0] = np.float16(2.0 ** -20)
    kp, why = rules.round_kernel(k, np.full(8, 1.0), np.float16, axis=1)
    assert why is None and np.asarray(kp)[0, 0] == np.float16(2.0 ** -20)


def test_fold_numeric_on_the_xla_path(xla_always):
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
