"""``fold_params(..., smooth=[inputs], alpha=)``: SmoothQuant's scales folded into the model
(issue 51, item 2). A norm's γ/β (or the layer before a gated product) divided by
``s_j = max|X_j|^α / max|W_j|^(1−α)``, every layer reading it multiplied: the same outputs
(rel ≤ 1e-5), activations with smaller outliers, w8a8 that errs less; what cannot be
smoothed is said."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold._base.reasons import KINDS
from benchmarks.quantization import smooth_case, wxa8
from hlofold import examples
from tests.quant.jaxpr.test_equalize import rel

EXACT = 1e-5


def smoothed(f, p, x, calib, pairs, **kw):
    before = jax.tree.map(np.array, p)
    out = hlofold.fold_params(f, p, *x, smooth=calib, **kw)
    assert len(out.smoothed) == pairs, str(out)
    assert all(e.kind == "smoothed" for e in out.smoothed) and not out.equalized
    assert all(n.kind in KINDS for n in out.not_smoothed), str(out)    # each with its kind
    for r, o in zip(jax.tree.leaves(f(p, *x)), jax.tree.leaves(f(out.params, *x))):
        assert rel(r, o) <= EXACT, (rel(r, o), str(out))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(p)):
        np.testing.assert_array_equal(a, np.asarray(b))          # nothing given is changed
    return out


def test_decoder_norms_and_gated_product():
    f, p, x, calib = smooth_case("decoder", 0)
    out = smoothed(f, p, x, calib, pairs=9)   # per layer: both norms, v, up; the head
    first = {e.first: e for e in out.smoothed}
    qkv = first["['layers'][0]['attn_norm']"]
    assert qkv.seconds == [f"['layers'][0]['{n}']" for n in "qkv"]
    assert first["['layers'][1]['up']"].seconds == ["['layers'][1]['down']"]
    assert first["['final_norm']"].seconds == ["['head']"]
    assert qkv.scale_range[1] / qkv.scale_range[0] > 3        # the massive channels
    # v -> o through attention: split into heads, a batch axis of probs @ v, merged back
    assert first["['layers'][0]['v']"].seconds == ["['layers'][0]['o']"]
    assert any("['layers'][0]['q']" == n.kernel and "split over axes" in n.reason
               for n in out.not_smoothed), str(out)
    # the point: w8a8 (weights per channel, activations per tensor) errs less
    ref = f(p, *x)
    assert rel(ref, wxa8(f, out.params, *x)) < 0.75 * rel(ref, wxa8(f, p, *x))


@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_flax_block(norm):
    f, p, x, calib = smooth_case(norm, 1)
    out = smoothed(f, p, x, calib, pairs=4)
    assert sorted(len(e.seconds) for e in out.smoothed) == [1, 1, 2, 3]   # v, up; gate+up; qkv
    biases = [b for e in out.smoothed for b in e.biases]
    if norm == "LayerNorm":                   # β divided with γ
        assert any(b.endswith("['bias']") and "LayerNorm" in b for b in biases)


@pytest.mark.parametrize("block_seed", [0, 2, 5])
def test_alpha_moves_more_into_weights(block_seed):
    """With massive activation channels a larger α follows them more: the scales spread
    wider (the block's parameters from their own generator: drawn from the shared one, they
    depended on which tests ran before in the process, and one order on jax 0.10.2 drew a
    block where they did not)."""
    f, p, x, calib = smooth_case("RMSNorm", 2, block_seed=block_seed)
    lo = smoothed(f, p, x, calib, pairs=4, alpha=0.25)
    hi = smoothed(f, p, x, calib, pairs=4, alpha=0.75)
    span = lambda o: max(e.scale_range[1] / e.scale_range[0] for e in o.smoothed)  # noqa: E731
    assert span(hi) > 1.4 * span(lo)
    assert {e.alpha for e in lo.smoothed} == {0.25} and {e.alpha for e in hi.smoothed} == {0.75}
    assert "α 0.75, scales" in str(hi)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), "0.5", True, None])
def test_alpha_outside_0_1_is_an_error(alpha):
    f, p, x, calib = smooth_case("RMSNorm", 0)
    with pytest.raises(ValueError, match="alpha= must be a number from 0 to 1"):
        hlofold.fold_params(f, p, *x, smooth=calib, alpha=alpha)


def test_post_norm_residual_refused():
    def f(p, x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]
        return h + jax.nn.relu(h @ p["w"]) @ p["w2"]        # h also feeds the residual
    rng = np.random.default_rng(0)
    p = {"g": jnp.asarray(1 + rng.random(16), jnp.float32),
         "w": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
         "w2": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    out = smoothed(f, p, (x,), [x], pairs=1)                 # w -> relu -> w2 only
    assert out.smoothed[0].first == "['w']"
    g = next(n for n in out.not_smoothed if n.kernel == "['g']")
    assert "not only by layers" in g.reason


def test_bad_calibration_inputs():
    p = examples.init_decoder(1, d=64, vocab=32)
    t = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="smooth= input"):
        hlofold.fold_params(examples.decoder_apply, p, t, smooth=[(t, t)])
    with pytest.raises(TypeError, match=r"smooth= takes a list of calibration inputs.*got bool"):
        # (was: TypeError: 'bool' object is not iterable)
        hlofold.fold_params(examples.decoder_apply, p, t, smooth=True)
    with pytest.raises(ValueError, match="at least one calibration input"):
        hlofold.fold_params(examples.decoder_apply, p, t, smooth=[])


@pytest.mark.parametrize("seed", range(24))
def test_generated_decoders(seed):
    """Random decoder layers (readers of each norm, head counts, transposed heads, β, ops
    that stop a path): the outputs stay within 1e-5, exactly the open paths are smoothed."""
    from tests.helpers.pair_programs import decoder_program
    fn, p, x, calib, expected = decoder_program(seed)
    smoothed(fn, p, (x,), calib, pairs=expected)



@pytest.mark.parametrize("seed", range(8))
def test_generated_decoders_from_degenerate_example_inputs(seed):
    """Issue 68 item 2 over the generated decoders: the example inputs zeros, calibrated on
    real activations — the pairs of the layer, the outputs on fresh inputs within 1e-5 (the
    check ran on random inputs of the example's shapes, not only on the zeros)."""
    from tests.helpers.pair_programs import decoder_program
    fn, p, x, calib, expected = decoder_program(seed)
    out = hlofold.fold_params(fn, p, jnp.zeros_like(x), smooth=calib)
    assert len(out.smoothed) == expected, str(out)
    assert rel(fn(p, x), fn(out.params, x)) <= EXACT, str(out)


@pytest.mark.parametrize("seed", range(8))
def test_generated_decoders_calibrated_at_other_shapes(seed):
    """Issue 68 item 4 over the generated decoders: calibration inputs of batches 1–3 and
    lengths 2–8, none the example's — the layer's pairs, exact outputs, and each record's
    scales those of the same rows given one at a time (each calibrated at its own shape)."""
    from tests.helpers.pair_programs import decoder_program
    fn, p, x, calib, expected = decoder_program(seed)
    rng = np.random.default_rng(seed)
    shaped = [jnp.asarray(np.resize(np.asarray(c), (int(rng.integers(1, 4)),
                                                     int(rng.integers(2, 9)), c.shape[-1])))
              for c in calib]
    out = smoothed(fn, p, (x,), shaped, pairs=expected)
    rows = hlofold.fold_params(fn, p, x, smooth=[c[i:i + 1] for c in shaped
                                                  for i in range(c.shape[0])])
    assert [e.first for e in rows.smoothed] == [e.first for e in out.smoothed]
    np.testing.assert_allclose([e.scale_range for e in rows.smoothed],
                               [e.scale_range for e in out.smoothed], rtol=1e-6)

@pytest.mark.parametrize("bias", [True, False])
def test_multi_head_kernels(bias):
    """Flax DenseGeneral q/k/v with (d, heads, head_dim) kernels read a norm: their input
    rows are smoothed; v's multi-head output (its channels over (heads, head_dim)) pairs with
    the output projection's (heads, head_dim, d) kernel through attention, its bias over
    (heads, head_dim) divided with it."""
    from tests.helpers.blocks import flax_multi_head_block
    f, v, x, calib = flax_multi_head_block(bias)
    out = smoothed(f, v, (x,), calib, pairs=2)
    assert sorted(len(e.seconds) for e in out.smoothed) == [1, 3]
    vo = next(e for e in out.smoothed if len(e.seconds) == 1)
    assert "DenseGeneral_2" in vo.first and "DenseGeneral_3" in vo.seconds[0], str(out)
    assert vo.biases == (["['params']['DenseGeneral_2']['bias']"] if bias else [])
    assert vo.scale_range[1] / vo.scale_range[0] > 1.5


@pytest.mark.parametrize("repeat", [1, 2, 4])
def test_grouped_query_attention_pairs_v_o_through_the_repeat(repeat):
    """Grouped-query attention repeats the kv heads (``jnp.repeat`` along the head axis: a
    broadcast inserting the copies, a reshape merging them into the query heads; 4 = one kv
    head, multi-query attention): v -> o pairs, each v channel's scale on the input rows of
    o that every query head of its group reads — o's rows of one group scaled alike, each
    v column by one over its scale — smoothed and equalized, exact."""
    from tests.helpers.blocks import gqa_block
    f, p, x, calib = gqa_block(repeat)
    out = smoothed(f, p, (x,), calib, pairs=1)
    assert out.smoothed[0].first == "['v']" and out.smoothed[0].seconds == ["['o']"]
    hd, kvh = 4, 4 // repeat
    s = np.asarray(p["v"]) / np.asarray(out.params["v"])          # (d, kvh·hd): 1/s per column
    s = s[0]
    assert np.allclose(np.asarray(out.params["v"]) * s, p["v"], rtol=1e-5)
    rows = np.asarray(out.params["o"]) / np.asarray(p["o"])       # (4·hd, d): s per row
    want = np.repeat(s.reshape(kvh, 1, hd), repeat, axis=1).reshape(-1)
    np.testing.assert_allclose(rows, np.broadcast_to(want[:, None], rows.shape), rtol=1e-5)
    eq = hlofold.fold_params(f, p, x, equalize=True)
    assert [(e.first, e.seconds) for e in eq.equalized] == [("['v']", ["['o']"])], str(eq)
    assert rel(f(p, x), f(eq.params, x)) <= EXACT


@pytest.mark.parametrize("rewrite", ["smooth", "equalize"])
def test_sharding_constraints_between_layers_are_passed(rewrite):
    """``with_sharding_constraint`` on the activations between layers (MaxText's style) says
    where values live, not what they are: the norm folds through them, and the pairs are
    those of the same block without constraints, with the same scales."""
    from tests.helpers.blocks import constrained_block
    got = []
    for constrain in (True, False):
        f, p, x, calib = constrained_block(constrain)
        kw = {"smooth": calib} if rewrite == "smooth" else {"equalize": True}
        out = hlofold.fold_params(f, p, x, **kw)
        assert rel(f(p, x), f(out.params, x)) <= EXACT, str(out)
        got.append([(e.first, e.seconds, e.scale_range)
                    for e in (out.smoothed if rewrite == "smooth" else out.equalized)])
    assert got[0] == got[1] and len(got[0]) == (3 if rewrite == "smooth" else 2), got


def test_repeated_kv_channels_reaching_a_bias_are_left_with_the_reason():
    """A per-(head, head_dim) bias added after the kv heads are repeated: one value per
    position, not per channel — v -> o is left, saying so; nothing changes."""
    from tests.helpers.blocks import repeated_kv_bias_block
    f, p, x = repeated_kv_bias_block()
    out = smoothed(f, p, (x,), [x, 2 * x], pairs=0)
    assert any(n.kernel == "['v']" and "repeated over an axis" in n.reason
               for n in out.not_smoothed), str(out)


def test_multi_head_bias_read_elsewhere_stops_the_pair():
    """A (heads, head_dim) bias that something else reads too cannot be divided: said."""
    def f(p, x):
        v = jnp.einsum("btd,dhk->bthk", x, p["v"]) + p["b"]
        probs = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", x, x), -1)
        o = jnp.einsum("bqk,bkhe->bqhe", probs, v)
        return jnp.einsum("bqhe,hed->bqd", o, p["o"]) + p["b"].sum()
    rng = np.random.default_rng(0)
    p = {"v": jnp.asarray(rng.standard_normal((8, 2, 4)), jnp.float32),
         "b": jnp.asarray(rng.standard_normal((2, 4)), jnp.float32),
         "o": jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    out = smoothed(f, p, (x,), [x], pairs=0)
    assert any(n.kernel == "['v']" and "read 2 times" in n.reason
               for n in out.not_smoothed), str(out)


def _outlier_inputs(shape, k):
    x = np.random.default_rng(k).standard_normal(shape).astype(np.float32)
    x[..., :2] *= 25
    return jnp.asarray(x)


@pytest.mark.parametrize("alpha", [0.5, "search:w4a8"])
def test_haiku_rmsnorm_linear(alpha):
    import haiku as hk

    def net(x):
        h = hk.RMSNorm(-1)(x)
        return jax.nn.relu(hk.Linear(24)(h)) @ hk.get_parameter("w2", (24, 16), init=jnp.ones)
    t = hk.without_apply_rng(hk.transform(net))
    x = _outlier_inputs((4, 16), 0)
    p = jax.tree.map(lambda a: a * (1 + 0.3 * np.random.default_rng(1).random(a.shape))
                     .astype(np.float32), t.init(jax.random.key(0), x))
    smoothed(t.apply, p, (x,), [_outlier_inputs((4, 16), k) for k in (1, 2)], pairs=2,
             alpha=alpha)


@pytest.mark.parametrize("alpha", [0.5, "search:w4a8"])
def test_equinox_layernorm_linear(alpha):
    """Equinox's Linear computes ``W @ x`` (the weight on the left): its input columns."""
    import equinox as eqx
    k1, k2 = jax.random.split(jax.random.key(0))
    model = (eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 24, key=k1), eqx.nn.Linear(24, 8, key=k2))
    params, static = eqx.partition(model, eqx.is_array)
    params = jax.tree.map(lambda a: a * (1 + 0.3 * np.random.default_rng(2).random(a.shape))
                          .astype(np.float32), params)

    def f(p, x):
        n, a, b = eqx.combine(p, static)
        return jax.vmap(lambda r: b(jax.nn.relu(a(n(r)))))(x)
    x = _outlier_inputs((4, 16), 3)
    out = smoothed(f, params, (x,), [_outlier_inputs((4, 16), k) for k in (4, 5)], pairs=2,
                   alpha=alpha)
    assert any(e.first.endswith(".weight") and len(e.biases) == 1 for e in out.smoothed)


@pytest.mark.parametrize("alpha", [0.5, "search:w4a8"])
def test_keras_layernorm_dense(alpha):
    import os
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    inp = keras.Input((16,))
    h = keras.layers.LayerNormalization()(inp)
    y = keras.layers.Dense(8)(keras.layers.ReLU()(keras.layers.Dense(24)(h)))
    model = keras.Model(inp, y)
    rng = np.random.default_rng(3)
    for w in model.weights:
        w.assign(np.asarray(w.value) + 0.3 * rng.random(w.shape))
    tv = [w.value for w in model.trainable_variables]
    f = lambda ws, x: model.stateless_call(ws, [], x)[0]          # noqa: E731
    x = _outlier_inputs((4, 16), 6)
    out = smoothed(f, tv, (x,), [_outlier_inputs((4, 16), k) for k in (7, 8)], pairs=1,
                   alpha=alpha)
    # Keras' LayerNormalization multiplies γ into a factor it applies to x and to the mean
    # (x·inv + (β − mean·inv)): two readers, so the norm is left, saying so
    assert any(n.kernel == "[0]" and "read 2 times" in n.reason for n in out.not_smoothed)


def test_the_benchmarks_smoothing_draws_keep_the_float_model():
    """``benchmarks.quantization --smooth --draws``: each draw's factors on the smoothing
    scales leave the float model as it was (rel ≤ 1e-5) but change the smoothed weights,
    and the patch is undone after each fold."""
    from benchmarks import quantization_full as qf
    from hlofold._quant.core import smooth as sq
    f, p, x, calib = smooth_case("decoder", 0)
    rule = sq.smoothing
    plain = hlofold.fold_params(f, p, *x, smooth=calib).params
    undo = qf.with_smoothing_draws(np.random.default_rng(0))
    try:
        drawn = hlofold.fold_params(f, p, *x, smooth=calib).params
    finally:
        undo()
    assert sq.smoothing is rule
    assert rel(f(p, *x), f(drawn, *x)) <= 1e-5
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(plain),
                                                       jax.tree.leaves(drawn))]
    assert sum(moved) >= 9, sum(moved)


