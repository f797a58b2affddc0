"""Regressions for the third round of adversarial testing (issue 31), on both paths:
subnormal BatchNorm statistics (the host and a flushing backend disagree) and a narrowing
cast inside the chain. Each failed before its fix on every path it names."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from hlofold._base.reasons import reason_kind
from hlofold._ir.stablehlo.artifacts import module_callable
from tests.helpers import assert_close

DN = ("NHWC", "HWIO", "NHWC")
RNG = np.random.default_rng(31)
X = jnp.asarray(RNG.standard_normal((1, 6, 6, 3)), jnp.float32)
K = jnp.asarray(RNG.standard_normal((3, 3, 3, 4)), jnp.float32)


def conv(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=DN)


def same_specials(ref, out):
    """The same NaN/±inf positions, finite values close."""
    ref, out = np.asarray(ref), np.asarray(out)
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(out))
    np.testing.assert_array_equal(np.where(np.isinf(ref), ref, 0), np.where(np.isinf(out), out, 0))
    fin = np.isfinite(ref)
    assert_close(ref[fin], out[fin])


# --------------------------------------------------------------- 2. subnormal statistics

# σ² subnormal in float32, ε = 0: XLA:CPU flushes them, so rsqrt(σ²) is inf there and the
# unfolded program outputs ±inf; NumPy (float64) gave 1e17–1e20, and the fold was finite
VAR = np.array([1e-40, 1e-39, 1.0, 2e-45], np.float32)
STATS = (np.zeros(4, np.float32), VAR, np.ones(4, np.float32), np.zeros(4, np.float32))


def bn_eps0(x, k, mean, var, g, b):
    return (conv(x, k) - mean) * (g * lax.rsqrt(var + 0.0)) + b


@pytest.mark.parametrize("how", ["fold", "freeze"])
def test_subnormal_variance_is_not_folded_on_the_jaxpr_path(how):
    f = hlofold.fold(bn_eps0, **({"freeze": (1, 2, 3, 4, 5)} if how == "freeze" else {}))
    ref = jax.jit(bn_eps0)(X, K, *STATS)
    assert np.isinf(np.asarray(ref)).sum() == 108
    same_specials(ref, f(X, K, *STATS))
    rep = f.report(X, K, *STATS)
    assert rep.num_folded == 0 and reason_kind(rep.sites[0].reason) == "subnormal", str(rep)


def test_subnormal_variance_is_not_folded_on_the_stablehlo_path():
    text = jax.jit(bn_eps0).lower(X, K, *STATS).as_text()
    weights = {f"arg{i}": v for i, v in enumerate((K,) + STATS, start=1)}
    apply, rep, prepared = hlofold.fold_stablehlo(text, params=weights)
    assert rep.num_folded == 0 and reason_kind(rep.sites[0].reason) == "subnormal", str(rep)
    same_specials(jax.jit(bn_eps0)(X, K, *STATS), module_callable(apply)(X, *prepared)[0])
    consts = jax.jit(lambda x: bn_eps0(x, K, *STATS)).lower(X).as_text()
    folded, rep = hlofold.fold_stablehlo(consts)
    assert rep.num_folded == 0 and reason_kind(rep.sites[0].reason) == "subnormal", str(rep)


def test_subnormal_variance_of_batch_norm_inference_is_not_folded():
    """TensorFlow's and torch_xla's spelling: the scale ``γ/√(σ²+ε)`` is computed by the pass
    on the host, so the same rule applies there."""
    var = ", ".join(f"{v:.6e}" for v in VAR)
    text = f"""
