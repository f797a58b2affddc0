"""Counts mean what they say, the same on both paths (issue 39 item 4).

A site is ``refused`` only where an affine op was there to fold. Found running keras_hub's
Llama, Mistral, Gemma and Qwen (``benchmarks/keras_hub_models.py``): a projection whose output
feeds rotary embedding (``split`` and a product with the position's cos/sin) and the rotary
frequencies' own ``einsum`` (read by two ``stack`` ops) were counted refused, "folding would
change them", with nothing per-channel after them; the attention's ``scores · v``, whose rhs
has two free dimensions, was refused with nothing after it at all. Now both paths say
``no-pattern`` with the reason, and ``refused`` where a per-channel affine op does follow
(one of several readers; along a second output axis)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold._base.reasons import reason_kind
from tests.helpers import lower_with_constants

H, K, D = 4, 8, 32
rng = np.random.default_rng(0)
W = jnp.asarray(rng.standard_normal((D, H, K)) * 0.2, jnp.float32)
W2 = jnp.asarray(rng.standard_normal((D, 16)) * 0.2, jnp.float32)
G = jnp.asarray(1 + 0.3 * rng.standard_normal(16), jnp.float32)
GHK = jnp.asarray(1 + 0.3 * rng.standard_normal((H, K)), jnp.float32)
X = jnp.asarray(rng.standard_normal((2, 6, D)), jnp.float32)


def rotary(x):
    """A projection read by rotary embedding: split in halves, a product with cos/sin."""
    q = jnp.einsum("btd,dhk->bthk", x, W)
    t = jnp.arange(x.shape[1], dtype=jnp.float32)[None, :, None, None]
    cos, sin = jnp.cos(t * 0.1), jnp.sin(t * 0.1)
    a, b = jnp.split(q, 2, axis=-1)
    return q * cos + jnp.concatenate([-b, a], axis=-1) * sin


def frequencies(x):
    """The rotary frequencies' einsum, read twice (keras_hub's ``bi,j->bij`` then stack)."""
    pos = jnp.arange(x.shape[1], dtype=jnp.float32)[None, :]
    inv = 1.0 / (10000 ** (jnp.arange(0, 8, 2, dtype=jnp.float32) / 8))
    f = jnp.einsum("bi,j->bij", pos, inv)
    e = jnp.stack((f, f), axis=-2).reshape(1, x.shape[1], 8)   # (keras_hub's RotaryEmbedding)
    return x[..., :8] * jnp.cos(e) + x[..., 8:16] * jnp.sin(e)


def attention_out(x):
    """``scores · v``: the rhs (v, from the activations) has two free dimensions."""
    v = jnp.einsum("btd,dhk->bthk", x, W)
    s = jax.nn.softmax(jnp.einsum("btd,bsd->bts", x, x), -1)
    return jnp.einsum("bts,bshk->bthk", s, v)


def scaled_after_two_readers(x):
    """A projection read by a per-channel scale and returned as well: a refusal."""
    y = x @ W2
    return y * G, y


GH1 = GHK[:, :1]


def multi_output_then_part(x):
    """``x (d) · W (d, h, k)`` scaled per head (broadcast over head_dim): the (head,
    head_dim) block carries the channels, the scale is one of them per head: a fold."""
    return jnp.einsum("d,dhk->hk", x[0, 0], W) * GH1


def both(f):
    closed = jax.make_jaxpr(f)(X)
    _, rep = hlofold.fold_jaxpr(closed)
    text = lower_with_constants(jax.jit(f), X).as_text()
    _, srep = hlofold.fold_stablehlo(text)
    return rep, srep


def statuses(report, prefix):
    return sorted(s.status for s in report.sites if s.pattern.startswith(prefix))


@pytest.mark.parametrize("f", [rotary, frequencies, attention_out], ids=lambda f: f.__name__)
def test_nothing_per_channel_after_a_root_is_no_pattern(f):
    rep, srep = both(f)
    for r, prefix in ((rep, "dot_affine"), (srep, "stablehlo_dot")):
        assert "refused" not in statuses(r, prefix), r
        assert r.num_folded == 0
    assert statuses(rep, "dot_affine") == statuses(srep, "stablehlo_dot")
    if f is rotary:
        (site,) = [s for s in rep.sites if s.pattern == "dot_affine"]
        assert "none of them a per-channel affine op" in site.reason


def test_an_affine_op_there_is_a_refusal_on_both_paths():
    rep, srep = both(scaled_after_two_readers)
    for r, prefix in ((rep, "dot_affine"), (srep, "stablehlo_dot")):
        assert statuses(r, prefix) == ["refused"], r
        assert r.num_folded == 0
    assert {reason_kind(rep.refused[0].reason), reason_kind(srep.refused[0].reason)} == \
        {"consumers"}


def test_a_scale_per_head_after_a_multi_output_root_folds_on_both_paths():
    rep, srep = both(multi_output_then_part)
    for r, prefix in ((rep, "dot_affine"), (srep, "stablehlo_dot")):
        assert statuses(r, prefix) == ["folded"], r


def test_a_keras_layernorm_no_root_reaches_is_named_on_both_paths():
    """Keras's LayerNormalization computes ``rsqrt(σ²+ε)·γ`` first (a per-token factor times
    a per-channel vector, broadcast by the ``mul`` itself on the jaxpr): the jaxpr path did
    not see it as a per-channel scale, the StableHLO path did (keras_hub ViT's final norm)."""
    import os
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("Keras is not on its JAX backend")
    inp = keras.Input((5, 16))
    m = keras.Model(inp, keras.layers.LayerNormalization()(keras.layers.Dense(16)(inp)))
    for w in m.weights:
        if w.path.endswith("gamma"):
            w.assign(np.linspace(0.5, 1.5, 16).astype("float32"))
    tv = [v.value for v in m.trainable_variables]

    def f(tv, x):
        return m.stateless_call(tv, [], x)[0]
    x = jnp.ones((2, 5, 16))
    _, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(tv, x))
    _, srep = hlofold.fold_stablehlo(lower_with_constants(jax.jit(f), tv, x).as_text())
    for r in (rep, srep):
        (nr,) = [s for s in r.sites if s.status == "not-reached"]
        assert nr.out_channels == 16 and "after rsqrt" in nr.reason
    assert rep.counts() == srep.counts() == {"canonical": 1, "not-reached": 1}
