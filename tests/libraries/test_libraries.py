"""Folding BatchNorm in programs built from real neural-network libraries.

Every case uses the library's own conv and BatchNorm layers (Flax linen, Flax NNX, Haiku,
Equinox, Keras 3), overwrites the initialized BatchNorm statistics and affine parameters with
non-trivial values (mean ≠ 0, var ≠ 1, γ ≠ 1, β ≠ 0: the defaults would hide a wrong fold),
and checks, with the parameters both as inputs and frozen, that

* every BatchNorm is folded (``report.num_folded``), with the expected rescale kind;
* for parameters as inputs, the absorbed operands are the BN's statistics and affine
  parameters (and the conv bias), named by their pytree paths;
* no conv output is scaled afterwards in the folded program (nor in the per-call part of
  the prepare/apply split);
* the folded function returns what the unfolded one returns, called directly, a second
  time (cached prepared values) and under ``jax.jit``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from tests.helpers import assert_no_scaling_after_convs, fold_checked

MODES = [
    pytest.param(False, "prepared", id="params-as-inputs"),
    pytest.param(True, "constant", id="frozen"),
]
BIAS = pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])


# ---------------------------------------------------------------------------- helpers


def _rng(seed):
    return np.random.default_rng(seed)


def _bn_values(rng, shape, kind, dtype=np.float32):
    """Non-trivial BN values: var = exp(0.5·N), γ = 1 + 0.5·N, mean and β = N."""
    z = rng.standard_normal(shape)
    v = {"var": np.exp(0.5 * z), "scale": 1.0 + 0.5 * z}.get(kind, z)
    return jnp.asarray(v, dtype)


def _image(seed, shape=(2, 8, 8, 3), dtype=jnp.float32):
    return jnp.asarray(_rng(seed).standard_normal(shape), dtype)


def _names(argname, tree):
    """``{pytree path as hlofold names it: leaf}`` for one argument."""
    return {argname + jax.tree_util.keystr(p): l
            for p, l in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_fold(f, args, *, freeze, rescale, expected_params):
    """Fold ``f`` and check the report, the folded program and the outputs against ``f``.

    ``expected_params``: for each BatchNorm, in program order, the names of the inputs its
    fold must absorb (checked when the parameters are inputs).
    """
    num_bn = len(expected_params)
    folded, report, ref, out = fold_checked(f, *args, folds=num_bn, freeze=freeze, refused=0,
                                            root="conv_general_dilated")
    msg = str(report)
    for s, expected in zip(report.folded, expected_params):
        assert s.rescale == rescale, msg
        assert s.absorbed, msg
        if rescale == "prepared":
            assert set(expected) <= set(s.params), (sorted(expected), s.params, msg)
    assert_no_scaling_after_convs(folded.split(*args).apply_jaxpr)
    return folded, report, ref, out


# ---------------------------------------------------------------------------- Flax linen


def _linen_model(use_bias, dtype=jnp.float32):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for c in (8, 6):
                x = nn.Conv(c, (3, 3), use_bias=use_bias, dtype=dtype,
                            param_dtype=jnp.float32)(x)
                x = nn.BatchNorm(use_running_average=True, dtype=dtype,
                                 param_dtype=jnp.float32)(x)
                x = nn.relu(x)
            return x

    return Net()


def _linen_randomize(variables, seed):
    rng = _rng(seed)
    params = dict(variables["params"])
    stats = dict(variables["batch_stats"])
    assert set(stats) == {"BatchNorm_0", "BatchNorm_1"}
    for bn in stats:
        n = stats[bn]["mean"].shape
        stats[bn] = {"mean": _bn_values(rng, n, "mean"), "var": _bn_values(rng, n, "var")}
        params[bn] = {"scale": _bn_values(rng, n, "scale"), "bias": _bn_values(rng, n, "bias")}
    return {"params": params, "batch_stats": stats}


def _linen_expected(use_bias):
    out = []
    for i in range(2):
        e = {f"variables['batch_stats']['BatchNorm_{i}']['mean']",
             f"variables['batch_stats']['BatchNorm_{i}']['var']",
             f"variables['params']['BatchNorm_{i}']['scale']",
             f"variables['params']['BatchNorm_{i}']['bias']"}
        if use_bias:
            e.add(f"variables['params']['Conv_{i}']['bias']")
        out.append(e)
    return out


@pytest.mark.parametrize("jit", [False, True], ids=["plain", "jit"])
@BIAS
@pytest.mark.parametrize("frozen,rescale", MODES)
def test_flax_linen(use_bias, jit, frozen, rescale):
    model = _linen_model(use_bias)
    x = _image(1)
    variables = _linen_randomize(model.init(jax.random.key(0), x), seed=2)

    def f(variables, x):
        return model.apply(variables, x)

    if jit:
        f = jax.jit(f)
    _check_fold(f, (variables, x), freeze=0 if frozen else (), rescale=rescale,
                expected_params=_linen_expected(use_bias))


@pytest.mark.parametrize("frozen,rescale", MODES)
def test_flax_linen_bfloat16(frozen, rescale):
    """bf16 compute (``dtype=bfloat16``), float32 parameters: Flax's BatchNorm computes in
    float32, so a bf16 kernel is refused by default (reason named) and every BN folds with
    ``float32_kernels=True``, bf16-close."""
    model = _linen_model(use_bias=True, dtype=jnp.bfloat16)
    x = _image(3)
    variables = _linen_randomize(model.init(jax.random.key(0), x), seed=4)

    def f(variables, x):
        return model.apply(variables, x)

    args = (variables, x)
    report = hlofold.fold(f, freeze=0 if frozen else ()).report(*args)
    assert report.num_folded == 0 and report.num_refused == 2, str(report)
    assert all("float32_kernels=True" in s.reason for s in report.refused)
    folded = hlofold.fold(f, freeze=0 if frozen else (), float32_kernels=True)
    report = folded.report(*args)
    print(report)
    assert report.num_folded == 2, str(report)
    for s in report.folded:
        assert s.rescale == rescale, str(report)
    assert_no_scaling_after_convs(folded.jaxpr(*args))
    ref = f(*args)
    out = folded(*args)
    assert ref.dtype == out.dtype == jnp.bfloat16
    r, o = np.asarray(ref, np.float32), np.asarray(out, np.float32)
    err = float(np.max(np.abs(r - o)))
    assert err <= 2e-2 * float(np.max(np.abs(r))), err


# ---------------------------------------------------------------------------- Flax NNX


@BIAS
@pytest.mark.parametrize("frozen,rescale", MODES)
def test_flax_nnx(use_bias, frozen, rescale):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv1 = nnx.Conv(3, 8, (3, 3), use_bias=use_bias, rngs=rngs)
            self.bn1 = nnx.BatchNorm(8, rngs=rngs)
            self.conv2 = nnx.Conv(8, 6, (3, 3), use_bias=use_bias, rngs=rngs)
            self.bn2 = nnx.BatchNorm(6, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.bn1(self.conv1(x)))
            return nnx.relu(self.bn2(self.conv2(x)))

    model = Net(nnx.Rngs(0))
    rng = _rng(5)
    for bn in (model.bn1, model.bn2):
        n = bn.mean.value.shape
        bn.mean.value = _bn_values(rng, n, "mean")
        bn.var.value = _bn_values(rng, n, "var")
        bn.scale.value = _bn_values(rng, n, "scale")
        bn.bias.value = _bn_values(rng, n, "bias")
    model.eval()
    gd, state = nnx.split(model)

    def f(state, x):
        return nnx.merge(gd, state)(x)

    expected = []
    for i in (1, 2):
        e = {f"state['bn{i}']['{k}'].value" for k in ("mean", "var", "scale", "bias")}
        if use_bias:
            e.add(f"state['conv{i}']['bias'].value")
        expected.append(e)
    names = _names("state", state)
    assert all(n in names for e in expected for n in e), sorted(names)
    _check_fold(f, (state, _image(6)), freeze=0 if frozen else (), rescale=rescale,
                expected_params=expected)


# ---------------------------------------------------------------------------- Haiku


@BIAS
@pytest.mark.parametrize("frozen,rescale", MODES)
def test_haiku(use_bias, frozen, rescale):
    import haiku as hk

    def net(x, is_training):
        for c in (8, 6):
            x = hk.Conv2D(c, 3, with_bias=use_bias)(x)
            x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(
                x, is_training=is_training)
            x = jax.nn.relu(x)
        return x

    t = hk.transform_with_state(net)
    x = _image(7)
    params, state = t.init(jax.random.key(0), x, True)
    bns, convs = ("batch_norm", "batch_norm_1"), ("conv2_d", "conv2_d_1")
    rng = _rng(8)
    params, state = dict(params), dict(state)
    for bn in bns:
        n = params[bn]["scale"].shape
        params[bn] = {"scale": _bn_values(rng, n, "scale"),
                      "offset": _bn_values(rng, n, "bias")}
        for ema, kind in (("mean_ema", "mean"), ("var_ema", "var")):
            key = f"{bn}/~/{ema}"
            s = dict(state[key])
            s["average"] = _bn_values(rng, s["average"].shape, kind)
            s["hidden"] = _bn_values(rng, s["hidden"].shape, kind)
            state[key] = s

    def f(params, state, x):
        return t.apply(params, state, None, x, False)

    expected = []
    for bn, conv in zip(bns, convs):
        e = {f"state['{bn}/~/mean_ema']['average']", f"state['{bn}/~/var_ema']['average']",
             f"params['{bn}']['scale']", f"params['{bn}']['offset']"}
        if use_bias:
            e.add(f"params['{conv}']['b']")
        expected.append(e)
    _, _, ref, out = _check_fold(f, (params, state, x), freeze=(0, 1) if frozen else (),
                                 rescale=rescale, expected_params=expected)
    (_, s_ref), (_, s_out) = ref, out
    assert jax.tree.structure(s_ref) == jax.tree.structure(s_out)
    for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_out)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(s_out)):  # stats left unchanged
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------- Equinox


@BIAS
@pytest.mark.parametrize("frozen,rescale", MODES)
def test_equinox(use_bias, frozen, rescale):
    import equinox as eqx

    class Net(eqx.Module):
        conv1: eqx.nn.Conv2d
        bn1: eqx.nn.BatchNorm
        conv2: eqx.nn.Conv2d
        bn2: eqx.nn.BatchNorm

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv1 = eqx.nn.Conv2d(3, 8, 3, use_bias=use_bias, key=k1)
            self.bn1 = eqx.nn.BatchNorm(8, axis_name="batch", mode="ema")
            self.conv2 = eqx.nn.Conv2d(8, 6, 3, use_bias=use_bias, key=k2)
            self.bn2 = eqx.nn.BatchNorm(6, axis_name="batch", mode="ema")

        def __call__(self, x, state):
            x = self.conv1(x)
            x, state = self.bn1(x, state)
            x = jax.nn.relu(x)
            x = self.conv2(x)
            x, state = self.bn2(x, state)
            return jax.nn.relu(x), state

    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    rng = _rng(9)
    stats = []
    for bn in (model.bn1, model.bn2):
        c = bn.input_size
        mv = (_bn_values(rng, (c,), "mean"), _bn_values(rng, (c,), "var"))
        state = state.set(bn.ema_state_index, mv)
        stats.append(mv)
    model = eqx.tree_at(
        lambda m: (m.bn1.weight, m.bn1.bias, m.bn2.weight, m.bn2.bias), model,
        (_bn_values(rng, (8,), "scale"), _bn_values(rng, (8,), "bias"),
         _bn_values(rng, (6,), "scale"), _bn_values(rng, (6,), "bias")))
    model = eqx.nn.inference_mode(model)
    arrays, static = eqx.partition(model, eqx.is_array)
    x = _image(10, shape=(2, 3, 8, 8))  # Equinox convs are channels-first

    def f(arrays, state, x):
        m = eqx.combine(arrays, static)
        return jax.vmap(m, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, state)

    # The State's leaves are named by flat index: find the running mean and var by value.
    state_names = _names("state", state)

    def name_of(v):
        hits = [n for n, l in state_names.items()
                if l.shape == v.shape and np.array_equal(np.asarray(l), np.asarray(v))]
        assert len(hits) == 1, hits
        return hits[0]

    expected = []
    for i, (mean, var) in zip((1, 2), stats):
        e = {name_of(mean), name_of(var), f"arrays.bn{i}.weight", f"arrays.bn{i}.bias"}
        if use_bias:
            e.add(f"arrays.conv{i}.bias")
        expected.append(e)
    _check_fold(f, (arrays, state, x), freeze=(0, 1) if frozen else (), rescale=rescale,
                expected_params=expected)


# ---------------------------------------------------------------------------- Keras 3


def _keras_check(model, frozen, rescale, seed):
    rng = _rng(seed)
    bn_layers = [l for l in model.layers if type(l).__name__ == "BatchNormalization"]
    for layer in bn_layers:
        n = layer.gamma.shape
        layer.gamma.assign(np.asarray(_bn_values(rng, n, "scale")))
        layer.beta.assign(np.asarray(_bn_values(rng, n, "bias")))
        layer.moving_mean.assign(np.asarray(_bn_values(rng, n, "mean")))
        layer.moving_variance.assign(np.asarray(_bn_values(rng, n, "var")))
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    x = _image(seed + 1)

    def f(tv, ntv, x):
        return model.stateless_call(tv, ntv, x, training=False)[0]

    def name_of(var):
        for arg, vs in (("tv", model.trainable_variables),
                        ("ntv", model.non_trainable_variables)):
            hits = [i for i, v in enumerate(vs) if v is var]
            if hits:
                return f"{arg}[{hits[0]}]"
        raise AssertionError(var.path)

    expected = []
    for conv, bn in zip(model.layers[0::3], model.layers[1::3]):
        assert type(bn).__name__ == "BatchNormalization"
        assert bn.moving_mean.path.endswith("moving_mean")
        e = {name_of(bn.moving_mean), name_of(bn.moving_variance), name_of(bn.gamma),
             name_of(bn.beta)}
        if conv.use_bias:
            e.add(name_of(conv.bias))
        expected.append(e)
    assert len(expected) == len(bn_layers) == 2
    _check_fold(f, (tv, ntv, x), freeze=(0, 1) if frozen else (), rescale=rescale,
                expected_params=expected)


@BIAS
@pytest.mark.parametrize("frozen,rescale", MODES)
def test_keras_conv2d(use_bias, frozen, rescale):
    import keras

    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same", use_bias=use_bias),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.Conv2D(6, 3, use_bias=use_bias),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
    ])
    _keras_check(model, frozen, rescale, seed=11)


@BIAS
@pytest.mark.parametrize("frozen,rescale", MODES)
def test_keras_depthwise(use_bias, frozen, rescale):
    import keras

    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 1, use_bias=use_bias),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.DepthwiseConv2D(3, padding="same", use_bias=use_bias),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
    ])
    assert model.layers[3].__class__.__name__ == "DepthwiseConv2D"
    _keras_check(model, frozen, rescale, seed=13)
