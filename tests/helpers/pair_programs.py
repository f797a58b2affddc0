"""Generated programs for the differential test of cross-layer equalization: a chain of
convolutions (dense, grouped, depthwise) and a final Dense, with random operations between
layers — ones equalization passes (bias, BatchNorm arithmetic, ReLU, max(x, 0), pooling,
zero padding, a transpose there and back) and ones it must stop at (ReLU6, tanh, a
residual add, a nonzero constant added, a shared kernel, a flatten). :func:`program`
gives ``(fn, params, x, expected pairs)``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PASS = ["bias", "bn", "relu", "max0", "maxpool", "avgpool", "pad", "transpose"]
STOP = ["relu6", "tanh", "residual", "add_const", "max_half"]


def _conv(x, k, groups):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=groups,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _op(name, x, p, key):
    """One operation between layers (``p``: the parameters, leaves named by ``key``)."""
    if name == "bias":
        return x + p[key + "b"]
    if name == "bn":
        inv = p[key + "g"] * lax.rsqrt(p[key + "v"] + 1e-5)
        return (x - p[key + "m"]) * inv + p[key + "beta"]
    if name == "relu":
        return jax.nn.relu(x)
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


def program(seed: int):
    """A random chain and the number of pairs equalization must find in it."""
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

    def fn(params, x):
        for i, (groups, ops) in enumerate(layers):
            x = _conv(x, params[f"k{i}"], groups)
            for j, name in enumerate(ops):
                x = _op(name, x, params, f"o{i}_{j}")
        y = x.mean((1, 2)) @ params["head"]
        return (y, params[f"k{n - 1}"].sum()) if shared else y

    x = jnp.asarray(rng.standard_normal((2, 6, 6, 3)), jnp.float32)
    return fn, p, x, expected, (layers, shared)