def test_searched_alpha_is_exact_reported_and_quantizes_better():
    """``alpha="search:w4a8"``: each pair's α chosen from the calibration rows for int4
    weights per channel and int8 activations per tensor (AWQ's search, offline): the
    outputs exact, each record saying the α it took and for what; under that quantizer
    the built-in decoder errs less than with α 0.5 (``benchmarks/smooth_search.py``)."""
    from hlofold._quant.core.smooth_search import GRID
    f, p, x, calib = smooth_case("decoder", 0)
    out = smoothed(f, p, x, calib, pairs=9, alpha="search:w4a8")
    assert {e.searched for e in out.smoothed} == {"search:w4a8"}
    assert all(e.alpha is None or e.alpha in GRID for e in out.smoothed)
    assert len({e.alpha for e in out.smoothed}) > 1, str(out)       # chosen per pair
    assert "(searched for w4a8), scales" in str(out)
    fixed = hlofold.fold_params(f, p, *x, smooth=calib)
    ref = f(p, *x)
    err = lambda t: rel(ref, wxa8(f, t, *x, wbits=4))                  # noqa: E731
    assert err(out.params) < 0.97 * err(fixed.params), (err(out.params), err(fixed.params))


def test_search_keeps_the_rows_unsmoothed_where_no_alpha_helps():
    """Every channel alike (the same largest activation, the same largest weight row):
    each α's scales are one number, which per-tensor activations and per-channel weights
    do not see — no α beats no smoothing, the pair is left with scales 1 and says so."""
    def f(p, x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]
        return h @ p["w"]
    rng = np.random.default_rng(0)
    w = np.sign(rng.standard_normal((8, 16))).astype(np.float32)
    p = {"g": jnp.full(8, 2.0, jnp.float32), "w": jnp.asarray(w)}
    x = jnp.asarray(np.sign(rng.standard_normal((32, 8))), jnp.float32)
    out = smoothed(f, p, (x,), [x], pairs=1, alpha="search:w8a8")
    e = out.smoothed[0]
    assert e.alpha is None and e.scale_range == (1.0, 1.0), str(out)
    assert "α none better than unsmoothed (searched for w8a8)" in str(out)


