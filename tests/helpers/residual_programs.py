"""Generated programs for the differential test of residual-stream equalization
(:mod:`hlofold._quant.core.streams`): a stem convolution, stages of residual blocks — an identity
shortcut (``x + body(x)``) or a projecting one (``proj(x) + body(x)``, a 1×1 convolution with
its BatchNorm), ReLU after the add (ResNet) or not (MobileNetV2's linear bottleneck) — a
mean and a head. Each body is two convolutions with random ops between (a pair of its own),
sometimes one the pair stops at; a stream sometimes meets what it cannot pass (tanh after an
add, the stream returned, its square). :func:`program` gives ``(fn, params, x, expected
records, expected streams)``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .pair_programs import apply_op

BODY = ["bn", "relu", "bias", "max0", "avgpool"]
STOP_STREAM = ["tanh", "output", "square"]


def _conv(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def program(seed: int):
    rng = np.random.default_rng(seed)
    p = {}

    def kernel(name, kh, cin, cout):
        p[name] = jnp.asarray(rng.standard_normal((kh, kh, cin, cout)) *
                              10 ** rng.uniform(-1, 1, cout), jnp.float32)

    def bn(name, c):
        p[name + "g"] = jnp.asarray(10 ** rng.uniform(-1, 1, c), jnp.float32)
        p[name + "v"] = jnp.asarray(np.exp(rng.standard_normal(c)), jnp.float32)
        p[name + "m"] = jnp.asarray(rng.standard_normal(c), jnp.float32)
        p[name + "beta"] = jnp.asarray(rng.standard_normal(c), jnp.float32)

    c = int(rng.choice([4, 6]))
    kernel("stem", 3, 3, c)
    bn("stem_bn", c)
    relu_after = bool(rng.random() < 0.5)
    blocks, segments, stopped = [], [[]], set()
    for b in range(int(rng.integers(1, 5))):
        project = b > 0 and rng.random() < 0.35 or (b == 0 and rng.random() < 0.2)
        cout = int(rng.choice([4, 6, 8])) if project else c
        mid = int(rng.choice([4, 8]))
        kernel(f"a{b}", 3, c, mid)
        kernel(f"b{b}", 1, mid, cout)
        bn(f"bnb{b}", cout)
        ops = [str(o) for o in rng.choice(BODY, size=int(rng.integers(0, 3)))]
        for j, name in enumerate(ops):
            if name == "bias":
                p[f"o{b}_{j}b"] = jnp.asarray(rng.standard_normal(mid), jnp.float32)
            if name == "bn":
                bn(f"o{b}_{j}", mid)
        body_stop = rng.random() < 0.2
        if project:
            kernel(f"p{b}", 1, c, cout)
            bn(f"bnp{b}", cout)
            segments.append([])
        stop = str(rng.choice(STOP_STREAM)) if rng.random() < 0.2 else None
        if stop:
            stopped.add(len(segments) - 1)
        segments[-1].append(b)
        blocks.append((project, ops, body_stop, stop))
        c = cout
    p["head"] = jnp.asarray(rng.standard_normal((c, 5)), jnp.float32)

    def norm(x, params, name):
        inv = params[name + "g"] * lax.rsqrt(params[name + "v"] + 1e-5)
        return (x - params[name + "m"]) * inv + params[name + "beta"]

    def fn(params, x):
        extra = []
        x = jax.nn.relu(norm(_conv(x, params["stem"]), params, "stem_bn"))
        for b, (project, ops, body_stop, stop) in enumerate(blocks):
            h = _conv(x, params[f"a{b}"])
            for j, name in enumerate(ops):
                h = apply_op(name, h, params, f"o{b}_{j}")
            if body_stop:
                h = jnp.tanh(h)
            h = norm(_conv(h, params[f"b{b}"]), params, f"bnb{b}")
            short = norm(_conv(x, params[f"p{b}"]), params, f"bnp{b}") if project else x
            x = h + short
            if relu_after:
                x = jax.nn.relu(x)
            if stop == "tanh":
                x = jnp.tanh(x)
            elif stop == "output":
                extra.append(x)
            elif stop == "square":
                x = x * x
        y = x.mean((1, 2)) @ params["head"]
        return (y, *extra) if extra else y

    # records: each body's pair (a → b) unless stopped; each segment of the stream (from the
    # stem or a projecting block to the next) one record — a plain pair where no add joins
    # it (a segment whose only block projects: its writer read by the next layers alone) —
    # unless a stop is in it
    pairs = sum(not bs for _, _, bs, _ in blocks)
    streams = 0
    for i, seg in enumerate(segments):
        if i in stopped:
            continue
        joined = any(not blocks[b][0] for b in seg) or (i > 0)
        pairs += not joined
        streams += joined
    x = jnp.asarray(rng.standard_normal((2, 6, 6, 3)), jnp.float32)
    return fn, p, x, pairs + streams, streams
