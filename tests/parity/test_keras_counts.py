"""The differential test on keras_hub-style models (issue 39 item 4): the blocks keras_hub's
models are made of, built from Keras layers (keras_hub itself is not a dependency of the
suite; ``benchmarks/keras_hub_models.py`` runs the models when it is installed) — a Llama
decoder layer (RMSNorm, EinsumDense q/k/v with (d, heads, head_dim) kernels, rotary
embedding, SwiGLU), an EfficientNet MBConv block with squeeze-and-excite, a ViT encoder
layer (LayerNorm, EinsumDense q/k/v with (heads, head_dim) biases, GELU MLP). Folded on the
jaxpr path and, lowered, on the StableHLO path (weights as constants): every site has the
same status for the same kind of reason on both, the outputs equal the unfolded model's,
and every norm is folded or named."""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":                 # pragma: no cover
    pytest.skip("Keras is not on its JAX backend", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import hlofold  # noqa: E402
import hlofold._compat as C  # noqa: E402
from hlofold._base.reasons import reason_kind  # noqa: E402
from hlofold._ir.stablehlo.artifacts import module_callable  # noqa: E402
from tests.helpers import assert_close, lower_with_constants  # noqa: E402

L = keras.layers
D, H, K, F = 32, 4, 8, 64


def trained_like(layers, seed=0):
    rng = np.random.default_rng(seed)
    for layer in layers:
        for w in layer.weights:
            p = w.path.lower()
            if p.endswith(("gamma", "scale")):
                w.assign((1 + 0.3 * rng.standard_normal(w.shape)).astype("float32"))
            elif p.endswith(("beta", "moving_mean")) or (p.endswith("bias") and "norm" in p):
                w.assign((0.2 * rng.standard_normal(w.shape)).astype("float32"))
            elif p.endswith("moving_variance"):
                w.assign((0.5 + rng.random(w.shape)).astype("float32"))
            elif p.endswith("bias"):
                w.assign((0.1 * rng.standard_normal(w.shape)).astype("float32"))


def rotary(x):
    t = jnp.arange(x.shape[1], dtype=x.dtype)[None, :, None, None]
    inv = 1.0 / (10000 ** (jnp.arange(0, K, 2, dtype=x.dtype) / K))
    f = jnp.einsum("bi,j->bij", t[:, :, 0, 0], inv)
    e = jnp.stack((f, f), axis=-2).reshape(1, x.shape[1], 1, K)
    a, b = jnp.split(x, 2, axis=-1)
    return x * jnp.cos(e) + jnp.concatenate([-b, a], axis=-1) * jnp.sin(e)


def attention(q, k, v):
    s = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(K), axis=-1)
    return jnp.einsum("bhqs,bshk->bqhk", s, v)


def llama():
    n1, n2 = L.RMSNormalization(), L.RMSNormalization()
    q, k, v = (L.EinsumDense("btd,dhk->bthk", (None, H, K)) for _ in range(3))
    o = L.EinsumDense("bthk,hkd->btd", (None, D))
    gate, up, down = L.Dense(F, use_bias=False), L.Dense(F, use_bias=False), \
        L.Dense(D, use_bias=False)

    def f(x):
        h = n1(x)
        x = x + o(attention(rotary(q(h)), rotary(k(h)), v(h)))
        h = n2(x)
        return x + down(jax.nn.silu(gate(h)) * up(h))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, D)), jnp.float32)
    return f, x, [n1, n2, q, k, v, o, gate, up, down], 2


def mbconv():
    expand, bn0 = L.Conv2D(4 * 16, 1, use_bias=False), L.BatchNormalization()
    dw, bn1 = L.DepthwiseConv2D(3, padding="same", use_bias=False), L.BatchNormalization()
    se_r, se_e = L.Conv2D(4, 1), L.Conv2D(4 * 16, 1)
    proj, bn2 = L.Conv2D(16, 1, use_bias=False), L.BatchNormalization()

    def f(x):
        h = jax.nn.silu(bn0(expand(x), training=False))
        h = jax.nn.silu(bn1(dw(h), training=False))
        s = jnp.mean(h, axis=(1, 2), keepdims=True)
        h = h * jax.nn.sigmoid(se_e(jax.nn.silu(se_r(s))))
        return x + bn2(proj(h), training=False)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 8, 16)), jnp.float32)
    return f, x, [expand, bn0, dw, bn1, se_r, se_e, proj, bn2], 3


def vit():
    n1, n2 = L.LayerNormalization(), L.LayerNormalization()
    q, k, v = (L.EinsumDense("btd,dhk->bthk", (None, H, K), bias_axes="hk") for _ in range(3))
    o = L.EinsumDense("bthk,hkd->btd", (None, D), bias_axes="d")
    fc1, fc2 = L.Dense(F), L.Dense(D)

    def f(x):
        h = n1(x)
        x = x + o(attention(q(h), k(h), v(h)))
        return x + fc2(jax.nn.gelu(fc1(n2(x))))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, D)), jnp.float32)
    return f, x, [n1, n2, q, k, v, o, fc1, fc2], 2


def decisions(report):
    return collections.Counter((s.status, reason_kind(s.reason) if s.status == "refused"
                                else None) for s in report.sites)


@pytest.mark.slow
@pytest.mark.parametrize("make", [llama, mbconv, vit], ids=lambda m: m.__name__)
def test_keras_hub_style_blocks_count_alike_on_both_paths(make):
    f, x, layers, norms = make()
    f(x)                                  # build the layers
    trained_like(layers)
    ref = jax.jit(f)(x)
    folded, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x))
    text = lower_with_constants(jax.jit(f), x).as_text()
    ftext, srep = hlofold.fold_stablehlo(text)
    assert decisions(rep) == decisions(srep), (rep, srep)
    assert_close(ref, C.jaxpr_as_fun(folded)(x)[0], depth=6)
    assert_close(ref, module_callable(ftext)(x), depth=6)
    # every norm has a record: folded into each projection that reads it, or refused with
    # the reason (ViT's LayerNorm β in front of multi-head q/k/v), or named as unreached
    for r in (rep, srep):
        scaled = [s for s in r.sites if any(a in ("mul", "multiply") for a in s.absorbed)]
        assert len(scaled) + sum(s.status == "not-reached" for s in r.sites) >= norms, r
        assert all(s.status == "folded" or s.reason for s in scaled)
        assert r.num_folded > 0
