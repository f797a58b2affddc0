"""Transformer blocks shared by the tests: a Flax linen pre-norm block and Llama/Gemma-style
decoders in plain JAX, with trained-looking norm parameters (γ ≠ 1, β ≠ 0)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

D, H, F = 16, 2, 24          # model width, heads, MLP width
RNG = np.random.default_rng(12)


def perturb(tree, scale=0.3, rng=None):
    """Trained-looking norm parameters: γ ≠ 1, β ≠ 0 (init values would fold trivially);
    drawn from ``rng``, else from the module's (then they depend on the calls before)."""
    rng = RNG if rng is None else rng
    return jax.tree.map(lambda a: a + jnp.asarray(rng.standard_normal(a.shape) * scale,
                                                  a.dtype) if hasattr(a, "shape") else a,
                        tree)


def attention(q, k, v):
    b, t, _ = q.shape
    split = lambda a: a.reshape(b, t, H, D // H)
    s = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(D // H)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), split(v)).reshape(b, t, D)


X = jnp.asarray(RNG.standard_normal((2, 5, D)), jnp.float32)


def flax_linen_block(norm, seed: int | None = None):
    """The block and its perturbed parameters (``seed``: drawn from their own generator)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = norm()(x)
            q, k, v = (nn.Dense(D, use_bias=b)(h) for b in (True, False, True))
            x = x + nn.Dense(D)(attention(q, k, v))
            h = norm()(x)
            g, u = nn.Dense(F)(h), nn.Dense(F)(h)
            return x + nn.Dense(D)(jax.nn.silu(g) * u)

    m = Block()
    return m.apply, perturb(m.init(jax.random.key(0), X),
                            rng=None if seed is None else np.random.default_rng(seed))


def decoder(spelling, layers=2, vocab=32):
    """A Llama- or Gemma-style decoder: embedding, ``layers`` pre-norm blocks, final norm,
    head tied to the embedding. Norm folds: 5 per layer + the head."""
    keys = iter(jax.random.split(jax.random.key(1), 16 * layers + 4))
    w = lambda *s: jax.random.normal(next(keys), s) / np.sqrt(s[0])

    def rms(x, g):
        h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
        return h * (1 + g) if spelling == "gemma" else h * g

    def f(p, tokens):
        x = p["embed"][tokens]
        for lp in p["layers"]:
            h = rms(x, lp["n1"])
            x = x + attention(h @ lp["q"], h @ lp["k"], h @ lp["v"]) @ lp["o"]
            h = rms(x, lp["n2"])
            x = x + (jax.nn.gelu(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]
        return rms(x, p["final"]) @ p["embed"].T

    p = {"embed": w(vocab, D), "final": 1 + 0.3 * w(D),
         "layers": [{"n1": 1 + 0.3 * w(D), "n2": 1 + 0.3 * w(D), "q": w(D, D), "k": w(D, D),
                     "v": w(D, D), "o": w(D, D), "gate": w(D, F), "up": w(D, F),
                     "down": w(F, D)} for _ in range(layers)]}
    return f, p


def flax_multi_head_block(bias: bool):
    """``(apply, variables, x, calibration)``: an RMSNorm read by Flax DenseGeneral q/k/v with
    (d, heads, head_dim) kernels, attention, and a DenseGeneral output projection contracting
    (heads, head_dim); two massive input channels."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.RMSNorm()(x)
            q, k, v = (nn.DenseGeneral((2, 8), use_bias=bias)(h) for _ in range(3))
            a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
            return x + nn.DenseGeneral(16, axis=(-2, -1))(jnp.einsum("bhqk,bkhd->bqhd", a, v))
    m = Block()
    rng = np.random.default_rng(4)

    def inputs(k):
        x = np.random.default_rng(k).standard_normal((2, 5, 16)).astype(np.float32)
        x[..., :2] *= 25
        return jnp.asarray(x)
    x = inputs(0)
    v = m.init(jax.random.key(0), x)
    v = jax.tree.map(lambda a: (a * (1 + 0.3 * rng.random(a.shape)) +
                                0.1 * rng.standard_normal(a.shape)).astype(a.dtype), v)
    return m.apply, v, x, [inputs(k) for k in (1, 2)]     # (biases not zero)


def gqa_block(repeat: int):
    """``(fn, params, x, calibration)``: an RMSNorm-free attention block whose v has
    ``4 // repeat`` kv heads, repeated ``repeat`` times to the 4 query heads (``jnp.repeat``
    along the head axis, as Llama-style grouped-query attention does), then o; massive
    input channels."""
    rng = np.random.default_rng(7)
    d, hd, kvh = 16, 4, 4 // repeat
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa
    p = {"q": w(d, 4 * hd), "k": w(d, kvh * hd), "v": w(d, kvh * hd), "o": w(4 * hd, d)}

    def fn(p, x):
        b, t, _ = x.shape
        q = (x @ p["q"]).reshape(b, t, 4, hd)
        k = jnp.repeat((x @ p["k"]).reshape(b, t, kvh, hd), repeat, axis=2)
        v = jnp.repeat((x @ p["v"]).reshape(b, t, kvh, hd), repeat, axis=2)
        a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
        return x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, 4 * hd) @ p["o"]

    def inputs(k):
        x = np.random.default_rng(k).standard_normal((2, 5, d)).astype(np.float32)
        x[..., :2] *= 20
        return jnp.asarray(x)
    return fn, p, inputs(0), [inputs(k) for k in (1, 2)]


def constrained_block(constrain: bool):
    """``(fn, params, x, calibration)``: RMSNorm → gate/up → silu(gate)·up → down, then
    ReLU MLP k1 → k2, with (``constrain``) ``with_sharding_constraint`` on every activation
    between them, as MaxText writes its layers (a one-device mesh here)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    c = (lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P("data")))) \
        if constrain else (lambda a: a)
    rng = np.random.default_rng(11)
    d, f = 16, 24
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa
    p = {"g": jnp.asarray(10 ** rng.uniform(-0.5, 0.5, d), jnp.float32), "gate": w(d, f),
         "up": w(d, f), "down": w(f, d), "k1": w(d, f), "b1": w(f), "k2": w(f, d)}

    def fn(p, x):
        h = c(x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"])
        x = x + c(c(jax.nn.silu(h @ p["gate"])) * c(h @ p["up"])) @ p["down"]
        return c(jax.nn.relu(c(x @ p["k1"] + p["b1"]))) @ p["k2"]

    def inputs(k):
        x = np.random.default_rng(k).standard_normal((4, 5, d)).astype(np.float32)
        x[..., :2] *= 20
        return jnp.asarray(x)
    return fn, p, inputs(0), [inputs(k) for k in (1, 2)]


def uncounted_loop():
    """``(fn, params, x)``: two layers in a ``while_loop`` whose trip count depends on an
    input (not a counted loop over known stacks), each reading its rows at ``i % 3``."""
    rng = np.random.default_rng(0)
    p = {"k1": jnp.asarray(rng.standard_normal((3, 8, 8)), jnp.float32),
         "k2": jnp.asarray(rng.standard_normal((3, 8, 8)), jnp.float32)}

    def fn(p, x):
        def body(c):
            i, h = c
            return i + 1, h + jax.nn.relu(h @ p["k1"][i % 3]) @ p["k2"][i % 3]
        return jax.lax.while_loop(lambda c: c[0] < x.shape[0] + jnp.int32(x[0, 0] > 99),
                                  body, (jnp.int32(0), x))[1]
    return fn, p, jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)


def repeated_kv_bias_block():
    """``(fn, params, x)``: v's kv heads repeated to the query heads, then a bias per
    (query head, head_dim) — one value per position, not per channel — then o."""
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa
    p = {"v": w(16, 8), "o": w(16, 16), "b": w(4, 4)}

    def fn(p, x):
        b, t, _ = x.shape
        v = jnp.repeat((x @ p["v"]).reshape(b, t, 2, 4), 2, axis=2) + p["b"]
        return x + v.reshape(b, t, 16) @ p["o"]
    return fn, p, jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32)


def nested_layers_block():
    """``(fn, params, x)``: layers inside a ``checkpoint`` (two: a pair there, read as if
    inlined), a ``cond`` branch (one) and a one-device ``shard_map`` (two: a pair not read),
    none at the top level."""
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa
    p = {"k1": w(8, 16), "k2": w(16, 8), "k3": w(8, 8), "k4": w(8, 16), "k5": w(16, 8)}

    def fn(p, x):
        h = jax.checkpoint(lambda x: jax.nn.relu(x @ p["k1"]) @ p["k2"])(x)
        h = jax.lax.cond(x[0, 0] > 100, lambda h: h @ p["k3"], lambda h: h, h)
        return jax.shard_map(lambda q, h: jax.nn.relu(h @ q["k4"]) @ q["k5"], mesh=mesh,
                             in_specs=(P(), P("data")), out_specs=P("data"))(
                                 {k: p[k] for k in ("k4", "k5")}, h)
    return fn, p, jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
