"""``@jax.jit`` helpers a fold crosses: a convolution in a jitted helper whose BatchNorm the
caller applies, a norm's scale applied before a helper that holds the projection.

Neither scope sees both ends, so the call is inlined first (the rule of
``hlofold._core.boundary``: ``_jaxpr.nested.crossed_calls`` on the jaxpr path,
``_stablehlo.calls.inline_crossed_calls`` for the private ``func.call`` JAX lowers the
helper to) — what XLA does with the call anyway. Before, both paths left these sites ("value
is an output of the top/jit(conv) program"). A helper whose shardings inlining would drop is
left on the jaxpr path with that reason; lowered, its shardings are constraints the StableHLO
path passes through (the one difference, in ``docs/reliability.md``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
import hlofold._compat as C
from tests.helpers import assert_close

RNG = np.random.default_rng(5)
K = jnp.asarray(RNG.standard_normal((4, 3, 3, 3)) / 5, jnp.float32)       # OIHW
K2 = jnp.asarray(RNG.standard_normal((4, 4, 1, 1)) / 2, jnp.float32)
S = jnp.asarray(RNG.uniform(0.5, 2.0, (1, 4, 1, 1)), jnp.float32)
T = jnp.asarray(RNG.standard_normal((1, 4, 1, 1)), jnp.float32)
S3 = jnp.asarray(RNG.uniform(0.5, 2.0, (1, 3, 1, 1)), jnp.float32)
X = jnp.asarray(RNG.standard_normal((2, 3, 8, 8)), jnp.float32)


def conv(x, k=K):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID")


jconv = jax.jit(conv)

CASES = {   # name: (program, the patterns folded)
    "layer inside, BN here": (lambda x: jnp.tanh(jconv(x) * S + T), ["conv_affine"]),
    "layer inside, BN here through a reshape": (
        lambda x: jnp.tanh(jconv(x).reshape(2, 4, 36) * S[..., 0] + T[..., 0]),
        ["conv_affine"]),
    "layer here, BN inside": (lambda x: jnp.tanh(jax.jit(lambda y: y * S + T)(conv(x))),
                              ["conv_affine"]),
    "scale here, layer inside": (lambda x: jnp.tanh(jconv(x * S3)), ["affine_conv"]),
    "one helper, two layers, two BNs": (
        lambda x: jnp.tanh(jax.jit(conv, static_argnums=())(jnp.tanh(jconv(x) * S + T), K2)
                           * S + T), ["conv_affine", "conv_affine"]),
}


def _prims(closed) -> list[str]:
    return [e.primitive.name for e in closed.jaxpr.eqns]


@pytest.mark.parametrize("name", list(CASES))
def test_a_fold_across_a_jit_helper_folds_on_both_paths(name):
    f, patterns = CASES[name]
    closed = jax.make_jaxpr(f)(X)
    new, rep = hlofold.fold_jaxpr(closed)
    assert sorted(s.pattern for s in rep.folded) == patterns, str(rep)
    assert not set(C.JIT_NAMES) & set(_prims(new)), new         # inlined, as XLA does
    assert "mul" not in _prims(new), new                        # the scale is in the kernel
    text, srep = hlofold.fold_stablehlo(jax.jit(f).lower(X).as_text())
    assert srep.num_folded == rep.num_folded == len(patterns), str(srep)
    assert "stablehlo.multiply" not in text and "call @" not in text, text
    assert_close(f(X), jax.jit(C.jaxpr_as_fun(new))(X)[0])


def test_the_decorator_folds_a_hand_written_model_with_a_jitted_conv():
    """Parameters as inputs: ``fold(f)`` prepares the helper's kernel like any other."""
    @jax.jit
    def conv_layer(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME")

    def f(p, x):
        for i in range(2):
            bn = p[f"bn{i}"]
            s = bn["gamma"] * jax.lax.rsqrt(bn["var"] + 1e-5)
            x = jax.nn.relu((conv_layer(x, p[f"k{i}"]) - bn["mean"][:, None, None]) *
                            s[:, None, None] + bn["beta"][:, None, None])
        return x
    p = {"k0": K, "k1": K2}
    for i in range(2):
        p[f"bn{i}"] = {k: jnp.asarray(v, jnp.float32) for k, v in {
            "gamma": RNG.uniform(0.5, 2, 4), "beta": RNG.standard_normal(4),
            "mean": RNG.standard_normal(4), "var": RNG.uniform(0.5, 2, 4)}.items()}
    folded = hlofold.fold(f)
    rep = folded.report(p, X)
    assert rep.num_folded == 2, str(rep)
    assert_close(jax.jit(f)(p, X), folded(p, X))
    assert_close(jax.jit(f)(p, X), jax.jit(folded)(p, X))
    written = hlofold.fold_params(f, p, X)
    assert len(written.changes) == 2, written
    assert_close(f(p, X), f(written.params, X))
    exported = jax.export.export(jax.jit(f))(p, X)
    _, srep = hlofold.fold_stablehlo(exported, in_graph=True)
    assert srep.num_folded == 2, str(srep)


def test_a_norm_folds_forward_into_a_jitted_projection_on_both_paths():
    W = jnp.asarray(RNG.standard_normal((16, 8)) / 4, jnp.float32)
    g = jnp.asarray(RNG.uniform(0.5, 2, 16), jnp.float32)
    h = jnp.asarray(RNG.standard_normal((4, 16)), jnp.float32)
    dense = jax.jit(lambda h: h @ W)

    def f(h):
        return dense(h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * g)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(h))
    assert [s.pattern for s in rep.folded] == ["affine_dot"], str(rep)
    _, srep = hlofold.fold_stablehlo(jax.jit(f).lower(h).as_text())
    assert srep.num_folded == 1, str(srep)
    assert_close(f(h), jax.jit(C.jaxpr_as_fun(new))(h)[0])


def test_a_helper_no_fold_crosses_is_kept():
    """A helper holding a whole site folds inside and stays a call; one with nothing
    per-channel at its boundary stays too (the report and program as before)."""
    whole = jax.jit(lambda x: jnp.tanh(conv(x) * S + T))
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(lambda x: conv(whole(x), K2))(X))
    assert rep.num_folded == 1 and set(C.JIT_NAMES) & set(_prims(new)), new
    plain = jax.jit(lambda x: jnp.tanh(conv(x)))
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(lambda x: conv(plain(x), K2))(X))
    assert rep.num_folded == 0 and set(C.JIT_NAMES) & set(_prims(new)), new


def test_a_helper_with_shardings_is_left_on_the_jaxpr_path_with_the_reason():
    """Inlining would drop the helper's ``out_shardings``: the jaxpr path leaves the site,
    naming the program; lowered, the sharding is a constraint inside the function, which the
    StableHLO path keeps and folds through (the same values)."""
    mesh = jax.make_mesh((1,), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sconv = jax.jit(conv, out_shardings=sh)

    def f(x):
        return jnp.tanh(sconv(x) * S + T)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(X))
    assert rep.num_folded == 0, str(rep)
    assert any("jit(conv)" in str(s.reason) for s in rep.sites), str(rep)
    assert_close(f(X), jax.jit(C.jaxpr_as_fun(new))(X)[0])
    text, srep = hlofold.fold_stablehlo(jax.jit(f).lower(X).as_text())
    assert srep.num_folded == 1 and "sdy.sharding_constraint" in text, str(srep)
