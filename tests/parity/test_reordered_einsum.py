"""A norm before an einsum whose output axes are reordered — Gemma's fused q/k/v projection
``einsum("BTD,SNDH->SBTNH", x, W)`` and grouped-attention ``kv_einsum``
``einsum("BSD,CKDH->CBSKH")`` — folds into the weight on both paths (issue 69, item 3).

JAX puts the weight on the lhs of that ``dot_general`` (its free axes first in the output),
the activations on the rhs; hlofold had taken the rhs — the activations — as the kernel, the
reading of a multi-head projection, and said "transpose moves the output-feature axes"
(untrue for a scale in front). The site procedure (``_fold.core.site``) now prefers a reading
whose kernel is a weight, and both IRs offer the lhs reading of a multi-head weight."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold

TOL = 2e-5
B, T, D, N, H = 2, 5, 16, 2, 4


def _norm(x, g):
    y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return y * (1 + g)                                  # (Gemma's γ)


def _qkv(p, x):
    q, k, v = jnp.einsum("BTD,SNDH->SBTNH", _norm(x, p["g"]), p["w"])
    return q * k + v


def _kv(p, x):
    k, v = jnp.einsum("BSD,CKDH->CBSKH", _norm(x, p["g"]), p["w"])
    return k - v


CASES = {"qkv": (_qkv, (3, N, D, H)), "kv": (_kv, (2, 1, D, H))}


def _case(name, seed=0):
    f, wshape = CASES[name]
    k = jax.random.split(jax.random.key(seed), 3)
    p = {"g": 0.3 * jax.random.normal(k[0], (D,)), "w": jax.random.normal(k[1], wshape)}
    return f, p, jax.random.normal(k[2], (B, T, D))


def _err(a, b):
    return float(jnp.max(jnp.abs(a - b)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_fold_params_folds_the_norm_into_the_reordered_einsum(name):
    f, p, x = _case(name)
    out = hlofold.fold_params(f, p, x)
    assert out.report.num_folded == 1, str(out.report)
    site = out.report.folded[0]
    assert site.params == ["['g']"] and site.kernel == "['w']", str(out.report)
    np.testing.assert_array_equal(np.asarray(out.params["g"]), np.zeros(D, np.float32))
    assert _err(f(out.params, x), f(p, x)) < TOL
    # what is left after the root is said truly: the einsum's own unstack ends the chain
    assert not any("output-feature axes" in str(s.reason) for s in out.report.sites)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fold_stablehlo_folds_it_the_same_way(name):
    f, p, x = _case(name)
    exp = jax.export.export(jax.jit(f))(p, x)
    bound = {f"arg{i}": v for i, v in enumerate(jax.tree.leaves(p))}
    new, rep, prep = hlofold.fold_stablehlo(exp, params=bound)
    assert rep.num_folded == 1, str(rep)
    assert _err(new.call(x, *prep), f(p, x)) < TOL
    jx = hlofold.fold_params(f, p, x).report
    assert rep.num_folded == jx.num_folded                  # (the paths agree)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_decorator_folds_it(name):
    f, p, x = _case(name)
    ff = hlofold.fold(f, freeze=0)
    assert ff.report(p, x).num_folded == 1, str(ff.report(p, x))
    assert _err(ff(p, x), jax.jit(f)(p, x)) < TOL


def test_an_activation_on_the_lhs_is_not_taken_for_the_weight():
    """Attention's ``einsum("BTNH,BSNH->BNTS", q, k)``: neither side is a weight; nothing is
    folded, the values are untouched."""
    def f(p, x):
        q = jnp.einsum("BTD,DNH->BTNH", x, p["wq"])
        k = jnp.einsum("BTD,DNH->BTNH", x, p["wk"])
        return jnp.einsum("BTNH,BSNH->BNTS", q * 2.0, k)
    k = jax.random.split(jax.random.key(1), 3)
    p = {"wq": jax.random.normal(k[0], (D, N, H)), "wk": jax.random.normal(k[1], (D, N, H))}
    x = jax.random.normal(k[2], (B, T, D))
    out = hlofold.fold_params(f, p, x)
    assert _err(f(out.params, x), f(p, x)) < TOL
    assert all(s.kernel in ("['wq']", "['wk']", None) for s in out.report.folded), \
        str(out.report)
