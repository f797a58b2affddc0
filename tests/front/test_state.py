"""hlofold leaves nothing behind that breaks a later program (issue 68, item 5): a folded
function called once under ``jax_enable_x64`` with float64 NumPy arrays, then x64 turned off,
made every later ``jax.jit(f)(p, x)`` of those arrays — not only hlofold's — fail with
``RuntimeProgramInputMismatch`` (JAX caches the device buffers of a jaxpr's constants by the
array, and ``freeze=`` traced the user's own arrays as constants), and the folded function
itself ran its float64 program on float32 inputs (its cache keyed no x64)."""
from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
from jax import lax

import hlofold


@contextlib.contextmanager
def x64(on: bool):
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", was)


def _case(seed=0):
    rng = np.random.default_rng(seed)

    def f(p, x):
        y = lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (y - p["m"]) * lax.rsqrt(p["v"] + 1e-3) * p["g"] + p["b"]
    p = {"k": rng.standard_normal((3, 3, 3, 4)), "m": rng.standard_normal(4),
         "v": rng.random(4) + 0.5, "g": rng.standard_normal(4), "b": rng.standard_normal(4)}
    return f, p, rng.standard_normal((1, 6, 6, 3))


@pytest.mark.parametrize("freeze", [0, ()])
@pytest.mark.parametrize("first,then", [(True, False), (False, True)])
def test_x64_toggled_between_calls(freeze, first, then):
    f, p, x = _case()
    jf = jax.jit(f)
    folded = hlofold.fold(jf, freeze=freeze)
    with x64(first):
        a = folded(p, x)
        assert a.dtype == (np.float64 if first else np.float32)
    with x64(then):
        want = np.float64 if then else np.float32
        for g in (jax.jit(f), jf, jax.jit(lambda p, x: f(p, x)), folded):
            got = g(p, x)                        # (raised RuntimeProgramInputMismatch)
            assert got.dtype == want
            np.testing.assert_allclose(np.asarray(got, np.float64),
                                       np.asarray(jax.jit(f)(p, x), np.float64),
                                       rtol=1e-5, atol=1e-5)
        for _ in range(2):                       # the steady path too
            assert folded(p, x).dtype == want


def test_the_frozen_arrays_are_left_as_given():
    f, p, x = _case(1)
    before = {k: v.copy() for k, v in p.items()}
    with x64(True):
        hlofold.fold(f, freeze=0)(p, x)
    assert all(np.array_equal(before[k], p[k]) and p[k].dtype == np.float64 for k in p)
