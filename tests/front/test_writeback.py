"""``hlofold.fold_params``: folded weights written back into the model's own parameter tree
(issue 12, item 2). The unchanged model code run with the new tree gives the original
outputs; the absorbed normalizations are identities; the report names the pytree paths."""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from tests.helpers import assert_close
from tests.helpers.blocks import X, decoder, flax_linen_block

RNG = np.random.default_rng(3)
IMG = jnp.asarray(RNG.standard_normal((2, 8, 8, 3)), jnp.float32)


def trained(tree):
    """BN statistics and affine parameters away from their init values (σ² > 0)."""
    return jax.tree.map(lambda a: a + jnp.asarray(np.abs(RNG.standard_normal(a.shape)) * 0.5,
                                                  a.dtype) if hasattr(a, "dtype") and
                        jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def check(fn, params, *args, sites):
    out = hlofold.fold_params(fn, params, *args)
    assert len(out.changes) == sites, str(out)
    assert jax.tree.structure(out.params) == jax.tree.structure(params)
    assert_close(fn(params, *args), fn(out.params, *args))
    for c in out.changes:                 # every change names leaves of the tree
        assert c.kernel.startswith("[") and all(p.startswith("[") for p in c.identity)
    return out


def leaf(tree, path):
    return next(v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
                if jax.tree_util.keystr(p) == path)


# ---------------------------------------------------------------- BatchNorm, each library

def flax_cnn():
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.BatchNorm(use_running_average=True)(
                nn.Conv(8, (3, 3), use_bias=False)(x)))
            x = nn.BatchNorm(use_running_average=True)(nn.Conv(8, (3, 3))(x))
            return nn.Dense(4)(x.mean((1, 2)))

    m = CNN()
    return m.apply, trained(m.init(jax.random.key(0), IMG))


def test_flax_linen_batchnorm():
    f, v = flax_cnn()
    out = check(f, v, IMG, sites=2)
    first, second = out.changes
    assert first.bias == "['params']['BatchNorm_0']['bias']"      # no conv bias: β carries t
    assert second.bias == "['params']['Conv_1']['bias']"          # the conv's own bias does
    bs = out.params["batch_stats"]["BatchNorm_0"]
    assert np.all(np.asarray(bs["mean"]) == 0)
    assert np.all(np.asarray(out.params["params"]["BatchNorm_0"]["scale"]) == 1)
    # σ² + ε is 1 in float32: the BN computes x·1 + β exactly
    np.testing.assert_array_equal(np.float32(bs["var"]) + np.float32(1e-5), np.float32(1))
    # what each absorbed leaf was, by role, and ε (for a quantizer's own passes)
    assert first.roles == {"['params']['BatchNorm_0']['scale']": "scale",
                           "['params']['BatchNorm_0']['bias']": "shift",
                           "['batch_stats']['BatchNorm_0']['mean']": "mean",
                           "['batch_stats']['BatchNorm_0']['var']": "variance"}, first.roles
    assert first.epsilon == float(np.float32(1e-5))
    assert second.roles["['params']['Conv_1']['bias']"] == "shift"  # (the conv's bias too)


