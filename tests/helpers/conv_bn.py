"""One conv → BatchNorm net in plain JAX, for the checks that run in processes of their own
(simulated JAX changes, meshes of 8 host devices) and the tests beside them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def conv_bn_params(rng: np.random.Generator, c: int = 4, **extra) -> dict:
    """A 3×3 kernel ``k`` and BatchNorm ``mean``, ``var``, ``gamma``, ``beta`` for ``c``
    channels (float32); ``extra``: more leaves, as shapes."""
    p = {"k": rng.normal(size=(3, 3, c, c)), "mean": rng.normal(size=c),
         "var": rng.uniform(0.5, 2, size=c), "gamma": rng.normal(size=c),
         "beta": rng.normal(size=c), **{n: rng.normal(size=s) for n, s in extra.items()}}
    return {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}


def conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def bn(y, mean, var, gamma, beta):
    return (y - mean) * jax.lax.rsqrt(var + 1e-5) * gamma + beta


def conv_bn(p, x):
    """``bn(conv(x, k))`` (NHWC, HWIO)."""
    return bn(conv(x, p["k"]), p["mean"], p["var"], p["gamma"], p["beta"])
