"""A norm's scale applied by ``jnp.einsum("...k,k->...k", y, scale)`` (MaxText's RMSNorm and
LayerNorm) and activations named with ``checkpoint_name`` between a norm and its projections:
both fold on both paths, as ``y * scale`` does (issue 69, item 1).

The einsum is a ``dot_general`` that contracts nothing, then a transpose back; hlofold had
read it as a dense layer ("transpose moves the output-feature axes", untrue) and folded none
of the norms. ``_fold.{jaxpr,stablehlo}.canonical`` spell it as a product; these tests hold
the folds, the values (the rewrite alone is bit for bit), and the refusals of products that
are no per-channel scale.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import hlofold
from hlofold import _compat as C
from hlofold._fold.jaxpr.canonical import products

TOL = 2e-5


def _rms(x, g, spelling):
    y = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    if spelling == "einsum":
        return jnp.einsum("...k,k->...k", y, g)
    if spelling == "einsum-left":
        return jnp.einsum("k,...k->...k", g, y)
    return y * g


def _model(spelling="einsum", named=False):
    def f(p, x):
        h = _rms(x, p["g"], spelling)
        if named:
            h = checkpoint_name(h, "norm_out")
        return h @ p["wq"], h @ p["wk"]
    return f


def _params(seed=0, d=16):
    k = jax.random.split(jax.random.key(seed), 4)
    p = {"g": 1 + 0.3 * jax.random.normal(k[0], (d,)),
         "wq": jax.random.normal(k[1], (d, 8)), "wk": jax.random.normal(k[2], (d, 8))}
    return p, jax.random.normal(k[3], (2, 5, d))


def _err(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("spelling", ["einsum", "einsum-left", "mul"])
@pytest.mark.parametrize("named", [False, True])
def test_fold_params_folds_the_scale_into_both_projections(spelling, named):
    f = _model(spelling, named)
    p, x = _params()
    out = hlofold.fold_params(f, p, x)
    folded = [s for s in out.report.folded]
    assert len(folded) == 2, str(out.report)
    assert all("g" in "".join(s.params) for s in folded)
    np.testing.assert_array_equal(np.asarray(out.params["g"]), np.ones(16, np.float32))
    assert _err(f(out.params, x), f(p, x)) < TOL


@pytest.mark.parametrize("named", [False, True])
def test_the_decorator_folds_the_einsum_scale(named):
    f = _model("einsum", named)
    p, x = _params()
    ff = hlofold.fold(f, freeze=0, fold_costly=True)
    rep = ff.report(p, x)
    assert rep.num_folded == 2, str(rep)
    assert _err(ff(p, x), jax.jit(f)(p, x)) < TOL


def test_the_checkpoint_name_stays_on_the_projections_input():
    f = _model("einsum", named=True)
    p, x = _params()
    ff = hlofold.fold(f, freeze=0, fold_costly=True)
    new = jax.make_jaxpr(ff)(p, x)

    def names(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "name":
                yield e.params["name"]
            for sub in C.param_jaxprs(e):
                yield from names(getattr(sub, "jaxpr", sub))
    assert "norm_out" in set(names(new.jaxpr))      # (a remat policy still finds it)


def _no_contraction_dots(jaxpr):
    return [e for e in jaxpr.eqns if e.primitive.name == "dot_general" and
            not e.params["dimension_numbers"][0][0] and not e.params["dimension_numbers"][0][1]]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_rewrite_alone_is_bit_for_bit(dtype):
    g = (1 + 0.3 * jax.random.normal(jax.random.key(1), (6,))).astype(dtype)
    y = jax.random.normal(jax.random.key(2), (3, 6, 4)).astype(dtype)

    def f(y, g):
        a = jnp.einsum("ikj,k->ijk", y, g)               # (another layout out)
        b = jnp.einsum("ikj,k->ikj", y, g, preferred_element_type=jnp.float32)
        return a, b
    closed = jax.make_jaxpr(f)(y, g)
    new = products(closed)
    assert _no_contraction_dots(closed.jaxpr) and not _no_contraction_dots(new.jaxpr)
    C.check_jaxpr(new.jaxpr)
    for a, b in zip(C.jaxpr_as_fun(closed)(y, g), C.jaxpr_as_fun(new)(y, g)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_product_of_two_activations_folds_nothing():
    """``einsum("...k,...k->...k", a, b)`` of two activations contracts nothing but is no
    per-channel scale: spelled as the product it is (the same values), nothing folded, and
    the reason says the chain met another activation."""
    def f(p, x):
        h = x @ p["w"]
        return jnp.einsum("...k,...k->...k", h, jnp.tanh(x @ p["v"]))
    k = jax.random.split(jax.random.key(3), 3)
    p = {"w": jax.random.normal(k[0], (8, 8)), "v": jax.random.normal(k[1], (8, 8))}
    x = jax.random.normal(k[2], (4, 8))
    closed = jax.make_jaxpr(f)(p, x)
    new = products(closed)
    assert [e.primitive.name for e in new.jaxpr.eqns][-1] == "mul"
    flat = jax.tree_util.tree_leaves((p, x))
    np.testing.assert_array_equal(C.jaxpr_as_fun(new)(*flat)[0],
                                  C.jaxpr_as_fun(closed)(*flat)[0])
    out = hlofold.fold_params(f, p, x)
    assert out.report.num_folded == 0 and not out.changes
    assert any("activation" in str(s.reason) for s in out.report.sites), str(out.report)
    assert _err([f(out.params, x)], [f(p, x)]) == 0.0


def _export(f, p, x):
    exp = jax.export.export(jax.jit(f))(p, x)
    leaves = jax.tree_util.tree_leaves(p)
    return exp, {f"arg{i}": v for i, v in enumerate(leaves)}


@pytest.mark.parametrize("spelling", ["einsum", "einsum-left"])
@pytest.mark.parametrize("named", [False, True])
def test_fold_stablehlo_folds_the_einsum_scale(spelling, named):
    f = _model(spelling, named)
    p, x = _params()
    exp, bound = _export(f, p, x)
    assert "stablehlo.dot_general" in exp.mlir_module()
    new, rep, prep = hlofold.fold_stablehlo(exp, params=bound)
    assert rep.num_folded == 2, str(rep)
    text = new.mlir_module()
    assert text.count("stablehlo.dot_general") == 2         # the two projections only
    got = new.call(x, *prep)
    assert _err(got, f(p, x)) < TOL


def test_both_paths_refuse_a_scale_read_besides_the_projections():
    """The einsum-scaled value also returned: neither path folds it (the same rule as
    ``y * g``), and both say so."""
    def f(p, x):
        h = _rms(x, p["g"], "einsum")
        return h @ p["wq"], h
    p, x = _params()
    out = hlofold.fold_params(f, p, x)
    assert out.report.num_folded == 0 and not out.changes
    exp, bound = _export(f, p, x)
    _, rep, _ = hlofold.fold_stablehlo(exp, params=bound)
    assert rep.num_folded == 0
    for r in (out.report, rep):         # (the same words on both paths)
        assert any(str(s.reason).startswith("the root's input has 2 consumers, one of them "
                                            "an output") for s in r.sites), str(r)