@pytest.mark.parametrize("scanned", [False, True])
def test_flax_remat_blocks_are_written_back(scanned):
    """Conv + BN blocks under ``nn.remat`` (a ``checkpoint``: MaxText and big CNNs wrap every
    layer), at the top level and in an ``nn.scan`` stack: their BNs written back as the same
    blocks without remat (before: "not written back: the site is inside top/remat2")."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.BatchNorm(use_running_average=True)(nn.Conv(8, (3, 3), use_bias=False)(x))
            return x + nn.relu(h), None

    class Net(nn.Module):
        remat: bool

        @nn.compact
        def __call__(self, x):
            x = nn.Conv(8, (1, 1))(x)
            block = nn.remat(Block) if self.remat else Block
            if scanned:
                x, _ = nn.scan(block, variable_axes={"params": 0, "batch_stats": 0},
                               split_rngs={"params": True}, length=3)(name="stack")(x, None)
            else:
                for i in range(3):
                    x, _ = block(name=f"B{i}")(x, None)
            return nn.Dense(4)(x.mean((1, 2)))

    v = trained(Net(False).init(jax.random.key(0), IMG))
    plain = check(Net(False).apply, v, IMG, sites=1 if scanned else 3)
    out = check(Net(True).apply, v, IMG, sites=1 if scanned else 3)
    assert [c.kernel for c in out.changes] == [c.kernel for c in plain.changes]
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(plain.params)):
        np.testing.assert_array_equal(a, b)
    said = lambda o: sorted(str(s.reason) for s in o.report.sites if s.reason)  # noqa: E731
    assert said(out) == said(plain) and not any("inside" in r for r in said(out)), str(out)


def test_a_bn_inside_a_cond_branch_is_left_with_the_reason():
    """A ``cond`` branch is not read as inlined (which branch runs is decided per call): its
    BN is left, said, the tree unchanged."""
    rng = np.random.default_rng(0)
    p = {"k": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32),
         "g": jnp.asarray(rng.random(8) + 0.5, jnp.float32), "b": jnp.ones(8),
         "m": jnp.full(8, 0.1), "v": jnp.full(8, 2.0)}
    bn = lambda p, x: (x @ p["k"] - p["m"]) * jax.lax.rsqrt(p["v"] + 1e-5) * p["g"] + p["b"]  # noqa
    f = lambda p, x: jax.lax.cond(x[0, 0] > 0, lambda x: bn(p, x), lambda x: 2 * x, x)  # noqa
    x = jnp.ones((2, 8))
    out = hlofold.fold_params(f, p, x)
    assert out.changes == [], str(out)
    assert any("inside top/cond" in str(s.reason) and "not a cond branch" in str(s.reason)
               for s in out.report.sites), str(out)
    for k in p:
        np.testing.assert_array_equal(out.params[k], p[k])


def roles(change) -> dict:
    """role -> the paths with it."""
    out: dict = {}
    for path, role in change.roles.items():
        out.setdefault(role, []).append(path)
    return out


def test_flax_nnx_batchnorm():
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, r):
            self.c = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=r)
            self.bn = nnx.BatchNorm(8, use_running_average=True, rngs=r)

        def __call__(self, x):
            return self.bn(self.c(x))

    graph, state = nnx.split(CNN(nnx.Rngs(0)))
    check(lambda s, x: nnx.merge(graph, s)(x), trained(state), IMG, sites=1)


def test_haiku_batchnorm():
    import haiku as hk

    def net(x, is_training):
        x = hk.Conv2D(8, 3, with_bias=False)(x)
        return hk.BatchNorm(True, True, 0.9)(x, is_training=is_training)

    t = hk.without_apply_rng(hk.transform_with_state(net))
    params, state = trained(t.init(jax.random.key(0), IMG, True))
    f = lambda ps, x: t.apply(ps[0], ps[1], x, False)[0]
    out = check(f, (params, state), IMG, sites=1)
    assert any("mean_ema" in p for p in out.changes[0].identity)
    r = roles(out.changes[0])
    assert sorted(r) == ["mean", "scale", "shift", "variance"], r
    assert "mean_ema" in r["mean"][0] and "var_ema" in r["variance"][0]
    assert "offset" in r["shift"][0] and "'scale'" in r["scale"][0]
    assert out.changes[0].epsilon == float(np.float32(1e-5))


def test_equinox_batchnorm():
    import equinox as eqx
    conv = eqx.nn.Conv2d(3, 8, 3, use_bias=True, key=jax.random.key(0))
    bn = eqx.nn.BatchNorm(8, axis_name="batch", inference=True)
    model, state = trained((conv, bn)), eqx.nn.State(bn)
    model = (model[0], model[1])
    params, static = eqx.partition((model, trained(state)), eqx.is_array)

    def f(p, x):
        (c, b), st = eqx.combine(p, static)
        return jax.vmap(lambda img: b(c(img), st)[0], axis_name="batch")(x)

    x = jnp.transpose(IMG, (0, 3, 1, 2))
    out = check(f, params, x, sites=1)
    r = roles(out.changes[0])      # the conv's bias and the BN's both shifts
    assert sorted(r) == ["mean", "scale", "shift", "variance"] and len(r["shift"]) == 2, r
    assert out.changes[0].epsilon == float(np.float32(1e-5))


def test_keras_batchnorm():
    import keras
    inp = keras.Input((8, 8, 3))
    y = keras.layers.BatchNormalization()(keras.layers.Conv2D(8, 3, use_bias=False)(inp))
    model = keras.Model(inp, y)
    for w in model.weights:
        w.assign(np.asarray(trained(np.asarray(w.value))))
    tv = [w.value for w in model.trainable_variables]
    ntv = [w.value for w in model.non_trainable_variables]
    f = lambda ws, x: model.stateless_call(ws[0], ws[1], x)[0]
    out = check(f, (tv, ntv), IMG, sites=1)
    # Keras writes x·inv + (β − μ·inv): each leaf's role read all the same (the paths here
    # are list indices: [0][k] trainable, [1][k] not)
    bn = model.layers[-1]
    index = {id(w): f"[{j}][{k}]" for j, ws in enumerate((model.trainable_variables,
                                                           model.non_trainable_variables))
             for k, w in enumerate(ws)}
    assert out.changes[0].roles == {index[id(bn.gamma)]: "scale", index[id(bn.beta)]: "shift",
                                    index[id(bn.moving_mean)]: "mean",
                                    index[id(bn.moving_variance)]: "variance"}
    assert out.changes[0].epsilon == float(np.float32(bn.epsilon))
    for w, v in zip(model.trainable_variables + model.non_trainable_variables,
                    jax.tree.leaves(out.params)):   # hand them to the model's variables
        w.assign(v)
    assert_close(f((tv, ntv), IMG), model(IMG))


# ---------------------------------------------------------------- norm folds, forward

@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_flax_norms_into_projections(kind):
    import flax.linen as nn
    f, v = flax_linen_block(getattr(nn, kind))
    out = hlofold.fold_params(f, v, X)
    assert_close(f(v, X), f(out.params, X))
    written = {c.kernel for c in out.changes}
    # all five fold; the block's K projection has no bias, so LayerNorm's β stays in front
    # as β/γ (tests/front/test_front_shift.py); RMSNorm has no β
    assert len(written) == 5, str(out)
    assert {c.front is not None for c in out.changes} == ({False} if kind == "RMSNorm"
                                                           else {True, False})
    norm = [p for c in out.changes for p in c.identity if "scale" in p]
    assert norm and all(np.all(np.asarray(leaf(out.params, p)) == 1) for p in norm)
    for c in out.changes:          # γ a scale, β a shift; the norm's ε is no parameter's
        assert {r for p, r in c.roles.items() if "Norm" in p} <= {"scale", "shift"}, c.roles
        assert any(r == "scale" for r in c.roles.values()) and c.epsilon is None


def test_decoder_tied_head_is_kept():
    f, p = decoder("llama")
    tokens = jnp.asarray(RNG.integers(0, 32, (2, 5)), jnp.int32)
    out = check(f, p, tokens, sites=10)                    # 5 per layer; the head is tied
    # (the head's kernel is the embedding transposed: writing it would change the lookup)
    assert "a parameter it changes is also read by gather" in str(out)
    assert np.all(np.asarray(out.params["final"]) == np.asarray(p["final"]))
    assert np.all(np.asarray(out.params["layers"][0]["n1"]) == 1)


def test_gemma_identity_is_zero():
    """Gemma's ``x·(1 + scale)``: the identity is scale = 0."""
    f, p = decoder("gemma", layers=1)
    tokens = jnp.zeros((1, 4), jnp.int32)
    out = check(f, p, tokens, sites=5)
    assert np.all(np.asarray(out.params["layers"][0]["n2"]) == 0)


