"""Small decoders from the libraries' own layers, RMSNorm or LayerNorm: an embedding, one
pre-norm block ``x + Dense(gelu(Dense(norm(x))))``, a final norm and a head — Haiku
(``hk.Embed``, ``hk.LayerNorm``/``hk.RMSNorm``, ``hk.Linear``), Equinox (``eqx.nn.Embedding``,
``LayerNorm``/``RMSNorm``, ``Linear`` as ``W @ x`` under ``vmap``) and Keras
(``Embedding``, ``LayerNormalization``/``RMSNormalization``, ``Dense``). Each gives
``(f, params, tokens)``, its parameters trained-looking (γ ≠ 1, β ≠ 0)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

V, D = 32, 16
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 5)))


def trained(p, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(
        np.asarray(a) + 0.3 * rng.standard_normal(np.shape(a)), a.dtype), p)


def haiku_decoder(norm: str):
    import haiku as hk

    def make():
        return hk.LayerNorm(-1, True, True) if norm == "LayerNorm" else hk.RMSNorm(-1)

    def fwd(t):
        x = hk.Embed(V, D)(t)
        x = x + hk.Linear(D)(jax.nn.gelu(hk.Linear(2 * D)(make()(x))))
        return hk.Linear(V)(make()(x))
    m = hk.without_apply_rng(hk.transform(fwd))
    return m.apply, trained(m.init(jax.random.key(0), TOKENS)), TOKENS


def equinox_decoder(norm: str):
    import equinox as eqx
    Norm = getattr(eqx.nn, norm)

    class Decoder(eqx.Module):
        emb: eqx.nn.Embedding
        n1: eqx.Module
        a: eqx.nn.Linear
        b: eqx.nn.Linear
        n2: eqx.Module
        head: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.emb, self.n1, self.n2 = eqx.nn.Embedding(V, D, key=k[0]), Norm(D), Norm(D)
            self.a = eqx.nn.Linear(D, 2 * D, key=k[1])
            self.b = eqx.nn.Linear(2 * D, D, key=k[2])
            self.head = eqx.nn.Linear(D, V, key=k[3])

        def token(self, t):
            x = self.emb(t)
            x = x + self.b(jax.nn.gelu(self.a(self.n1(x))))
            return self.head(self.n2(x))

        def __call__(self, t):
            return jax.vmap(jax.vmap(self.token))(t)
    params, static = eqx.partition(Decoder(jax.random.key(0)), eqx.is_array)
    return (lambda p, t: eqx.combine(p, static)(t)), trained(params), TOKENS


def keras_decoder(norm: str):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    keras.utils.set_random_seed(0)
    Norm = getattr(keras.layers, "LayerNormalization" if norm == "LayerNorm"
                   else "RMSNormalization")
    inp = keras.Input((TOKENS.shape[1],), dtype="int32")
    x = keras.layers.Embedding(V, D)(inp)
    x = x + keras.layers.Dense(D)(keras.layers.Dense(2 * D, activation="gelu")(Norm()(x)))
    model = keras.Model(inp, keras.layers.Dense(V)(Norm()(x)))
    params = (trained([v.value for v in model.trainable_variables]),
              [v.value for v in model.non_trainable_variables])
    return (lambda p, t: model.stateless_call(p[0], p[1], t)[0]), params, TOKENS


def flax_scanned_decoder(norm: str, layers: int = 3):
    """Flax linen ``nn.scan`` over ``layers`` pre-norm blocks (the parameters stacked on a
    leading axis), embedding, final norm and a bias-free head."""
    import flax.linen as nn
    Norm = getattr(nn, norm)

    class ScanBlock(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.Dense(2 * D)(Norm()(x))
            return x + nn.Dense(D)(jax.nn.gelu(h)), None

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, t):
            x = nn.Embed(V, D)(t)
            x, _ = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=layers)()(x, None)
            return nn.Dense(V, use_bias=False)(Norm()(x))
    m = Decoder()
    return m.apply, trained(m.init(jax.random.key(0), TOKENS)), TOKENS