func.func @main(%x: tensor<1x6x6x3xf32>) -> tensor<1x6x6x4xf32> {{
  %k = stablehlo.constant dense<0.5> : tensor<3x3x3x4xf32>
  %y = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f],
       window = {{stride = [1, 1], pad = [[1, 1], [1, 1]]}}
       {{batch_group_count = 1 : i64, feature_group_count = 1 : i64}}
       : (tensor<1x6x6x3xf32>, tensor<3x3x3x4xf32>) -> tensor<1x6x6x4xf32>
  %g = stablehlo.constant dense<1.0> : tensor<4xf32>
  %b = stablehlo.constant dense<0.0> : tensor<4xf32>
  %m = stablehlo.constant dense<0.0> : tensor<4xf32>
  %v = stablehlo.constant dense<[{var}]> : tensor<4xf32>
  %r = "stablehlo.batch_norm_inference"(%y, %g, %b, %m, %v)
       {{epsilon = 0.0 : f32, feature_index = 3 : i64}}
       : (tensor<1x6x6x4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>)
       -> tensor<1x6x6x4xf32>
  return %r : tensor<1x6x6x4xf32>
}}"""
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 0 and reason_kind(rep.sites[0].reason) == "subnormal", str(rep)
    # a normal variance next to it still folds
    folded, rep = hlofold.fold_stablehlo(text.replace(var, "1.0, 2.0, 0.5, 1.5"))
    assert rep.num_folded == 1, str(rep)


def test_subnormal_variance_that_epsilon_hides_still_folds():
    """σ² = 1e-40 with ε = 1e-3: σ² + ε is ε whether σ² is flushed or not."""
    def f(x, k, mean, var, g, b):
        return (conv(x, k) - mean) * (g * lax.rsqrt(var + 1e-3)) + b
    ff = hlofold.fold(f, freeze=(1, 2, 3, 4, 5))
    assert ff.report(X, K, *STATS).num_folded == 1
    assert_close(jax.jit(f)(X, K, *STATS), ff(X, K, *STATS))


# ----------------------------------------------------------------- 3. narrowing casts


def narrowed(x, k, s, t):
    y = conv(x, k).astype(jnp.float16).astype(jnp.float32)     # rounds, and overflows
    return y * s + t


S, T = np.full(4, 1e4, np.float32), np.ones(4, np.float32)
XL = X * 3e4                                                   # conv outputs beyond f16


@pytest.mark.parametrize("how", ["fold", "freeze", "jit-in-graph"])
def test_a_narrowing_cast_ends_the_chain_on_the_jaxpr_path(how):
    """``conv → f16 → f32 → BN`` was folded across the f16 rounding: infs where the
    original had none, and finite values 3e-4 apart."""
    f = {"fold": lambda: hlofold.fold(narrowed),
         "freeze": lambda: hlofold.fold(narrowed, freeze=(1, 2, 3)),
         "jit-in-graph": lambda: jax.jit(hlofold.fold(narrowed, in_graph=True))}[how]()
    for x in (X, XL):
        ref = jax.jit(narrowed)(x, K, S, T)
        np.testing.assert_array_equal(np.asarray(f(x, K, S, T)), np.asarray(ref))
    closed = jax.make_jaxpr(narrowed)(X, K, S, T)
    new, rep = hlofold.fold_jaxpr(closed, in_graph="guarded")
    assert rep.num_folded == 0 and reason_kind(rep.sites[0].reason) == "narrowing", str(rep)


@pytest.mark.parametrize("in_graph", [False, True])
def test_a_narrowing_cast_ends_the_chain_on_the_stablehlo_path(in_graph):
    consts = jax.jit(lambda x: narrowed(x, K, S, T)).lower(X).as_text()
    folded, rep = hlofold.fold_stablehlo(consts)
    assert rep.num_folded == 0 and reason_kind(rep.sites[0].reason) == "narrowing", str(rep)
    args = jax.jit(narrowed).lower(X, K, S, T).as_text()
    folded, rep = hlofold.fold_stablehlo(args, in_graph=in_graph)
    assert rep.num_folded == 0 and reason_kind(rep.sites[0].reason) == "narrowing", str(rep)
    for x in (X, XL):
        np.testing.assert_array_equal(np.asarray(module_callable(folded)(x, K, S, T)[0]),
                                      np.asarray(jax.jit(narrowed)(x, K, S, T)))


def test_a_cast_back_to_the_roots_type_with_nothing_absorbed_still_folds_on_both_paths():
    """``conv (bf16) → f32 → bf16 → BN`` rounds nothing (the values were bf16 already), and a
    cast after the BN only ends the chain: both fold, on both paths."""
    xb, kb = X.astype(jnp.bfloat16), K.astype(jnp.bfloat16)
    s, t = jnp.asarray(S / 1e4 + 0.5, jnp.bfloat16), jnp.asarray(T, jnp.bfloat16)

    def f(x, k, s, t):
        y = conv(x, k).astype(jnp.float32).astype(jnp.bfloat16)
        return (y * s + t).astype(jnp.float32)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(lambda x: f(x, kb, s, t))(xb))
    assert rep.num_folded == 1, str(rep)
    folded, srep = hlofold.fold_stablehlo(jax.jit(lambda x: f(x, kb, s, t)).lower(xb).as_text())
    assert srep.num_folded == 1, str(srep)
