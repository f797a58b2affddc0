"""Hostile numbers: non-finite and degenerate BN statistics, overflow and underflow of
low-precision kernels, zero-size dimensions, shared kernels, parameters that are outputs.

Every case runs twice through ``hlofold.fold``: with the parameters frozen (constants,
``freeze=``) and as inputs (prepared on the host). Both go through the same rules, so both
reach the same outcome: either hlofold folds and the outputs are the unfolded program's —
NaN and inf positions (and signs) included — or it refuses the site with a reason. Never a
silent change. docs/reliability.md tabulates the outcomes.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold

RNG = np.random.default_rng(5)
DN = ("NHWC", "HWIO", "NHWC")
FOLDED, REFUSED = "folded", "refused"


def conv(x, k, padding="SAME"):
    return lax.conv_general_dilated(x, k, (1, 1), padding, dimension_numbers=DN)


def bn(y, p, eps=1e-5):
    return (y - p["mean"]) * (lax.rsqrt(p["var"] + eps) * p["scale"]) + p["bias"]


def stats(c, dtype=np.float32):
    return dict(mean=(0.3 * RNG.standard_normal(c)).astype(dtype),
                var=np.exp(0.5 * RNG.standard_normal(c)).astype(dtype),
                scale=(1 + 0.3 * RNG.standard_normal(c)).astype(dtype),
                bias=(0.2 * RNG.standard_normal(c)).astype(dtype))


def normal(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def assert_same(ref, out, rtol=1e-5, atol=1e-6):
    """Same shapes, NaN at the same places, the same infinities (with signs), and the finite
    values within ``rtol·max|ref| + atol``."""
    ref_l, out_l = jax.tree.leaves(ref), jax.tree.leaves(out)
    assert len(ref_l) == len(out_l)
    for r, o in zip(ref_l, out_l):
        r, o = np.asarray(r, np.float64), np.asarray(o, np.float64)
        assert r.shape == o.shape, (r.shape, o.shape)
        np.testing.assert_array_equal(np.isnan(r), np.isnan(o), "NaN positions differ")
        inf = np.isinf(r)
        np.testing.assert_array_equal(inf, np.isinf(o), "inf positions differ")
        np.testing.assert_array_equal(r[inf], o[inf], "inf signs differ")
        fin = np.isfinite(r)
        if fin.any():
            err = float(np.max(np.abs(r[fin] - o[fin])))
            bound = rtol * float(np.max(np.abs(r[fin]))) + atol
            assert err <= bound, f"max|Δ| = {err:.3g} > {bound:.3g}"


def run(f, args: tuple, freeze, **kw):
    """``hlofold.fold(f, freeze=freeze)(*args)``: (outputs, report, outcome).

    outcome: FOLDED (a site folded) or REFUSED (nothing folded); no warning either way."""
    ff = hlofold.fold(f, freeze=freeze, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ff(*args)
        rep = ff.report(*args)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not msgs, msgs                     # no stray NumPy/JAX warnings
    return out, rep, FOLDED if rep.num_folded else REFUSED


def both(f, args, freeze, expect, reason=None, ref=None, **kw):
    """Run frozen and as inputs; check both reach the outcome ``expect`` and that the
    outputs equal ``ref``."""
    ref = jax.jit(f)(*args) if ref is None else ref
    results = {}
    for mode, fz in (("frozen", freeze), ("inputs", ())):
        out, rep, outcome = run(f, args, fz, **kw)
        assert outcome == expect, f"{mode}: {outcome}, expected {expect}\n{rep}"
        if outcome == REFUSED and reason is not None:
            assert any(reason in (s.reason or "") for s in rep.refused), str(rep)
        assert_same(ref, out)
        results[mode] = (out, rep)
    return results


# --------------------------------------------------------------------------- BN statistics

X = normal(2, 6, 6, 3)
K = normal(3, 3, 3, 4) / 3

# case: (param, channel value, eps, outcome frozen and as inputs)
STATS_CASES = {
    "nan-mean": ("mean", np.nan, 1e-5, FOLDED),      # t NaN: same NaN channel
    "nan-var": ("var", np.nan, 1e-5, REFUSED),       # s NaN
    "nan-gamma": ("scale", np.nan, 1e-5, REFUSED),
    "nan-beta": ("bias", np.nan, 1e-5, FOLDED),
    "inf-mean": ("mean", np.inf, 1e-5, FOLDED),      # t = ∓inf, as (y − inf)·s
    "inf-var": ("var", np.inf, 1e-5, FOLDED),          # s = 0: the channel is β
    "inf-gamma": ("scale", -np.inf, 1e-5, REFUSED),
    "inf-beta": ("bias", -np.inf, 1e-5, FOLDED),
    "zero-var-zero-eps": ("var", 0.0, 0.0, REFUSED),  # s = inf
    "negative-var": ("var", -0.5, 1e-5, REFUSED),    # rsqrt(< 0) = NaN
    "var-equals-minus-eps": ("var", -1e-5, 1e-5, REFUSED),
}


@pytest.mark.parametrize("case", list(STATS_CASES))
def test_hostile_bn_statistics(case):
    param, value, eps, frozen = STATS_CASES[case]
    p = stats(4)
    p[param][1] = value
    f = lambda x, k, p: bn(conv(x, k), p, eps)
    res = both(f, (X, K, p), ("k", "p"), frozen,
               reason="not finite")
    if frozen == REFUSED:
        for mode in ("frozen", "inputs"):
            (site,) = res[mode][1].sites
            assert "channel(s) (first: [1])" in site.reason


def test_every_channel_degenerate():
    p = stats(4)
    p["var"][:] = 0.0
    f = lambda x, k, p: bn(conv(x, k), p, 0.0)
    res = both(f, (X, K, p), ("k", "p"), REFUSED,
               reason="not finite at 4 channel(s)")
    assert np.isinf(np.asarray(res["frozen"][0])).all()      # (y − μ)·inf: ±inf, signs kept


def test_hostile_activations_with_a_zero_scale():
    """inf/NaN in the input meet s = 0 (σ² = inf): inf·0 is NaN in both programs."""
    p = stats(4)
    p["var"][2] = np.inf
    x = X.copy()
    x[0, 2, 2, 1], x[1, 3, 3, 0] = np.inf, np.nan
    f = lambda x, k, p: bn(conv(x, k), p)
    res = both(f, (x, K, p), ("k", "p"), FOLDED)
    out = np.asarray(res["frozen"][0])
    assert np.isnan(out).any() and np.isfinite(out).any()


# --------------------------------------------------------------------------- forward folding

@pytest.mark.parametrize("case,expect", [
    ("std-zero", REFUSED),     # (x − m)/0
    ("mean-nan", FOLDED),
    ("mean-inf", FOLDED),      # K·(−inf) sums to NaN: same
], ids=["std-zero", "mean-nan", "mean-inf"])
def test_hostile_input_standardization(case, expect):
    m, sd = normal(3), RNG.uniform(0.5, 2, 3).astype(np.float32)
    if case == "std-zero":
        sd[1] = 0.0
    else:
        m[1] = np.nan if case == "mean-nan" else np.inf
    f = lambda x, k, m, sd: conv((x - m) / sd, k, "VALID")
    both(f, (X, K, m, sd), ("k", "m", "sd"), expect, reason="input scale s is not finite")


# --------------------------------------------------------------------------- low precision

LOW = [np.float16, jnp.bfloat16]


@pytest.mark.parametrize("dtype", LOW, ids=["float16", "bfloat16"])
def test_rescaled_kernel_overflows(dtype):
    """K·s overflows the kernel dtype while conv(x, K)·s does not (the conv cancels)."""
    x = np.ones((1, 3, 3, 2), dtype)
    k = np.zeros((3, 3, 2, 2), np.float32)
    k[0, 0], k[1, 1] = 2.0, -2.0                           # conv(ones, K) = 0
    big = 6e4 if dtype == np.float16 else 3e38
    s = np.array([big, 1.0], np.float32).astype(dtype)
    t = np.array([1.0, 0.5], dtype)
    f = lambda x, k, s, t: conv(x, k, "VALID") * s + t
    both(f, (x, k.astype(dtype), s, t), ("k", "s", "t"),
         REFUSED, reason="overflows")


def _channel_underflow_case(dtype):
    """Large activations, a small kernel and a tiny BN scale on channel 0: conv·s is a
    normal number, K·s is below the normal range of ``dtype`` (or zero)."""
    if dtype == np.float16:
        x, kmag, tiny = 1e3, 1e-4, 1e-4
    else:
        x, kmag, tiny = 1e30, 1e-30, 1e-15
    x = (x * RNG.standard_normal((1, 4, 4, 2))).astype(dtype)
    k = (kmag * RNG.standard_normal((3, 3, 2, 2))).astype(dtype)
    s = np.array([tiny, 1.0], np.float32).astype(dtype)
    t = np.zeros(2, dtype)
    return x, k, s, t


@pytest.mark.parametrize("dtype", LOW, ids=["float16", "bfloat16"])
def test_rescaled_kernel_underflows(dtype):
    """Refused, frozen and as inputs (prepared on the host with the same rule): an output
    channel's K·s underflows. For float16 ``float32_kernels=True`` keeps that channel."""
    x, k, s, t = _channel_underflow_case(dtype)
    f = lambda x, k, s, t: conv(x, k, "VALID") * s + t
    ref = np.asarray(jax.jit(f)(x, k, s, t), np.float64)
    assert np.abs(ref[..., 0]).max() > 0                   # the unfolded channel 0 is alive
    for freeze in (("k", "s", "t"), ()):
        out, rep, outcome = run(f, (x, k, s, t), freeze)
        assert outcome == REFUSED and "underflows" in rep.sites[0].reason, str(rep)
        assert "output channel(s) (first: [0])" in rep.sites[0].reason
        assert_same(ref, out)
    if dtype != np.float16:
        return      # bf16 has float32's exponent range: float32 kernels underflow as well
    # float32 kernels: the channel survives
    out, rep, outcome = run(f, (x, k, s, t), (), float32_kernels=True)
    assert outcome == FOLDED
    c0 = np.asarray(out, np.float64)[..., 0]
    np.testing.assert_allclose(c0, ref[..., 0], rtol=4 * float(jnp.finfo(dtype).eps),
                               atol=4 * np.abs(ref[..., 0]).max() * float(jnp.finfo(dtype).eps))


