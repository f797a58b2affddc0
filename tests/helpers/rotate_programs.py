"""Generated decoders for the differential test of ``fold_params(..., rotate=True)``
(:mod:`hlofold._quant.jaxpr.rotate`): an embedding (indexed, or sliced to ``(…, 1, d)`` and
squeezed as Equinox's is under ``vmap``, sometimes scaled by a number as Gemma's), blocks
``x + write(act(read(norm(x))))`` and a head on a final norm. Each norm is one of the ways
the libraries spell RMSNorm and LayerNorm (Flax's zero subtracted and ``rsqrt·γ`` first,
Haiku's ``x·γ`` first, Keras' ``x·inv + (β − mean·inv)`` (no γ), a plain centered one over
``√var``, ``jnp.var``); each layer reads as ``h @ W`` or kernel first (``W @ h``), writes as
``a @ W + b`` or Equinox's transposed ``W @ a``; a third of them run the blocks as one
``lax.scan`` over stacked leaves (forward or reversed, unrolled by 1 or 2). :func:`program` gives ``(fn, params, tokens,
expected)`` with the readers, writers and offsets the rotation must find and whether ``Q``
must keep the all-ones direction; :func:`breaking` one the rotation must leave, with its
reason."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

EPS = 1e-5
RMS = ["rms_flax", "rms_haiku", "rms_plain"]
LN = ["ln_flax", "ln_keras", "ln_plain", "ln_var"]


def _mean(x):
    return x.mean(-1, keepdims=True)


def norm(kind, x, g, b):
    if kind == "rms_flax":
        zero = jnp.zeros(x.shape[:-1] + (1,), x.dtype)
        return (x - zero) * (lax.rsqrt(_mean(x * x) + EPS) * g.reshape((1,) * (x.ndim - 1) + (-1,)))
    if kind == "rms_haiku":
        return (x * g) * lax.rsqrt(jnp.broadcast_to(_mean(jnp.square(x)), x.shape) + EPS)
    if kind == "rms_plain":
        return x * lax.rsqrt(_mean(x ** 2) + EPS) * g
    m = _mean(x)
    if kind == "ln_flax":
        var = jnp.maximum(0.0, _mean(jnp.square(x)) - m * m)
        return (x - m) * (lax.rsqrt(var + EPS) * g) + b
    if kind == "ln_keras":                 # (Keras' spelling, scale=False: γ read once)
        inv = lax.rsqrt(_mean(jnp.square(x)) - jnp.square(m) + EPS)
        return x * inv + (b - m * inv)
    if kind == "ln_plain":
        c = x - m
        return c / jnp.sqrt(_mean(c * c) + EPS) * g + b
    return (x - m) * lax.rsqrt(jnp.var(x, -1, keepdims=True) + EPS) * g + b


def read(how, h, w, b):
    """``h @ w``, or (``w@x``: ``w`` stored ``(out, in)``) ``W @ h`` with the output moved."""
    y = h @ w if how == "x@w" else jnp.moveaxis(lax.dot_general(
        w, h, (((1,), (h.ndim - 1,)), ((), ()))), 0, -1)
    return y if b is None else y + b


def write(how, a, w, b):
    if how == "x@w":
        return a @ w + b
    y = lax.dot_general(w, a, (((1,), (a.ndim - 1,)), ((), ())))   # Equinox: W @ a
    return jnp.transpose(y, tuple(range(1, a.ndim)) + (0,)) + b


def program(seed: int):
    rng = np.random.default_rng(seed)
    d = int(rng.choice([8, 12, 16]))
    f = int(rng.choice([12, 16, 24]))
    layers = int(rng.integers(1, 4))
    vocab = 20
    kinds = [str(rng.choice(RMS + LN)) for _ in range(layers + 1)]
    reads = [str(rng.choice(["x@w", "w@x"])) for _ in range(layers + 1)]
    writes = [str(rng.choice(["x@w", "w@x"])) for _ in range(layers)]
    acts = [str(rng.choice(["relu", "gelu", "silu"])) for _ in range(layers)]
    embed = str(rng.choice(["index", "squeeze", "scaled"]))
    scan = None if rng.integers(3) else (bool(rng.integers(2)), int(rng.choice([1, 2])))
    if scan:                                  # one body for every layer: (reverse, unroll)
        kinds[:layers], reads[:layers] = [kinds[0]] * layers, [reads[0]] * layers
        writes, acts = [writes[0]] * layers, [acts[0]] * layers

    def w(*s):
        return jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)

    def vec(n, c=0.0, s=0.3):
        return jnp.asarray(c + s * rng.standard_normal(n), jnp.float32)
    def kernel(how, n_in, n_out):
        k = w(n_in, n_out)
        return k if how == "x@w" else jnp.asarray(np.array(k).T)
    p = {"embed": w(vocab, d), "layers": [], "final": {"g": vec(d, 1.0), "b": vec(d, 0, 0.1)},
         "head": kernel(reads[-1], d, vocab), "head_b": vec(vocab, 0, 0.1)}
    for i in range(layers):
        p["layers"].append({"g": vec(d, 1.0), "b": vec(d, 0, 0.1),
                            "w1": kernel(reads[i], d, f), "b1": vec(f, 0, 0.1),
                            "w2": kernel(writes[i], f, d), "b2": vec(d, 0, 0.1)})
    act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu}

    def fn(p, t):
        if embed == "squeeze":
            x = p["embed"][t[..., None]].squeeze(-2)
        else:
            x = p["embed"][t]
            if embed == "scaled":
                x = x * np.float32(np.sqrt(d))
        def block(x, lp, i=0):
            h = norm(kinds[i], x, lp["g"], lp["b"])
            return x + write(writes[i], act[acts[i]](read(reads[i], h, lp["w1"], lp["b1"])),
                             lp["w2"], lp["b2"])
        if scan:
            x, _ = lax.scan(lambda x, lp: (block(x, lp), None), x, p["layers"],
                            reverse=scan[0], unroll=scan[1])
        else:
            for i, lp in enumerate(p["layers"]):
                x = block(x, lp, i)
        h = norm(kinds[-1], x, p["final"]["g"], p["final"]["b"])
        return read(reads[-1], h, p["head"], p["head_b"])
    tokens = jnp.asarray(rng.integers(0, vocab, (2, 5)))
    used = kinds if not scan else [kinds[0], kinds[-1]]
    if scan:                                  # the layers' leaves stacked, one per name
        p["layers"] = {k: jnp.stack([lp[k] for lp in p["layers"]]) for k in p["layers"][0]}
    n = 1 if scan else layers
    expected = {"readers": n + 1, "writers": 2 * n, "offsets": sum(k in LN for k in used),
                "keep_ones": any(k in LN for k in kinds), "kinds": kinds, "scan": scan}
    return fn, p, tokens, expected


BREAKING = {
    "max_centered": ("x - max", "reduce_max reads the residual stream"),
    "channel_shift": ("x - a per-channel vector", "varies per channel"),
    "shared_reader": ("a reader's kernel read elsewhere", "is read elsewhere too"),
    "per_channel_mul": ("x · a per-channel leaf", "reads the normalized stream"),
    "token_sum": ("a sum over tokens", "over other axes than its channels"),
    "scan_ys": ("the stream a scan's per-layer output", "a scan's output other than its carry"),
    "scan_xs": ("the stream scanned over", "other than as its carry"),
    "rounded": ("the stream rounded to bfloat16's mantissa (reduce_precision)",
                "rounded to 7 mantissa bits (reduce_precision)"),
    "stored_bf16": ("the stream stored in bfloat16 (astype there and back)",
                    "rounded to bfloat16"),
}


def breaking(seed: int, what: str):
    """A small decoder with ``what`` (a key of :data:`BREAKING`) done to its stream before
    the final norm: ``(fn, params, tokens, reason)``."""
    rng = np.random.default_rng(seed)
    d, vocab = 8 + 4 * seed, 20

    def arr(*s, c=0.0):
        return jnp.asarray(c + rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
    p = {"embed": arr(vocab, d), "g": arr(d, c=1.0), "head": arr(d, vocab),
         "head_b": arr(vocab), "extra": arr(d), "w": arr(d, d)}

    def fn(p, t):
        x = p["embed"][t]
        if what == "max_centered":
            x = x - x.max(-1, keepdims=True)
        elif what == "channel_shift":
            x = x - p["extra"]
        elif what == "per_channel_mul":
            x = x * p["extra"]
        elif what == "token_sum":
            x = x + x.sum(1, keepdims=True)
        elif what == "scan_ys":
            x, ys = lax.scan(lambda c, _: (c + c @ p["w"], c), x, None, length=2)
            x = x + ys.sum(0)
        elif what == "scan_xs":
            x = x + lax.scan(lambda c, xt: (c, xt @ p["w"]), 0.0, x)[1]
        elif what == "rounded":
            x = lax.reduce_precision(x + x @ p["w"], exponent_bits=8, mantissa_bits=7)
        elif what == "stored_bf16":
            x = (x + x @ p["w"]).astype(jnp.bfloat16).astype(jnp.float32)
        y = norm("rms_plain", x, p["g"], None) @ p["head"] + p["head_b"]
        if what == "shared_reader":
            y = y + jnp.tanh(p["head"]).sum()
        return y
    return fn, p, jnp.asarray(rng.integers(0, vocab, (2, 5))), BREAKING[what][1]
