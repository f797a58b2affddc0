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


_CONSTRAINED = r"""
import jax, jax.numpy as jnp, numpy as np, hlofold
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
rng = np.random.default_rng(0)
def f(p, x):
    y = lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    y = lax.with_sharding_constraint(y, NamedSharding(mesh, P("data")))
    y = jax.nn.relu((y - p["m"]) * lax.rsqrt(p["v"] + 1e-3) * p["g"] + p["b"])
    return lax.conv_general_dilated(y, p["k2"], (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))
w = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
p = {"k": w(3, 3, 3, 8), "m": w(8), "v": jnp.asarray(rng.random(8) + .5, jnp.float32),
     "g": w(8), "b": w(8), "k2": w(1, 1, 8, 4)}
x = w(4, 6, 6, 3)
ref = jax.jit(f)(p, x)
for kw in ({}, {"equalize": True}):
    out = hlofold.fold_params(f, p, x, **kw)          # (raised: input shardings disagree)
    assert out.changes, out
    assert all(not a.committed for a in jax.tree.leaves(out.params)), "committed leaves"
    got = jax.jit(f)(out.params, x)
    assert got.sharding == ref.sharding, (got.sharding, ref.sharding)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
print("ok constrained")
"""


_CONSTRAINED_CHAINS = r"""
import jax, numpy as np, hlofold
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tests.helpers.pair_programs import program
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
on = lambda y: lax.with_sharding_constraint(y, NamedSharding(mesh, P("data")))
for seed in range(8):
    fn, p, x, expected, spec = program(seed, rounding=seed % 2 == 1, constrain=on)
    ref = jax.jit(fn)(p, x)
    for kw in ({}, {"equalize": True}):
        out = hlofold.fold_params(fn, p, x, **kw)
        assert not kw or len(out.equalized) == expected, (seed, str(out))
        assert all(not a.committed for a in jax.tree.leaves(out.params)), (seed, kw)
        got = jax.jit(fn)(out.params, x)
        for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
            assert g.sharding == r.sharding, (seed, kw, g.sharding, r.sharding)
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
print("ok constrained")
"""


def _on_eight_devices(script):
    import os
    import subprocess
    import sys
    from tests.helpers import ROOT
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          " --xla_force_host_platform_device_count=8").strip())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok constrained" in r.stdout, (r.stdout + r.stderr)[-4000:]


def test_generated_chains_with_constrained_activations_and_plain_parameters():
    """Item 6 over the generated chains (every second with an activation rounded to bfloat16
    too): each layer's output constrained on a 2 × 4 mesh, the parameters plain arrays —
    fold_params (plain and equalize=) runs, pairs the chain's pairs, places no new leaf, and
    jax.jit of the new tree gives jax.jit's shardings and values."""
    _on_eight_devices(_CONSTRAINED_CHAINS)


def test_fold_params_on_constrained_activations_with_plain_parameters():
    """Issue 68, item 6: a model constraining its activations on a 2 × 4 mesh, its parameters
    plain (uncommitted) arrays: fold_params' check raised "Computation was compiled for input
    shardings that disagree…" — its new leaves were committed to device 0, which also broke
    the user's own jax.jit of the new tree. New leaves are placed as the old ones: by no one."""
    _on_eight_devices(_CONSTRAINED)


@pytest.mark.slow   # generated: CI runs it in the slow tier
@pytest.mark.parametrize("freeze", [0, ()])
def test_generated_x64_toggles_between_calls(freeze):
    """Random sequences of calls of one folded function with x64 turned on and off between
    them, NumPy float64/float32 or JAX inputs, the same or fresh parameter objects: every
    answer has ``jax.jit``'s dtype and values, and afterwards plain ``jax.jit`` runs every
    array the sequence used under either setting (nothing left behind)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    f, p0, x0 = _case(2)
    step = st.tuples(st.booleans(), st.sampled_from(["np64", "np32", "jax"]), st.booleans())

    @hypothesis.settings(max_examples=12, deadline=None)
    @hypothesis.given(st.lists(step, min_size=2, max_size=5))
    def run(calls):
        folded, used = hlofold.fold(f, freeze=freeze), []
        same = {}                  # per kind, the parameter objects passed again
        for on, kind, fresh in calls:
            with x64(on):
                conv = {"np64": lambda a: np.asarray(a, np.float64),
                        "np32": lambda a: np.asarray(a, np.float32),
                        "jax": jax.numpy.asarray}[kind]
                p = {k: conv(v) for k, v in p0.items()}
                p = p if fresh or kind == "jax" else same.setdefault(kind, p)
                x = conv(x0)
                used.append((p, x))
                got, want = folded(p, x), jax.jit(f)(p, x)
                assert got.dtype == want.dtype, (calls, got.dtype, want.dtype)
                np.testing.assert_allclose(np.asarray(got, np.float64),
                                           np.asarray(want, np.float64), rtol=1e-5, atol=1e-5)
        for on in (False, True):
            with x64(on):
                for p, x in used:
                    jax.block_until_ready(jax.jit(f)(p, x))   # (raised after the bug)
    run()
