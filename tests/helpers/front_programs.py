"""Generated programs for the differential test of ``fold_params`` keeping a front shift in
place (:meth:`hlofold._front.identities.Writer.site`, ``keep_front``): a per-channel affine of
parameter leaves in front of one or more layers — a BatchNorm (``(x − μ)·rsqrt(σ² + ε)·γ
+ β``), a norm's ``x̂·γ + β``, ``(x − m)/s``, ``(x + β)·γ`` — read by dense layers with and
without a bias, or by a convolution padded (SAME, explicit, dilated, strided, grouped) or
not. Where a reader has no bias for ``β·K`` or the convolution's border would need a bias
per position, the written tree keeps the shift in front as ``t/s``. :func:`program` gives
``(fn, params, x, expect)``: ``expect["front"]`` whether the shift stays in front."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

FRONTS = ["bn", "norm", "center_scale", "add_then_mul"]
READERS = ["dense", "dense_bias", "conv_same", "conv_valid", "conv_explicit",
           "conv_dilated", "conv_strided", "conv_grouped"]


def _front(kind, x, p):
    if kind == "bn":
        return (x - p["mu"]) * lax.rsqrt(p["var"] + 1e-5) * p["g"] + p["b"]
    if kind == "norm":
        return x * p["g"] + p["b"]
    if kind == "center_scale":
        return (x - p["mu"]) / p["s"]
    return (x + p["b"]) * p["g"]


def _conv(x, k, how):
    pad = {"conv_same": "SAME", "conv_valid": "VALID", "conv_explicit": ((2, 0), (1, 1)),
           "conv_dilated": "SAME", "conv_strided": "SAME", "conv_grouped": "SAME"}[how]
    return lax.conv_general_dilated(
        x, k, (2, 2) if how == "conv_strided" else (1, 1), pad,
        rhs_dilation=(2, 2) if how == "conv_dilated" else (1, 1),
        feature_group_count=2 if how == "conv_grouped" else 1,
        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def program(seed: int):
    rng = np.random.default_rng(seed)
    c = int(rng.choice([4, 6, 8]))
    front = str(rng.choice(FRONTS))
    conv = bool(rng.integers(2))
    pool = [r for r in READERS if r.startswith("conv") == conv]
    readers = [str(rng.choice(pool)) for _ in range(int(rng.integers(1, 3)) if not conv else 1)]

    def arr(*s, lo=None):
        a = rng.standard_normal(s)
        return jnp.asarray(np.abs(a) + lo if lo else a, jnp.float32)
    p = {"mu": arr(c), "var": arr(c, lo=0.3), "g": arr(c, lo=0.2) * jnp.asarray(
        rng.choice([-1.0, 1.0], c), jnp.float32), "b": arr(c), "s": arr(c, lo=0.5)}
    for i, r in enumerate(readers):
        if r.startswith("conv"):
            groups = 2 if r == "conv_grouped" else 1
            p[f"k{i}"] = arr(3, 3, c // groups, 6)
        else:
            p[f"k{i}"] = arr(c, 5)
            if r == "dense_bias":
                p[f"kb{i}"] = arr(5)

    def fn(p, x):
        h = _front(front, x, p)
        outs = []
        for i, r in enumerate(readers):
            if r.startswith("conv"):
                outs.append(_conv(h, p[f"k{i}"], r))
            else:
                y = h @ p[f"k{i}"]
                outs.append(y + p[f"kb{i}"] if r == "dense_bias" else y)
        return outs
    shape = (2, 7, 6, c) if conv else (3, c)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    padded = any(r in ("conv_same", "conv_explicit", "conv_dilated", "conv_strided",
                       "conv_grouped") for r in readers)
    no_bias = any(r in ("dense",) or r.startswith("conv") for r in readers)
    expect = {"front": padded or no_bias, "sites": len(readers), "readers": readers,
              "kind": front}
    return fn, p, x, expect
