"""``@jax.jit`` helpers a fold crosses: a convolution in a jitted helper whose BatchNorm the
caller applies, a norm's scale applied before a helper that holds the projection.

Neither scope sees both ends, so the call is inlined first (the rule of
``hlofold._fold.core.boundary``: ``_fold.jaxpr.nested.crossed_calls`` on the jaxpr path,
``_fold.stablehlo.calls.inline_crossed_calls`` for the private ``func.call`` JAX lowers the
helper to) — what XLA does with the call anyway; a jit's shardings become sharding
constraints, as JAX lowers them. Before, both paths left these sites ("value is an output of
the top/jit(conv) program"). A jit with layouts, donations or shardings on explicit mesh axes
stays a call on the jaxpr path, the site left with that reason.
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


def test_a_helper_with_shardings_folds_with_its_constraints_kept():
    """Inlined, a jit's ``in_shardings``/``out_shardings`` are sharding constraints on its
    operands and results (as JAX lowers them: inside the function on StableHLO); the fold
    passes through them on both paths and keeps them."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sconv = jax.jit(conv, in_shardings=sh, out_shardings=sh)

    def f(x):
        return jnp.tanh(sconv(x) * S + T)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(X))
    assert rep.num_folded == 1, str(rep)
    assert _prims(new).count("sharding_constraint") == 2, new
    assert not set(C.JIT_NAMES) & set(_prims(new)), new
    assert_close(f(X), jax.jit(C.jaxpr_as_fun(new))(X)[0])
    text, srep = hlofold.fold_stablehlo(jax.jit(f).lower(X).as_text())
    assert srep.num_folded == 1 and "sdy.sharding_constraint" in text, str(srep)


def test_a_helper_whose_layer_output_is_also_returned_is_left_on_both_paths():
    """The conv's output has a second reader (a program output): no fold, on either path,
    and the helper is not inlined for nothing."""
    def f(x):
        y = jconv(x)
        return jnp.tanh(y * S + T), y
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(X))
    assert rep.num_folded == 0 and rep.sites and all(s.reason for s in rep.sites), str(rep)
    assert set(C.JIT_NAMES) & set(_prims(new)), new
    _, srep = hlofold.fold_stablehlo(jax.jit(f).lower(X).as_text())
    assert srep.num_folded == 0 and srep.sites and all(s.reason for s in srep.sites), str(srep)


def test_a_helper_on_explicit_axes_is_left_on_the_jaxpr_path_with_the_reason():
    """A jit whose shardings are on a mesh of explicit axes (part of the values' types:
    ``jax.make_mesh``'s default on newer JAX) stays a call on the jaxpr path — inlining it
    as constraints is not what the types say — and the site is left, the reason naming the
    program."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    econv = jax.jit(conv, out_shardings=sh)

    def f(x):
        return jnp.tanh(econv(x) * S + T)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(X))
    assert rep.num_folded == 0, str(rep)
    assert any("jit(conv)" in str(s.reason) for s in rep.sites), str(rep)
    assert set(C.JIT_NAMES) & set(_prims(new)), new
    assert_close(f(X), jax.jit(C.jaxpr_as_fun(new))(X)[0])


@pytest.mark.parametrize("sharded", [False, True])
def test_layers_in_jitted_helpers_are_written_back_and_equalized_on_both_paths(sharded):
    """``fold_params(equalize=True)`` reads the helpers inlined (a sharded one through its
    constraints): the BN written back, the pair conv → relu → conv equalized; StableHLO
    (``fold_stablehlo(params=, equalize=True)``) pairs the same layers."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    kw = {"in_shardings": sh, "out_shardings": sh} if sharded else {}
    helper = jax.jit(lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), **kw)

    def f(p, x):
        return helper(jax.nn.relu(helper(x, p["k"]) * p["s"] + p["t"]), p["k2"])
    p = {"k": jnp.asarray(RNG.standard_normal((3, 3, 4, 8)) / 6, jnp.float32),
         "s": jnp.asarray(10 ** RNG.uniform(-1, 1, 8), jnp.float32),
         "t": jnp.asarray(RNG.standard_normal(8), jnp.float32),
         "k2": jnp.asarray(RNG.standard_normal((1, 1, 8, 8)) / 3, jnp.float32)}
    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
    written = hlofold.fold_params(f, p, x, equalize=True)
    assert len(written.changes) == 1 and len(written.equalized) == 1, str(written)
    assert_close(f(p, x), f(written.params, x))
    leaves, tree = jax.tree.flatten(p)
    g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    exp = jax.export.export(g)(*leaves, x)
    got, rep, prep = hlofold.fold_stablehlo(
        exp, params={i: np.asarray(a) for i, a in enumerate(leaves)}, equalize=True)
    assert rep.num_folded == 1 and len(rep.equalized) == 1, str(rep)
    np.testing.assert_allclose(rep.equalized[0].spread_after,
                               written.equalized[0].spread_after, rtol=1e-3)
    assert_close(f(p, x), got.call(x, *prep))
