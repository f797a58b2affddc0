"""fold(..., verify=True): fail closed when the folded program is wrong."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
import hlofold._compat as C
import hlofold._base.algebra
import hlofold._fold.jaxpr.emit
import hlofold._fold.jaxpr.plan
import hlofold._fold.stablehlo.fold
from hlofold import examples
from hlofold._base.tolerance import bound, mismatch as _mismatch
from tests.helpers import assert_close

P = examples.init_resnet(10, width=8, seed=2)
X = jnp.asarray(np.random.default_rng(1).standard_normal((2, 16, 16, 3)), jnp.float32)
REF = jax.jit(examples.resnet_apply)(P, X)


@pytest.fixture
def broken_fold(monkeypatch):
    """A fold that is wrong: every collapsed scale s is 1.5× what it should be."""
    real = hlofold._base.algebra.collapse

    def wrong(*args, **kwargs):
        s, t = real(*args, **kwargs)
        return s * 1.5, t
    for module in (hlofold._fold.jaxpr.plan, hlofold._fold.jaxpr.emit, hlofold._fold.stablehlo.fold):
        monkeypatch.setattr(module, "collapse", wrong)


@pytest.mark.parametrize("freeze", [(), 0], ids=["inputs", "frozen"])
def test_broken_fold_warns_and_runs_the_original(broken_fold, freeze):
    ff = hlofold.fold(examples.resnet_apply, freeze=freeze, verify=True)
    with pytest.warns(RuntimeWarning, match="verify: the folded program differs") as rec:
        out = ff(P, X)
    # the original program's result (frozen: the original with the params as constants)
    leaves = jax.tree.leaves((P, X) if freeze == () else X)
    original = jax.jit(C.jaxpr_as_fun(ff.original_jaxpr(P, X)))(*leaves)[0]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(original))
    assert_close(REF, out)
    msg = str(rec[0].message)
    assert "examples.py:" in msg and "conv_affine at" in msg            # names the folded sites
    assert rec[0].filename == __file__                                 # points at the caller
    # the report says so (a call never runs another program than the report describes)
    assert "verify=True found" in ff.report(P, X).running and "NOTE: calls run" in str(
        ff.report(P, X)) and "run the original program" in repr(ff)
    # from then on the original program, without another warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(np.asarray(ff(P, X)), np.asarray(original))
        X2 = X * 0.5
        assert_close(jax.jit(examples.resnet_apply)(P, X2), ff(P, X2))
        # and inside an enclosing jit, too
        assert_close(REF, jax.jit(lambda p, x: ff(p, x))(P, X))
    # without verify, the broken fold would have been used silently
    wrong = hlofold.fold(examples.resnet_apply, freeze=freeze)(P, X)
    assert float(jnp.max(jnp.abs(wrong - REF))) > 1e-2 * float(jnp.max(jnp.abs(REF)))


@pytest.mark.parametrize("freeze", [(), 0], ids=["inputs", "frozen"])
def test_correct_fold_does_not_warn(freeze):
    ff = hlofold.fold(examples.resnet_apply, freeze=freeze, verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(REF, ff(P, X))
        assert_close(REF, ff(P, X))
    prog = ff._program_for((P, X), {})[0]
    # (+ the head's 1/(H·W) when frozen; with inputs the cost rule leaves it)
    assert prog.verified is True and \
        ff.report(P, X).num_folded == examples.count_bn(P) + (freeze == 0)


def test_verify_compares_nan_and_inf_positions():
    """NaN and inf must sit at the same places (infs with the same sign); finite values
    within the dtype's tolerance; non-float outputs exactly."""
    nan, inf = np.nan, np.inf
    f32 = lambda *v: np.array(v, np.float32)
    assert _mismatch(f32(1, nan, inf), f32(1 + 1e-6, nan, inf)) is None
    assert "NaN/inf" in _mismatch(f32(1, nan), f32(nan, 1))
    assert "NaN/inf" in _mismatch(f32(1, inf), f32(1, -inf))
    assert "max|Δ|" in _mismatch(f32(1, 2), f32(1, 2.01))
    assert _mismatch(f32(nan, nan), f32(nan, nan)) is None
    assert _mismatch(np.array([1, 2]), np.array([1, 3])) == "values differ"
    assert "instead of" in _mismatch(f32(1, 2), f32(1, 2, 3))


def test_compare_reads_every_block(monkeypatch):
    """An output is compared in blocks (no float64 copy of it): a difference, a NaN, an inf
    or the largest magnitude in the last, partial block still counts."""
    from hlofold._base import tolerance
    monkeypatch.setattr(tolerance, "_BLOCK", 8)
    ref = np.linspace(-1, 1, 37).astype(np.float32)
    assert tolerance.compare(ref, ref.copy()).passed
    for i, v in ((36, 1.01), (33, np.nan), (30, np.inf)):
        out = ref.copy()
        out[i] = v
        assert not tolerance.compare(ref, out).passed, (i, v)
    big = ref.copy()
    big[35] = 1e6                        # sets the scale: a 1e-3 difference elsewhere passes
    near = big.copy()
    near[2] += 1e-3
    c = tolerance.compare(big, near, 1, 0)
    assert c.passed and c.max_abs == pytest.approx(1e-3, rel=1e-3)
    inf = ref.copy()
    inf[[3, 20]] = np.inf
    c = tolerance.compare(inf, inf.copy())
    assert c.passed and c.finite == pytest.approx(35 / 37)


def test_one_tolerance_model():
    """The bound grows with the accumulation length and the depth, per dtype eps, and is
    capped at max|ref|/8 so that a wrong fold (an O(max|ref|) error) always fails."""
    e32, e16 = float(np.finfo(np.float32).eps), float(np.finfo(np.float16).eps)
    assert bound(np.float32, 1.0) == pytest.approx(10 * e32 + 1e-3 * e32)
    assert bound(np.float32, 1.0, 100, 1) == pytest.approx(2 * 28 * e32 + 1e-3 * e32)
    assert bound(np.float16, 2.0, 100) == pytest.approx(2 * 28 * e16 + 1e-3 * e16)
    assert bound(jnp.bfloat16, 1.0, 4608, 50) < 0.13        # capped
    assert bound(np.float32, 1.0, 9, 0, backend="gpu", cross=True) > 1e-2   # TF32
    assert bound(np.int32, 1.0) == 0.0
    # a 1 % error passes in bf16 over a long accumulation, fails in float32
    ref = np.linspace(-1, 1, 64).astype(np.float32)
    assert _mismatch(ref, ref * 1.01, 4608, 10) is not None
    rb = ref.astype(jnp.bfloat16)
    assert _mismatch(rb, (ref * 1.01).astype(jnp.bfloat16), 4608, 10) is None
    assert _mismatch(rb, (ref * 1.5).astype(jnp.bfloat16), 4608, 10) is not None


def test_bf16_fold_passes_verify():
    """A correct bf16 fold stays within the bf16 tolerance (rounding is not a failure)."""
    pb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), P)
    xb = X.astype(jnp.bfloat16)
    for freeze in ((), 0):
        ff = hlofold.fold(examples.resnet_apply, freeze=freeze, verify=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ff(pb, xb)
        assert ff._program_for((pb, xb), {})[0].verified is True