@pytest.mark.parametrize("alpha", ["search", "search:w9a8", "search:w4a1", "search:w4a8 "])
def test_a_search_names_its_quantization(alpha):
    f, p, x, calib = smooth_case("RMSNorm", 0)
    with pytest.raises(ValueError, match="or \"search:wNaM\""):
        hlofold.fold_params(f, p, *x, smooth=calib, alpha=alpha)


@pytest.mark.parametrize("seed", range(0, 24, 3))
def test_generated_decoders_searched(seed):
    """The generated decoder layers (multi-head, transposed heads, β, stopped paths)
    smoothed with a searched α: exact, the same pairs as α 0.5."""
    from tests.helpers.pair_programs import decoder_program
    fn, p, x, calib, expected = decoder_program(seed)
    smoothed(fn, p, (x,), calib, pairs=expected, alpha="search:w4a8")


@pytest.mark.parametrize("repeat", [2, 4])
def test_grouped_query_attention_searched(repeat):
    """v -> o through the repeated kv heads with a searched α: the rows kept are one copy
    of each kv channel (their maxima the copies' largest), o's rows of one group scaled
    alike; exact."""
    from tests.helpers.blocks import gqa_block
    f, p, x, calib = gqa_block(repeat)
    out = smoothed(f, p, (x,), calib, pairs=1, alpha="search:w4a8")
    e = out.smoothed[0]
    assert (e.first, e.seconds, e.searched) == ("['v']", ["['o']"], "search:w4a8")
    rows = np.asarray(out.params["o"]) / np.asarray(p["o"])
    assert np.allclose(rows, rows[:, :1], rtol=1e-5)              # one scale per row
    per = rows[:, 0].reshape(4 // repeat, repeat, 4)             # (kv head, copy, head_dim)
    assert np.allclose(per, per[:, :1], rtol=1e-5)                # each copy the kv channel's


@pytest.mark.parametrize("seed", [0, 1, 5, 6, 15, 17])
def test_generated_cnn_chains_searched_with_grouped_layers(seed):
    """The equalization's generated conv chains (BN, biases, pooling, stopped paths), the
    seeds where a depthwise or grouped layer is a pair's second, smoothed with a searched α:
    the pairs of α 0.5, exact — the grouped layer read by the search as the dense layer it
    equals."""
    from tests.helpers.pair_programs import program
    fn, p, x, _, (layers, _) = program(seed)
    calib = [x, 2 * x + 1]
    want = hlofold.fold_params(fn, p, x, smooth=calib)
    grouped = [k for e in want.smoothed for k in e.seconds
               if k.startswith("['k") and layers[int(k[3:-2])][0] > 1]
    assert grouped, str(want)
    out = smoothed(fn, p, (x,), calib, pairs=len(want.smoothed), alpha="search:w4a8")
    assert [(e.first, e.seconds) for e in out.smoothed] == \
        [(e.first, e.seconds) for e in want.smoothed]
    assert all(e.searched == "search:w4a8" for e in out.smoothed)