def test_nothing_given_is_modified():
    f, v = flax_cnn()
    before = jax.tree.map(np.array, v)
    hlofold.fold_params(f, v, IMG)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, v))


def test_nothing_is_held_beside_the_new_leaves(monkeypatch):
    """Issue 29: after fold_params the only new arrays alive are the rewritten leaves (no
    host copy of the model, no factor or check output kept, each new kernel placed without a
    second copy), with every kernel rescaled in several chunks by the thread pool."""
    from hlofold._fold.core import rescale
    monkeypatch.setattr(rescale, "PARALLEL_MIN", 0)
    monkeypatch.setattr(rescale, "CHUNK", 512)
    written, scaled = set(), rescale.scaled

    def recorded(*a):
        out = scaled(*a)
        written.add(out[0].ctypes.data)
        return out
    monkeypatch.setattr(rescale, "scaled", recorded)

    def rms(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    def f(p, x):
        h = jax.nn.silu(rms(x, p["g1"]) @ p["w1"])
        return rms(h, p["g2"]) @ p["w2"] + p["b2"]

    p = {"g1": jnp.linspace(0.5, 1.5, 64), "w1": jnp.asarray(RNG.standard_normal((64, 96)),
                                                             jnp.float32),
         "g2": jnp.linspace(0.8, 1.2, 96), "w2": jnp.asarray(RNG.standard_normal((96, 40)),
                                                             jnp.float32),
         "b2": jnp.zeros(40)}
    x = jnp.asarray(RNG.standard_normal((4, 64)), jnp.float32)
    jax.block_until_ready(p)
    before = {id(a): a for a in jax.live_arrays()}      # (held: no id is reused)
    out = hlofold.fold_params(f, p, x)
    new = [a for a in jax.live_arrays() if id(a) not in before]
    rewritten = [b for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(out.params))
                 if a is not b]
    assert len(out.changes) == 2 and len(rewritten) >= 4      # w1, g1, w2, g2 (b2)
    assert sorted(map(id, new)) == sorted(map(id, rewritten)), [(a.shape, a.dtype) for a in new]
    # the kernels placed are the rescale's own buffers (JAX aliases them: no second copy)
    assert {out.params[k].unsafe_buffer_pointer() for k in ("w1", "w2")} <= written
    assert_close(f(p, x), f(out.params, x))


