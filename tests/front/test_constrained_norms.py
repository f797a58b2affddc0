"""A norm whose output is sharding-constrained before the projections read it (MaxText
constrains every activation: ``with_sharding_constraint(norm(x), ...)``): the constraint says
where the values live, not what they are, so the norm's γ (and β) folds through it into the
projections as without it — the root reads ``x·r`` constrained as the program constrained
the norm's output (the constraint replayed, not dropped) — on the jaxpr path and on
StableHLO (``sdy.sharding_constraint``). One-device mesh here; the sharded runs are
``tests/fold/stablehlo/test_shardy.py``'s."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hlofold
from tests.quant.jaxpr.test_equalize import rel

EXACT = 1e-5


def block(norm: str, constrain: bool):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    c = (lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P("data")))) \
        if constrain else (lambda a: a)
    rng = np.random.default_rng(5)
    d = 16
    p = {"g": jnp.asarray(10 ** rng.uniform(-0.5, 0.5, d), jnp.float32),
         "beta": jnp.asarray(rng.standard_normal(d) * 0.1, jnp.float32),
         "q": jnp.asarray(rng.standard_normal((d, d)) / 4, jnp.float32),
         "v": jnp.asarray(rng.standard_normal((d, 8)) / 4, jnp.float32)}

    def f(p, x):
        if norm == "rms":
            h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]
        else:
            mu = jnp.mean(x, -1, keepdims=True)
            h = (x - mu) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-6) * p["g"] + \
                p["beta"]
        h = c(h)
        return jnp.concatenate([h @ p["q"], h @ p["v"]], -1)
    x = jnp.asarray(rng.standard_normal((4, 5, d)), jnp.float32)
    return f, p, x


def _count(text: str, what: str) -> int:
    return text.count(what)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_the_norm_folds_through_a_sharding_constraint_on_the_jaxpr_path(norm):
    counts = []
    for constrain in (True, False):
        f, p, x = block(norm, constrain)
        ff = hlofold.fold(jax.jit(f), fold_costly=True)
        rep = ff.report(p, x)
        assert rel(f(p, x), ff(p, x)) <= EXACT
        if constrain:       # (the root reads the norm's output constrained, as written)
            jp = str(jax.make_jaxpr(ff)(p, x))
            assert _count(jp, "sharding_constraint[") == 1, jp
        out = hlofold.fold_params(f, p, x)     # (LayerNorm's β: no bias leaf to carry it,
        assert rel(f(p, x), f(out.params, x)) <= EXACT, str(out)    # kept in front as β/γ)
        counts.append((rep.num_folded, len(out.changes)))
        assert {c.front for c in out.changes} == ({None} if norm == "rms" else {"['beta']"})
    assert counts == [(2, 2)] * 2, counts


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_the_norm_folds_through_a_sharding_constraint_on_stablehlo(norm):
    counts = []
    for constrain in (True, False):
        f, p, x = block(norm, constrain)
        leaves, tree = jax.tree.flatten(p)
        g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
        exp = jax.export.export(g)(*leaves, x)
        new, rep, prep = hlofold.fold_stablehlo(
            exp, params={i: np.asarray(a) for i, a in enumerate(leaves)})
        counts.append(rep.num_folded)
        assert rel(g(*leaves, x), new.call(x, *prep)) <= EXACT, str(rep)
        text = new.mlir_module()
        assert _count(text, "sdy.sharding_constraint %") == int(constrain), text
    assert counts == [2, 2], counts
