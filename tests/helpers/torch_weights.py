"""Weights for a module exported with its parameters as arguments, made from their names
alone: the same arrays in the generator (``tests/testdata/stablehlo/make_torch_xla.py``,
run where PyTorch is installed) and in the tests (where it is not). No hlofold or JAX
import: the generator imports this file by path."""
from __future__ import annotations

import zlib

import numpy as np


def weight(name: str, shape, dtype=np.float32) -> np.ndarray:
    """A trained-looking value for the parameter ``name`` (a PyTorch state-dict key):
    BatchNorm variances positive and spread around 1, means and shifts small, γ near 1,
    kernels scaled by their fan-in. Deterministic in the name."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    shape = tuple(int(d) for d in shape)
    if name.endswith("running_var"):
        v = np.exp(0.5 * rng.standard_normal(shape))
    elif name.endswith(("running_mean", "bias")):
        v = 0.1 * rng.standard_normal(shape)
    elif len(shape) == 1:                               # a BatchNorm's γ
        v = 1 + 0.2 * rng.standard_normal(shape)
    else:
        fan_in = int(np.prod(shape[1:])) or 1
        v = rng.standard_normal(shape) / np.sqrt(fan_in)
    return v.astype(dtype)
