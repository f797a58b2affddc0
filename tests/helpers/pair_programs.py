"""Generated programs for the differential test of cross-layer equalization: a chain of
convolutions (dense, grouped, depthwise) and a final Dense, with random operations between
layers — ones equalization passes (bias, BatchNorm arithmetic, ReLU, max(x, 0), pooling,
zero padding, a transpose there and back, LeakyReLU) and ones it must stop at (ReLU6, tanh, a
residual add, a nonzero constant added, a shared kernel, a flatten). :func:`program`
gives ``(fn, params, x, expected pairs)``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PASS = ["bias", "bn", "relu", "max0", "maxpool", "avgpool", "pad", "transpose", "leaky"]
STOP = ["relu6", "tanh", "residual", "add_const", "max_half"]


def _conv(x, k, groups):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=groups,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def apply_op(name, x, p, key):
    """One operation between layers (``p``: the parameters, leaves named by ``key``)."""
    if name == "bias":
        return x + p[key + "b"]
    if name == "bn":
        inv = p[key + "g"] * lax.rsqrt(p[key + "v"] + 1e-5)
        return (x - p[key + "m"]) * inv + p[key + "beta"]
    if name == "relu":
        return jax.nn.relu(x)
    if name == "leaky":
        return jax.nn.leaky_relu(x, 0.1)
    if name == "max0":
        return jnp.maximum(x, 0.0)
    if name == "maxpool":
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")
    if name == "avgpool":
        return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 1, 1), "SAME") / 4
    if name == "pad":
        return jnp.pad(x, ((0, 0), (1, 0), (0, 1), (0, 0)))
    if name == "transpose":
        return jnp.transpose(jnp.transpose(x, (0, 3, 1, 2)), (0, 2, 3, 1))
    if name == "relu6":
        return jax.nn.relu6(x)
    if name == "tanh":
        return jnp.tanh(x)
    if name == "residual":
        return x + jnp.roll(x, 1, axis=-1)
    if name == "add_const":
        return x + 0.5
    if name == "max_half":
        return jnp.maximum(x, 0.5)
    raise ValueError(name)


def program(seed: int, rounding: bool = False, constrain=None):
    """A random chain and the number of pairs equalization must find in it; with
    ``rounding``, an activation rounded to bfloat16 between two layers as well
    (``lax.reduce_precision`` or a cast there and back: a pair through it rescales by powers
    of two), drawn after the rest (the chain as without it); ``constrain`` (a function of an
    activation, e.g. a sharding constraint) is applied to each layer's output."""
    rng = np.random.default_rng(seed)
    c, layers, p = 3, [], {}
    n = int(rng.integers(2, 5))
    for i in range(n):
        out = int(rng.choice([4, 6, 8]))
        groups = 1
        if i and rng.random() < 0.4:             # depthwise (with a multiplier) or grouped
            groups = c if rng.random() < 0.6 else (2 if c % 2 == 0 else 1)
            out = groups * int(rng.integers(1, 3)) if groups == c else out - out % groups
        k = rng.standard_normal((3, 3, c // groups, out)) * 10 ** rng.uniform(-1, 1, out)
        p[f"k{i}"] = jnp.asarray(k, jnp.float32)
        ops = list(rng.choice(PASS, size=int(rng.integers(0, 4))))
        if rng.random() < 0.3:
            ops.insert(int(rng.integers(0, len(ops) + 1)), str(rng.choice(STOP)))
        for j, name in enumerate(ops):
            key = f"o{i}_{j}"
            if name == "bias":
                p[key + "b"] = jnp.asarray(rng.standard_normal(out), jnp.float32)
            if name == "bn":
                p[key + "g"] = jnp.asarray(10 ** rng.uniform(-1, 1, out), jnp.float32)
                p[key + "v"] = jnp.asarray(np.exp(rng.standard_normal(out)), jnp.float32)
                p[key + "m"] = jnp.asarray(rng.standard_normal(out), jnp.float32)
                p[key + "beta"] = jnp.asarray(rng.standard_normal(out), jnp.float32)
        layers.append((groups, ops))
        c = out
    p["head"] = jnp.asarray(rng.standard_normal((c, 5)), jnp.float32)
    shared = rng.random() < 0.15                 # the last kernel read once more
    # pairs: between conv i and i+1 when nothing stops the path; the last conv reaches the
    # head through a mean (passes) unless stopped; a shared kernel stops both its pairs
    stops = [any(o in STOP for o in ops) for _, ops in layers]
    expected = sum(not s for s in stops)
    if shared:
        expected -= (not stops[-1]) + (n > 1 and not stops[-2])

    x = jnp.asarray(rng.standard_normal((2, 6, 6, 3)), jnp.float32)
    where = None                         # (layer, position among its ops, spelling)
    if rounding:
        i = int(rng.integers(0, n))
        where = (i, int(rng.integers(0, len(layers[i][1]) + 1)),
                 str(rng.choice(["reduce_precision", "astype"])))

    def fn(params, x):
        for i, (groups, ops) in enumerate(layers):
            x = _conv(x, params[f"k{i}"], groups)
            x = x if constrain is None else constrain(x)
            for j, name in enumerate([*ops, None]):
                if where is not None and where[:2] == (i, j):
                    x = (lax.reduce_precision(x, 8, 7) if where[2] == "reduce_precision"
                         else x.astype(jnp.bfloat16).astype(jnp.float32))
                if name is not None:
                    x = apply_op(name, x, params, f"o{i}_{j}")
        y = x.mean((1, 2)) @ params["head"]
        return (y, params[f"k{n - 1}"].sum()) if shared else y
    fn.rounding = where
    return fn, p, x, expected, (layers, shared)


def decoder_program(seed: int):
    """A random pre-norm decoder layer for smoothing: norms (RMS or with β) read by one to
    three projections, heads split and merged (``probs @ v`` with the heads a batch axis,
    or transposed first), a gated MLP, a final norm and head; sometimes an op that stops a
    path. Returns ``(fn, params, x, calibration, expected pairs)``."""
    rng = np.random.default_rng(seed)
    d, heads, f = 16, int(rng.choice([1, 2, 4])), 24
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa
    g = lambda: jnp.asarray(10 ** rng.uniform(-0.5, 0.5, d), jnp.float32)           # noqa
    beta = rng.random() < 0.5
    readers = int(rng.integers(1, 4))
    transposed = rng.random() < 0.5
    stop_v, stop_up = (str(rng.choice(STOP[:2] + ["add_const"])) if rng.random() < 0.3
                       else None for _ in range(2))
    p = {"n1": g(), "n2": g(), "nf": g(), "q": w(d, d), "k": w(d, d), "v": w(d, d),
         "o": w(d, d), "gate": w(d, f), "up": w(d, f), "down": w(f, d), "head": w(d, 7)}
    if beta:
        p["b1"] = jnp.asarray(rng.standard_normal(d) * 0.1, jnp.float32)
    # v and o as multi-head kernels (Flax DenseGeneral, Keras EinsumDense): (d, heads,
    # head_dim) and (heads, head_dim, d), sometimes with a bias over (heads, head_dim)
    multi = rng.random() < 0.4
    if multi:
        hd = d // heads
        p["v"], p["o"] = p["v"].reshape(d, heads, hd), p["o"].reshape(heads, hd, d)
        if rng.random() < 0.5:
            p["bv"] = jnp.asarray(rng.standard_normal((heads, hd)) * 0.1, jnp.float32)
    # grouped-query attention: k and v with heads / group kv heads, each repeated group
    # times to the query heads (``jnp.repeat``, as Llama's); drawn last (the rest as before)
    group = int(rng.choice([g for g in (1, 2, 4) if heads % g == 0]))
    kvh, hd = heads // group, d // heads
    if group > 1:
        p["k"] = p["k"][:, :kvh * hd]
        if multi:
            p["v"] = p["v"][:, :kvh]
            if "bv" in p:
                p["bv"] = p["bv"][:kvh]
        else:
            p["v"] = p["v"][:, :kvh * hd]

    # each layer a checkpoint (jax.checkpoint / nn.remat, as MaxText's): drawn after the rest
    remat = rng.random() < 0.3

    def norm(x, gamma, b=None):
        h = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * gamma
        return h if b is None else h + b

    def layer(params, x):
        b, t, _ = x.shape
        h = norm(x, params["n1"], params.get("b1"))
        if multi:
            v = jnp.einsum("btd,dhe->bthe", h, params["v"]) + params.get("bv", 0.0)
        else:
            v = h @ params["v"]
        q = h @ params["q"] if readers > 1 else x @ params["q"]
        k = h @ params["k"] if readers > 2 else x @ params["k"]
        if stop_v:
            v = apply_op(stop_v, v, params, "")
        split = lambda a: a.reshape(b, t, heads, d // heads)            # noqa: E731
        repeat = lambda a: a if group == 1 else jnp.repeat(a, group, axis=2)  # noqa: E731
        kv = lambda a: repeat(a.reshape(b, t, kvh, d // heads))         # noqa: E731
        split_v = repeat if multi else kv                               # noqa: E731
        s = jnp.einsum("bqhd,bkhd->bhqk", split(q), kv(k))
        a = jax.nn.softmax(s, -1)
        if transposed:
            o = jnp.transpose(jnp.einsum("bhqk,bhkd->bhqd", a,
                                         jnp.transpose(split_v(v), (0, 2, 1, 3))), (0, 2, 1, 3))
        else:
            o = jnp.einsum("bhqk,bkhd->bqhd", a, split_v(v))
        x = x + (jnp.einsum("bqhe,hed->bqd", o, params["o"]) if multi else
                 o.reshape(b, t, d) @ params["o"])
        h = norm(x, params["n2"])
        u = h @ params["up"]
        if stop_up:
            u = apply_op(stop_up, u, params, "")
        return x + (jax.nn.silu(h @ params["gate"]) * u) @ params["down"]
    if remat:
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)

    def final(params, x):
        return norm(x, params["nf"]) @ params["head"]

    def fn(params, x):
        return final(params, layer(params, x))

    def inputs(k):
        x = np.random.default_rng(k).standard_normal((2, 5, d)).astype(np.float32)
        x[..., :2] *= 20
        return jnp.asarray(x)
    expected = 3 + (stop_v is None) + (stop_up is None)
    fn.stops = (stop_v, stop_up)         # (what the test of the StableHLO path reads)
    fn.multi, fn.group, fn.remat = multi, group, remat
    fn.layer, fn.final = layer, final    # (scanned_decoder_program stacks the layer)
    return fn, p, inputs(seed), [inputs(seed + 100 + j) for j in range(3)], expected


def scanned_decoder_program(seed: int, layers: int, reverse: bool, unroll):
    """:func:`decoder_program`'s layer run ``layers`` times by ``lax.scan`` over its
    parameters stacked (each layer's own values: the drawn ones times per-channel factors),
    forward or reversed, ``unroll`` 1, 2 or whole — and the same layers unrolled, each with
    leaves of its own. Returns ``(scanned, stacked params, unrolled, its params, x,
    calibration, pairs per layer)``."""
    fn, p, x, calib, expected = decoder_program(seed)
    rng = np.random.default_rng(seed + 7)
    top = {k: p[k] for k in ("nf", "head")}
    per = [{k: v * jnp.asarray(10 ** rng.uniform(-0.3, 0.3, v.shape), v.dtype)
            for k, v in p.items() if k not in top} for _ in range(layers)]
    order = list(range(layers))[::-1] if reverse else list(range(layers))

    def scanned(params, x):
        x, _ = lax.scan(lambda h, lp: (fn.layer(lp, h), None), x, params["layers"],
                        reverse=reverse, unroll=unroll)
        return fn.final(params, x)

    def unrolled(params, x):
        for i in order:
            x = fn.layer(params["layers"][i], x)
        return fn.final(params, x)
    stacked = {"layers": jax.tree.map(lambda *a: jnp.stack(a), *per), **top}
    scanned.multi = unrolled.multi = fn.multi
    scanned.group = unrolled.group = fn.group
    scanned.stops = unrolled.stops = fn.stops
    return scanned, stacked, unrolled, {"layers": per, **top}, x, calib, expected - 1
