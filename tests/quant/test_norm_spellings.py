"""Norm spellings real libraries write, in the quantization rewrites (issue 69, item 4):
Gemma's ``x·(1 + scale)`` smoothed as ``x·γ`` is (the pair's ``offset``), on the jaxpr path
and through ``fold_stablehlo``; a bfloat16 γ with an offset refused with the reason; a
sharding constraint on the residual stream passed by ``rotate=`` (MaxText constrains it)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hlofold
from hlofold._quant.core.equalize import Pair, Second, apply_to

TOL = 1e-5


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def _mlp(offset, dtype=jnp.float32):
    def f(p, x):
        g = p["g"].astype(jnp.float32) if dtype != jnp.float32 else p["g"]
        y = _rms(x) * (1 + g) if offset else _rms(x) * g
        return jax.nn.gelu(y @ p["w1"]) @ p["w2"]
    k = jax.random.split(jax.random.key(0), 4)
    p = {"g": (0.3 * jax.random.normal(k[0], (16,))).astype(dtype),
         "w1": jax.random.normal(k[1], (16, 32)), "w2": jax.random.normal(k[2], (32, 8))}
    x = jax.random.normal(k[3], (6, 16)) * jnp.linspace(0.1, 10, 16)   # outlier channels
    return f, p, x


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))


def test_the_offset_is_what_the_scale_divides():
    g = np.array([0.5, -0.25, 2.0])
    s = np.array([2.0, 0.5, 4.0])
    pair = Pair("g", 0, [Second("w", 0, 1)], offset=1.0)
    k = g.copy()
    apply_to("g", k, pair, s)
    np.testing.assert_allclose(k + 1.0, (g + 1.0) / s)


@pytest.mark.parametrize("offset", [False, True])
def test_gemma_norm_is_smoothed_as_a_plain_one(offset):
    f, p, x = _mlp(offset)
    out = hlofold.fold_params(f, p, x, smooth=[x])
    smoothed = [e for e in out.smoothed if e.kind == "smoothed"]
    assert [(e.first, e.seconds) for e in smoothed] == [("['g']", ["['w1']"])], str(out)
    assert _rel(f(p, x), f(out.params, x)) < TOL
    # the activations the first layer reads are flatter: what smoothing is for
    y = lambda q: _rms(x) * ((1 + q["g"]) if offset else q["g"])     # noqa: E731
    spread = lambda a: float(jnp.max(jnp.abs(a), 0).max() / jnp.median(jnp.max(jnp.abs(a), 0)))  # noqa: E731
    assert spread(y(out.params)) < spread(y(p))


def test_a_bfloat16_scale_with_an_offset_is_refused_with_the_reason():
    f, p, x = _mlp(True, jnp.bfloat16)
    out = hlofold.fold_params(f, p, x, smooth=[x])
    assert not [e for e in out.smoothed if e.kind == "smoothed"], str(out)
    why = [n for n in out.not_smoothed if n.kernel == "['g']"]
    assert why and "γ + 1" in why[0].reason and "bfloat16" in why[0].reason, str(out)
    assert _rel(f(p, x), f(out.params, x)) < TOL          # (the norm itself folded)


def test_fold_stablehlo_smooths_the_gemma_norm():
    f, p, x = _mlp(True)
    exp = jax.export.export(jax.jit(f))(p, x)
    bound = {f"arg{i}": v for i, v in enumerate(jax.tree.leaves(p))}
    new, rep, prep = hlofold.fold_stablehlo(exp, params=bound, smooth=[[x]])
    assert any(e.kind == "smoothed" for e in rep.smoothed), str(rep)
    assert _rel(f(p, x), new.call(x, *prep)) < TOL


def test_rotate_passes_a_sharding_constraint_on_the_stream():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa
    p = {"embed": w(16, 8), "g": jnp.asarray(1 + rng.random(8), jnp.float32), "w": w(8, 8),
         "o": w(8, 8), "gf": jnp.asarray(1 + rng.random(8), jnp.float32), "head": w(8, 16)}
    stream = NamedSharding(mesh, P("data", None, None))

    def rms(x, g):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g

    def f(p, t):
        x = jax.lax.with_sharding_constraint(p["embed"][t], stream)
        x = x + rms(x, p["g"]) @ p["w"] @ p["o"]
        x = jax.lax.with_sharding_constraint(x, stream)
        return rms(x, p["gf"]) @ p["head"]
    t = jnp.asarray([[1, 2, 3]])
    out = hlofold.fold_params(f, p, t, rotate=True)
    assert out.rotation is not None and out.rotation.reason is None, str(out)
    assert _rel(f(p, t), f(out.params, t)) < 1e-4


def test_maxtexts_einsum_scale_is_smoothed():
    """MaxText applies γ as ``einsum("...k,k->...k", y, scale)``: read as the product it is
    (``_fold.jaxpr.canonical``), the norm pairs with the layer after it."""
    def f(p, x):
        y = jnp.einsum("...k,k->...k", _rms(x), p["g"])
        return jax.nn.gelu(y @ p["w1"]) @ p["w2"]
    _, p, x = _mlp(False)
    p = dict(p, g=1 + p["g"])
    out = hlofold.fold_params(f, p, x, smooth=[x])
    assert [(e.kind, e.first) for e in out.smoothed] == [("smoothed", "['g']")], str(out)
    assert _rel(f(p, x), f(out.params, x)) < TOL
