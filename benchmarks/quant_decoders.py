"""Flax linen decoders for the quantization benchmark's smoothing and rotation rows
(``python -m benchmarks.quantization --smooth``): an embedding, pre-norm blocks, a final norm
and a head, built from the real ``flax.linen`` layers — RMSNorm Llama-style (no biases, a
gated SiLU MLP) or LayerNorm GPT-2-style (biases, a GELU MLP) — with causal
``MultiHeadDotProductAttention`` (multi-head ``DenseGeneral`` kernels), trained-looking norm
parameters and a few massive residual channels (the embedding's columns scaled up). Both
heads are bias-free (GPT-NeoX's, Llama's): the final LayerNorm's β stays in front of it as
β/γ when its γ folds (``ParamChange.front``)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np


def flax_decoder(norm: str, seed: int, outliers: float = 30.0, d: int = 128,
                 layers: int = 2, vocab: int = 256, heads: int = 4):
    """``(f, params, x, calibration inputs)`` for ``norm`` "RMSNorm" or "LayerNorm"."""
    import flax.linen as nn

    llama = norm == "RMSNorm"
    Norm = getattr(nn, norm)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = Norm()(x)
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.MultiHeadDotProductAttention(heads, use_bias=not llama)(h, mask=mask)
            h = Norm()(x)
            if llama:
                g, u = nn.Dense(2 * d, use_bias=False)(h), nn.Dense(2 * d, use_bias=False)(h)
                return x + nn.Dense(d, use_bias=False)(jax.nn.silu(g) * u)
            return x + nn.Dense(d)(jax.nn.gelu(nn.Dense(4 * d)(h)))

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, d)(tokens)
            for _ in range(layers):
                x = Block()(x)
            return nn.Dense(vocab, use_bias=False)(Norm()(x))

    rng = np.random.default_rng(500 + seed)
    m = Decoder()

    def inputs(k):
        return (jnp.asarray(np.random.default_rng(k).integers(0, vocab, (4, 16)), jnp.int32),)
    x = inputs(seed)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: _trained(jax.tree_util.keystr(path), np.array(a), rng, outliers),
        m.init(jax.random.key(seed), *x))
    return m.apply, params, x, [inputs(1000 + 10 * seed + j) for j in range(4)]


def _trained(path: str, a: np.ndarray, rng, outliers: float):
    """Norm scales spread over ±0.3 decades, offsets and biases ~0.1, the embedding's
    3 massive channels ×``outliers``."""
    if "Norm" in path and path.endswith("['scale']"):
        a = 10 ** rng.uniform(-0.3, 0.3, a.shape)
    elif path.endswith("['bias']"):
        a = 0.1 * rng.standard_normal(a.shape)
    elif path.endswith("['embedding']"):
        a = a.copy()
        a[:, rng.choice(a.shape[1], 3, replace=False)] *= outliers
    return jnp.asarray(a, jnp.float32)


def keras_llama(rng, seed: int, outliers: float):
    """keras_hub's Llama (2 layers, d = 128, GQA), its embedding with 3 massive channels;
    keras_hub is not a dependency of the suite (see ``benchmarks/keras_hub_models.py``)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    import keras_hub
    keras.utils.set_random_seed(seed)
    bb = keras_hub.models.LlamaBackbone(vocabulary_size=256, num_layers=2, hidden_dim=128,
                                        intermediate_dim=256, num_query_heads=4,
                                        num_key_value_heads=2)
    massive = rng.choice(128, 3, replace=False)
    for w in bb.weights:
        path = w.path.lower()
        if "embeddings" in path and len(w.shape) == 2:
            e = np.array(w.value)
            e[:, massive] *= outliers
            w.assign(e)
        elif len(w.shape) == 1 and ("norm" in path or path.endswith("scale")):
            w.assign((10 ** rng.uniform(-0.3, 0.3, w.shape)).astype("float32"))

    def f(params, ids):
        return bb.stateless_call(params[0], params[1], {
            "token_ids": ids, "padding_mask": jnp.ones(ids.shape, jnp.int32)})[0]
    params = ([v.value for v in bb.trainable_variables],
              [v.value for v in bb.non_trainable_variables])

    def inputs(k):
        return (jnp.asarray(np.random.default_rng(k).integers(0, 256, (4, 16)), jnp.int32),)
    return f, params, inputs(seed), [inputs(1000 + 10 * seed + j) for j in range(4)]
