"""Checkpoints (``jax.checkpoint``, ``nn.remat``) a fold's chain crosses.

Lowered, a forward-only checkpoint is its body (the StableHLO path never sees it), so the
jaxpr path folds across its boundary as StableHLO does: a checkpoint a chain crosses — a layer
on one side, its per-channel arithmetic on the other, in either direction — is inlined
(``_fold.jaxpr.nested.crossed_calls``); one that holds a whole site is folded inside and kept.
Found by the differential test (an affine op in front of a checkpointed convolution:
StableHLO folded it, the jaxpr path did not).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
import hlofold._compat as C
from tests.helpers import assert_close

RNG = np.random.default_rng(0)
K = jnp.asarray(RNG.standard_normal((4, 3, 1, 1)), jnp.float32)      # OIHW, 1x1
K2 = jnp.asarray(RNG.standard_normal((4, 4, 1, 1)), jnp.float32)
S = jnp.asarray(RNG.uniform(0.5, 2.0, (1, 4, 1, 1)), jnp.float32)
T = jnp.asarray(RNG.standard_normal((1, 4, 1, 1)), jnp.float32)
S3 = jnp.asarray(RNG.uniform(0.5, 2.0, (1, 3, 1, 1)), jnp.float32)
T3 = jnp.asarray(RNG.standard_normal((1, 3, 1, 1)), jnp.float32)
X = jnp.asarray(RNG.standard_normal((2, 3, 6, 6)), jnp.float32)
ck = jax.checkpoint


def conv(x, k=K):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID")


CASES = {   # name: (program, the site folded)
    "layer here, affine inside": (lambda x: jnp.tanh(ck(lambda y: y * S + T)(conv(x))),
                                  "conv_affine"),
    "layer inside, affine here": (lambda x: jnp.tanh(ck(conv)(x) * S + T), "conv_affine"),
    "affine here, layer inside": (lambda x: jnp.tanh(ck(conv)(x * S3 + T3)), "affine_conv"),
    "affine inside, layer here": (lambda x: jnp.tanh(conv(ck(lambda y: y * S3)(x))),
                                  "affine_conv"),
}


def _prims(closed) -> list[str]:
    return [e.primitive.name for e in closed.jaxpr.eqns]


@pytest.mark.parametrize("name", list(CASES))
def test_a_chain_crossing_a_checkpoint_folds_on_both_paths(name):
    f, pattern = CASES[name]
    closed = jax.make_jaxpr(f)(X)
    new, rep = hlofold.fold_jaxpr(closed)
    assert [s.pattern for s in rep.folded] == [pattern], str(rep)
    assert not {"checkpoint", "remat2"} & set(_prims(new)), new     # inlined, as lowered
    _, srep = hlofold.fold_stablehlo(jax.jit(f).lower(X).as_text())
    assert srep.num_folded == rep.num_folded == 1, str(srep)
    assert_close(f(X), jax.jit(C.jaxpr_as_fun(new))(X)[0])


def test_a_checkpoint_holding_its_sites_is_kept():
    """conv → BN → conv → BN inside one checkpoint: folded there, the checkpoint kept (a
    gradient of the folded program still rematerializes it)."""
    def f(x):
        return ck(lambda x: jnp.tanh(conv(jnp.tanh(conv(x) * S + T), K2) * S + T))(x)
    closed = jax.make_jaxpr(f)(X)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 2, str(rep)
    assert _prims(new).count("remat2") + _prims(new).count("checkpoint") == 1, new
    assert_close(f(X), jax.jit(C.jaxpr_as_fun(new))(X)[0])


def test_a_checkpoint_no_chain_crosses_is_kept():
    """A checkpoint between two layers with nothing per-channel at its boundary: kept (one
    ending in a scale the next layer takes is crossed: that scale folds forward)."""
    def f(x, scale=None):
        body = (lambda y: jnp.tanh(conv(y))) if scale is None else \
            (lambda y: jnp.tanh(conv(y)) * scale)
        return conv(ck(body)(x), K2)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(X))
    assert rep.num_folded == 0 and {"checkpoint", "remat2"} & set(_prims(new)), new
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(lambda x: f(x, 2.0))(X))
    assert rep.num_folded == 1 and not {"checkpoint", "remat2"} & set(_prims(new)), new
    assert_close(f(X, 2.0), jax.jit(C.jaxpr_as_fun(new))(X)[0])


def test_the_decorator_folds_across_and_its_gradient_is_the_originals():
    f = lambda k, x: jnp.sum(jnp.tanh(ck(lambda y: conv(y, k))(x) * S + T))   # noqa: E731
    folded = hlofold.fold(f)
    assert folded.report(K, X).num_folded == 1, str(folded.report(K, X))
    assert_close(f(K, X), folded(K, X))
    assert_close(jax.grad(f)(K, X), jax.grad(folded)(K, X))


def test_flax_remat_conv_then_batchnorm_outside():
    """Flax ``nn.remat(nn.Conv)`` followed by a ``BatchNorm`` outside the checkpoint: the
    decorator folds it (the checkpoint crossed), ``fold_params`` writes it back."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.remat(nn.Conv)(8, (3, 3), use_bias=False)(x)
            return nn.relu(nn.BatchNorm(use_running_average=True)(x))

    m, x = Net(), jnp.asarray(RNG.standard_normal((2, 8, 8, 3)), jnp.float32)
    v = jax.tree.map(lambda a: a + jnp.asarray(RNG.uniform(0.1, 1.0, a.shape), a.dtype),
                     m.init(jax.random.key(0), x))
    folded = hlofold.fold(m.apply)
    assert folded.report(v, x).num_folded == 1, str(folded.report(v, x))
    assert_close(m.apply(v, x), folded(v, x))
    out = hlofold.fold_params(m.apply, v, x)
    assert [c.kernel for c in out.changes] == ["['params']['CheckpointConv_0']['kernel']"]
    assert_close(m.apply(v, x), m.apply(out.params, x))