@pytest.mark.parametrize("dtype", LOW, ids=["float16", "bfloat16"])
def test_huge_and_tiny_scales_that_fit(dtype):
    """Large and small scales whose products stay in range fold (frozen and as inputs)."""
    x = normal(2, 5, 5, 3, dtype=dtype)
    k = (normal(3, 3, 3, 4) / 3).astype(dtype)
    s = np.array([100.0, 0.01, 1.0, -50.0], np.float32).astype(dtype)
    t = normal(4, dtype=dtype)
    f = lambda x, k, s, t: conv(x, k) * s + t
    ref = jax.jit(f)(x, k, s, t)
    for fz in (("k", "s", "t"), ()):
        out, rep, outcome = run(f, (x, k, s, t), fz)
        assert outcome == FOLDED, str(rep)
        r, o = np.asarray(ref, np.float64), np.asarray(out, np.float64)
        # one rounding moved: a few ulps of the largest term of the dot product
        assert np.abs(r - o).max() <= 8 * float(jnp.finfo(dtype).eps) * np.abs(r).max()


# --------------------------------------------------------------------------- zero-size

ZERO_CASES = {  # name: (batch, height, in channels, out channels)
    "batch-0": (0, 5, 3, 4),
    "in-channels-0": (2, 5, 0, 4),
    "out-channels-0": (2, 5, 3, 0),
    "spatial-0": (2, 0, 3, 4),
}