def test_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    f, v = flax_cnn()
    out = hlofold.fold_params(f, v, IMG)
    path = tmp_path / "folded"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, out.params)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(path, jax.tree.map(np.zeros_like, out.params))
    assert_close(f(v, IMG), f(restored, IMG))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, out.params),
                 jax.tree.map(np.asarray, restored))


def _keras_layers():
    import keras
    L = keras.layers
    return {
        "Conv1D": ((16, 4), lambda: L.Conv1D(6, 3)),
        "Conv2D": ((8, 8, 4), lambda: L.Conv2D(6, 3)),
        "Conv3D": ((6, 6, 6, 4), lambda: L.Conv3D(6, 3)),
        "Conv2D-grouped": ((8, 8, 4), lambda: L.Conv2D(6, 3, groups=2)),
        "SeparableConv2D": ((8, 8, 4), lambda: L.SeparableConv2D(6, 3)),
        "DepthwiseConv2D": ((8, 8, 4), lambda: L.DepthwiseConv2D(3, use_bias=False)),
        "DepthwiseConv2D-x2": ((8, 8, 4), lambda: L.DepthwiseConv2D(3, depth_multiplier=2)),
        "Conv1DTranspose": ((16, 4), lambda: L.Conv1DTranspose(6, 3)),
        "Conv2DTranspose": ((8, 8, 4), lambda: L.Conv2DTranspose(6, 3, strides=2,
                                                                 use_bias=False)),
        "Conv3DTranspose": ((6, 6, 6, 4), lambda: L.Conv3DTranspose(6, 3)),
        "Dense": ((4,), lambda: L.Dense(6)),
        "EinsumDense": ((5, 4), lambda: L.EinsumDense("btd,de->bte", output_shape=(None, 6),
                                                      bias_axes="e")),
    }


@pytest.mark.parametrize("name", list(_keras_layers()))
def test_keras_layers_write_back_what_fold_folds(name):
    """Each Keras conv/dense layer followed by BatchNormalization: fold_params writes back
    the site fold folds — also where the Keras JAX backend reshapes (DepthwiseConv2D, with a
    depth multiplier), reverses and transposes (the transposed convolutions) the kernel
    leaf on its way to the convolution — and the model given the written variables computes
    the same outputs."""
    import keras
    shape, make = _keras_layers()[name]
    inp = keras.Input(shape)
    model = keras.Model(inp, keras.layers.BatchNormalization()(make()(inp)))
    for w in model.weights:
        w.assign(np.asarray(trained(np.asarray(w.value))))
    x = jnp.asarray(RNG.standard_normal((2,) + shape), jnp.float32)
    tv = [w.value for w in model.trainable_variables]
    ntv = [w.value for w in model.non_trainable_variables]
    f = lambda ws, x: model.stateless_call(ws[0], ws[1], x)[0]    # noqa: E731
    assert hlofold.fold(f).report((tv, ntv), x).num_folded == 1
    out = check(f, (tv, ntv), x, sites=1)
    for w, v in zip(model.trainable_variables + model.non_trainable_variables,
                    jax.tree.leaves(out.params)):
        w.assign(v)
    assert_close(f((tv, ntv), x), model(x))
