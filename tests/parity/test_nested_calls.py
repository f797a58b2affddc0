"""Calls a fold crosses from inside (issue 68, item 10): a convolution in a jit nested in a
jit, its BatchNorm in the caller; a norm's scale in a helper whose result two projections
read outside. ``fold(f)`` (frozen or not), ``fold_params`` and ``fold_stablehlo`` fold them
alike — the call-boundary rule (``_fold.core.boundary``) looks into nested calls and takes a
value read by several layers as read by a layer, on both IRs. A ``conv·2`` in the helper
before a BatchNorm outside folds in the program; ``fold_params`` says why it cannot write it
back (the literal 2 has no leaf to carry it)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold

TOL = 2e-5
C = 4


def _conv(h, k):
    return lax.conv_general_dilated(h, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


_inner = jax.jit(_conv)
_outer = jax.jit(lambda h, k: _inner(h, k))
_twice = jax.jit(lambda h, k: _conv(h, k) * 2.0)


def _bn(y, p):
    return (y - p["m"]) * p["g"] * lax.rsqrt(p["v"] + 1e-5) + p["b"]


@jax.jit
def _norm(x, g):
    return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def nested_jit(p, x):
    return _bn(_outer(x, p["k"]), p)


def doubled(p, x):
    return _bn(_twice(x, p["k"]), p)


def norm_in_helper(p, x):
    h = _norm(x, p["g"])
    return h @ p["wq"], h @ p["wk"]


def _params(seed=0):
    r = np.random.default_rng(seed)
    p = {"k": r.standard_normal((3, 3, C, C)), "g": r.uniform(0.5, 1.5, C),
         "b": r.standard_normal(C), "m": r.standard_normal(C), "v": r.uniform(0.5, 1.5, C),
         "wq": r.standard_normal((C, 8)), "wk": r.standard_normal((C, 8))}
    p = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
    return p, jnp.asarray(r.standard_normal((2, 6, 6, C)), jnp.float32)


def _err(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _stablehlo(f, p, x):
    exp = jax.export.export(jax.jit(f))(p, x)
    bound = {f"arg{i}": v for i, v in enumerate(jax.tree.leaves(p))}
    new, rep, prep = hlofold.fold_stablehlo(exp, params=bound)
    return rep, new.call(x, *prep)


@pytest.mark.parametrize("f,n", [(nested_jit, 1), (norm_in_helper, 2), (doubled, 1)])
def test_every_entry_point_folds_across_the_call(f, n):
    p, x = _params()
    ref = jax.jit(f)(p, x)
    for ff in (hlofold.fold(f, freeze=0, fold_costly=True), hlofold.fold(f, fold_costly=True)):
        assert ff.report(p, x).num_folded == n, str(ff.report(p, x))
        assert _err(ff(p, x), ref) < TOL
    rep, got = _stablehlo(f, p, x)
    assert rep.num_folded == n, str(rep)
    assert _err(got, ref) < TOL


@pytest.mark.parametrize("f,n", [(nested_jit, 1), (norm_in_helper, 2)])
def test_fold_params_writes_them(f, n):
    p, x = _params()
    out = hlofold.fold_params(f, p, x)
    assert len(out.changes) == n, str(out)
    assert _err(f(out.params, x), f(p, x)) < TOL


def test_fold_params_says_why_the_doubled_conv_is_not_written_back():
    p, x = _params()
    out = hlofold.fold_params(doubled, p, x)
    assert not out.changes
    (site,) = out.report.sites
    assert "not written back" in site.reason and "mul" in site.reason, str(out)
    assert _err(doubled(out.params, x), doubled(p, x)) == 0.0


@pytest.mark.parametrize("f", [nested_jit, lambda p, x: jnp.tanh(_outer(x, p["k"]) + 1.0)],
                         ids=["batchnorm", "bias-literal"])
def test_a_nested_helper_is_one_site_and_leaves_no_function_behind(f):
    """Found by the generated programs drawing a conv in a jit in a jit: once the outer call
    was inlined, the inner function was still called — from the outer one, which nothing
    called any more — so it stayed in the module and its conv was a second site ("value is
    an output of the function @<lambda>_0") where the jaxpr path has one."""
    p, x = _params()
    text = jax.jit(f, keep_unused=True).lower(p, x).as_text()
    jrep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(p, x))[1]
    folded, srep = hlofold.fold_stablehlo(text, in_graph=True)
    assert len(srep.sites) == len(jrep.sites) == 1, f"{srep}\n{jrep}"
    assert srep.sites[0].status == jrep.sites[0].status, f"{srep}\n{jrep}"
    if srep.num_folded:          # (inlined where it folds; a module it leaves is returned)
        assert "func.func private" not in str(folded), str(folded)
    got = hlofold.callable(folded)(*jax.tree.leaves(p), x)
    assert _err(got, jax.jit(f)(p, x)) < TOL


@jax.jit
def _block(x, k, g, b, m, v):
    y = _conv(x, k)
    return jax.nn.relu((y - m) * lax.rsqrt(v + 1e-3) * g + b)


def _block_twice(p, x):        # one kernel, two BatchNorms: a block helper called per layer
    y = _block(x, p["k"], p["g1"], p["b1"], p["m1"], p["v1"])
    return _block(y, p["k"], p["g2"], p["b2"], p["m2"], p["v2"])


@pytest.mark.parametrize("twice", [True, False], ids=["called-twice", "called-once"])
def test_split_prepares_the_weights_of_a_layer_in_a_helper(twice):
    """Issue 68, item 11: ``split=`` of a jit helper's layer (called per layer with a shared
    kernel, or once). Its folded kernel and bias were made inside the helper, from the
    helper's arguments — on every call of apply, which still took every BatchNorm leaf, and
    the report counted one site for two layers. Now each call's weights are prepared once:
    both sites folded (as ``fold(f)``), apply holds no weight product and takes the input and
    what prepare made, its outputs those of the module given."""
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    p = {"k": w(3, 3, C, C), **{f"{n}{i}": w(C) for n in "gbm" for i in (1, 2)},
         "v1": jnp.abs(w(C)) + .5, "v2": jnp.abs(w(C)) + .5}
    f = _block_twice if twice else (lambda p, x: _block(x, p["k"], p["g1"], p["b1"], p["m1"],
                                                         p["v1"]))
    if not twice:
        p = {k: v for k, v in p.items() if not k.endswith("2")}
    x = w(2, 6, 6, C)
    text = jax.jit(f).lower(p, x).as_text()
    leaves = jax.tree.leaves(p)
    apply, rep, prepare = hlofold.fold_stablehlo(text, split=[f"arg{len(leaves)}"])
    layers = 2 if twice else 1
    assert rep.num_folded == layers == hlofold.fold(f).report(p, x).num_folded, str(rep)
    *prepared, ok = hlofold.callable(prepare)(*leaves)
    assert bool(ok) and len(prepared) == 2 * layers            # a kernel and a bias each
    assert "stablehlo.multiply" not in apply and "rsqrt" not in apply
    got = hlofold.callable(apply)(x, *prepared)
    got = got[0] if isinstance(got, (list, tuple)) else got
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(f)(p, x)), rtol=TOL,
                               atol=TOL)
