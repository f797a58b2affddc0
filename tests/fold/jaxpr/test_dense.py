"""dot_general → per-feature affine (Dense/Gemm + BatchNorm), with the real layers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import hlofold
from tests.helpers import assert_close, fold_checked, primitives

RNG = np.random.default_rng(3)


def randomize_bn(tree, keys=("mean", "var", "scale", "bias")):
    """Replace BN statistics in a pytree by non-trivial values (mean≠0, var≠1, γ≠1, β≠0)."""
    def f(path, a):
        name = jax.tree_util.keystr(path)
        if "var" in name:
            return jnp.asarray(np.exp(0.5 * RNG.standard_normal(a.shape)), a.dtype)
        if any(k in name for k in ("mean", "scale", "bias", "gamma", "beta", "offset")):
            return jnp.asarray(a + 0.5 * RNG.standard_normal(a.shape), a.dtype)
        return a
    return jax.tree_util.tree_map_with_path(f, tree)


def check(f, *args, folds, freeze=None):
    for fz in ((), freeze) if freeze is not None else ((),):
        rep = fold_checked(f, *args, folds=folds, freeze=fz, root="dot_general")[1]
    return rep


def test_flax_dense_bn():
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Dense(16)(x)))
            return nn.BatchNorm(use_running_average=True)(nn.Dense(8, use_bias=False)(x))

    m = M()
    x = jnp.asarray(RNG.standard_normal((4, 12)), jnp.float32)
    v = randomize_bn(m.init(jax.random.key(0), x))
    rep = check(m.apply, v, x, folds=2, freeze=0)
    assert all(s.primitive == "dot_general" for s in rep.folded)
    assert any("['BatchNorm_0']['mean']" in p for p in rep.folded[0].params)


def test_haiku_linear_bn():
    import haiku as hk

    def net(x, is_training):
        x = hk.Linear(16)(x)
        return hk.BatchNorm(True, True, 0.9)(x, is_training=is_training)

    t = hk.transform_with_state(net)
    x = jnp.asarray(RNG.standard_normal((4, 12)), jnp.float32)
    p, s = t.init(jax.random.key(0), x, True)
    p, s = randomize_bn(p), jax.tree.map(
        lambda a: a if a.dtype == jnp.int32 else jnp.asarray(
            np.abs(a + RNG.standard_normal(a.shape)) + 0.1, a.dtype), s)
    f = lambda p, s, x: t.apply(p, s, None, x, False)[0]
    check(f, p, s, x, folds=1, freeze=(0, 1))


def test_keras_dense_bn():
    import keras
    inp = keras.Input((12,))
    y = keras.layers.Dense(16)(inp)
    y = keras.layers.BatchNormalization()(y)
    model = keras.Model(inp, y)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            c = layer.gamma.shape[0]
            layer.moving_mean.assign(RNG.standard_normal(c))
            layer.moving_variance.assign(np.exp(0.5 * RNG.standard_normal(c)))
            layer.gamma.assign(1 + 0.3 * RNG.standard_normal(c))
            layer.beta.assign(RNG.standard_normal(c))
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    x = jnp.asarray(RNG.standard_normal((4, 12)), jnp.float32)
    f = lambda tv, ntv, x: model.stateless_call(tv, ntv, x, training=False)[0]
    check(f, tv, ntv, x, folds=1, freeze=(0, 1))


def test_einsum_with_batch_dims():
    w = jnp.asarray(RNG.standard_normal((3, 5, 7)), jnp.float32)       # (b, k, f)
    x = jnp.asarray(RNG.standard_normal((3, 4, 5)), jnp.float32)       # (b, n, k)
    m, v = RNG.standard_normal(7).astype(np.float32), np.exp(RNG.standard_normal(7)).astype(
        np.float32)

    def f(x, w, m, v):
        y = jnp.einsum("bnk,bkf->bnf", x, w)
        return (y - m) * lax.rsqrt(v + 1e-3)

    check(f, x, w, m, v, folds=1, freeze=(1, 2, 3))


def test_channel_from_lhs_refused():
    x = jnp.asarray(RNG.standard_normal((6, 5)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((5, 6)), jnp.float32)
    m = RNG.standard_normal(6).astype(np.float32)

    def f(x, w, m):                      # per-row (lhs) scaling, same size as the features
        return (x @ w) * m[:, None]

    closed = jax.make_jaxpr(f)(x, w, m)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 0 and new is closed
    assert "axis 0" in rep.sites[0].reason and "lhs" in rep.sites[0].reason


def test_channel_from_batch_dim_refused():
    w = jnp.asarray(RNG.standard_normal((3, 5, 3)), jnp.float32)       # (b, k, f), f == b
    x = jnp.asarray(RNG.standard_normal((3, 4, 5)), jnp.float32)       # (b, n, k)
    g = RNG.standard_normal(3).astype(np.float32)
    f = lambda x, w, g: jnp.einsum("bnk,bkf->bnf", x, w) * g[:, None, None]   # per batch
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x, w, g))
    assert rep.num_folded == 0
    assert "batch dimension" in rep.sites[0].reason


def test_activation_rhs_refused():
    q = jnp.asarray(RNG.standard_normal((4, 8)), jnp.float32)
    wk = jnp.asarray(RNG.standard_normal((8, 8)), jnp.float32)

    def attn(q, wk):
        k = q @ wk                                     # an activation
        return jax.nn.softmax((q @ k.T) * 0.35)        # scale after q·kᵀ: not a parameter fold

    closed = jax.make_jaxpr(attn)(q, wk)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 0
    assert any("activation" in (s.reason or "") for s in rep.sites)


def test_resnet_with_dense_bn_head():
    from hlofold import examples
    p = examples.init_resnet(10, width=8, num_classes=6)
    head_bn = {k: jnp.asarray(v) for k, v in examples._bn_params(np.random.default_rng(1),
                                                                  6).items()}

    def f(p, head_bn, x):
        y = examples.resnet_apply(p, x)            # ... mean-pool, Dense
        return (y - head_bn["mean"]) * (lax.rsqrt(head_bn["var"] + 1e-5) * head_bn["scale"]) \
            + head_bn["bias"]

    x = jnp.asarray(RNG.standard_normal((2, 32, 32, 3)), jnp.float32)
    ff = hlofold.fold(f)
    rep = ff.report(p, head_bn, x)
    # every conv BN, the head BN, and the mean-pool's 1/(H·W) folded forward into the head
    assert rep.num_folded == examples.count_bn(p) + 2
    assert [s.pattern for s in rep.folded].count("dot_affine") == 1
    assert [s.pattern for s in rep.folded].count("affine_dot") == 1
    assert_close(f(p, head_bn, x), ff(p, head_bn, x))
    fz = hlofold.fold(f, freeze=(0, 1))
    assert_close(f(p, head_bn, x), fz(p, head_bn, x))
    assert "rsqrt" not in primitives(fz.jaxpr(p, head_bn, x))