@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_zero_size_dimensions(case):
    n, h, cin, cout = ZERO_CASES[case]
    x, k, p = normal(n, h, 5, cin), normal(3, 3, cin, cout), stats(cout)
    f = lambda x, k, p: bn(conv(x, k), p)
    res = both(f, (x, k, p), ("k", "p"), FOLDED)
    assert res["frozen"][0].shape == jax.eval_shape(f, x, k, p).shape
    # and folded forward (an input standardization before a VALID conv)
    m, sd = normal(cin), RNG.uniform(0.5, 2, cin).astype(np.float32)
    g = lambda x, k, m, sd: conv((x - m) / sd, k, "VALID")
    if h >= 3:
        both(g, (x, k, m, sd), ("k", "m", "sd"), FOLDED)


# --------------------------------------------------------------------------- sharing, aliasing

def test_kernel_shared_by_two_convs_with_different_bns():
    """Each conv gets its own folded kernel; the shared kernel and the BN arrays are never
    modified in place (NumPy inputs included)."""
    k, p1, p2 = normal(3, 3, 3, 4), stats(4), stats(4)
    copies = [k.copy()] + [a.copy() for p in (p1, p2) for a in p.values()]
    kj = jnp.asarray(k)
    kj_copy = np.asarray(kj).copy()

    def f(x, k, p1, p2):
        return bn(conv(x, k), p1), bn(conv(2 * x, k), p2)

    for kk in (k, kj):
        res = both(f, (X, kk, p1, p2), ("k", "p1", "p2"), FOLDED)
        # each BN after its conv, and the scale 2 in front of the second (zero padding
        # stays zero under a scale)
        assert res["frozen"][1].num_folded == res["inputs"][1].num_folded == 3
        assert sorted(s.pattern for s in res["inputs"][1].folded) == [
            "affine_conv", "conv_affine", "conv_affine"]
    for a, b in zip([k] + [a for p in (p1, p2) for a in p.values()], copies):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(kj), kj_copy)

    # frozen: two distinct folded kernel constants, neither is the original
    ff = hlofold.fold(f, freeze=("k", "p1", "p2"))
    kernels = [c for c in ff.jaxpr(X, k, p1, p2).consts if np.shape(c) == k.shape]
    assert len(kernels) == 2 and not np.array_equal(kernels[0], kernels[1])
    assert all(c is not k and not np.array_equal(c, k) for c in kernels)
    # inputs: two distinct prepared kernels
    ff = hlofold.fold(f)
    prepared = ff.split(X, kj, p1, p2).prepare(X, kj, p1, p2)
    kernels = [a for a in prepared if a.shape == k.shape]
    assert len(kernels) == 2 and not np.array_equal(kernels[0], kernels[1])


def test_bn_parameters_that_are_also_outputs():
    """The function returns the BN statistics (and the kernel) it folds, and the scale it
    computes from them: the statistics and the kernel come back bit for bit, whether frozen
    (constants) or inputs (prepared part); the scale within an ulp (XLA may constant-fold
    ``rsqrt`` of frozen values with another rounding)."""
    p = stats(4)

    def f(x, k, p):
        s = lax.rsqrt(p["var"] + 1e-5) * p["scale"]
        return bn(conv(x, k), p), p["mean"], s, k

    res = both(f, (X, K, p), ("k", "p"), FOLDED)
    ref = jax.jit(f)(X, K, p)
    for mode in ("frozen", "inputs"):
        out = res[mode][0]
        for r, o in ((ref[1], out[1]), (ref[3], out[3])):
            np.testing.assert_array_equal(np.asarray(r), np.asarray(o))
        np.testing.assert_allclose(np.asarray(out[2]), np.asarray(ref[2]), rtol=2.5e-7)
