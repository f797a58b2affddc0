"""Forward folding: a per-input-channel affine *before* a conv or Dense."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
import hlofold._compat as C
from hlofold._fold.core.decide import BIAS_MAP_IN_GRAPH
from tests.helpers import conv_consumers, fold_checked, fold_jaxpr_checked, primitives

RNG = np.random.default_rng(7)


def vec(n, lo=None):
    v = RNG.standard_normal(n).astype(np.float32)
    return np.abs(v) + 0.5 if lo else v


def fold_check(f, *args, folds, freeze_from=None):
    """Fold with everything as inputs, and with args[freeze_from:] frozen."""
    out = [fold_jaxpr_checked(f, *args, folds=folds, in_graph="prepared")]  # no guards
    if freeze_from is not None:
        new, rep = fold_jaxpr_checked(lambda *a: f(*a, *args[freeze_from:]),
                                      *args[:freeze_from], folds=folds)
        assert {s.rescale for s in rep.folded} == {"constant"}
        out.append((new, rep))
    return out


CASES = {  # name: (kernel hw, stride, rhs dilation, groups, cin, cout)
    "1x1": (1, 1, 1, 1, 4, 6),
    "3x3": (3, 1, 1, 1, 4, 6),
    "3x3-strided": (3, 2, 1, 1, 4, 6),
    "3x3-dilated": (3, 1, 2, 1, 4, 6),
    "grouped": (3, 1, 1, 2, 4, 6),
    "depthwise": (3, 2, 1, 4, 4, 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_valid_convs(case):
    kh, stride, dil, groups, cin, cout = CASES[case]
    x = jnp.asarray(RNG.standard_normal((2, 9, 9, cin)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((kh, kh, cin // groups, cout)), jnp.float32)
    mean, std = vec(cin), vec(cin, lo=True)

    def f(x, k, mean, std):
        xn = (x - mean) / std                             # input standardization
        return lax.conv_general_dilated(xn, k, (stride, stride), "VALID",
                                        rhs_dilation=(dil, dil),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=groups)

    for new, rep in fold_check(f, x, k, mean, std, folds=1, freeze_from=1):
        site = rep.folded[0]
        assert site.pattern == "affine_conv" and site.absorbed == ["sub", "div"]
        # the conv reads x itself: nothing between the input and the conv
        conv = next(e for e in new.jaxpr.eqns if e.primitive.name == "conv_general_dilated")
        assert conv.invars[0] is new.jaxpr.invars[0]


def test_nchw_layout():
    x = jnp.asarray(RNG.standard_normal((2, 4, 7, 7)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((6, 4, 3, 3)), jnp.float32)
    s, t = vec(4), vec(4)

    def f(x, k, s, t):
        return lax.conv_general_dilated(x * s[:, None, None] + t[:, None, None], k, (1, 1),
                                        "VALID")
    fold_check(f, x, k, s, t, folds=1, freeze_from=1)


def test_dense_forward():
    x = jnp.asarray(RNG.standard_normal((5, 12)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((12, 7)), jnp.float32)
    m, v = vec(12), vec(12, lo=True)
    f = lambda x, w, m, v: ((x - m) * lax.rsqrt(v)) @ w
    for new, rep in fold_check(f, x, w, m, v, folds=1, freeze_from=1):
        assert rep.folded[0].pattern == "affine_dot"


def test_bn_before_and_after_the_same_conv():
    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((3, 3, 4, 6)), jnp.float32)
    a, b, c, d = vec(4, 1), vec(4), vec(6, 1), vec(6)

    def f(x, k, a, b, c, d):
        y = lax.conv_general_dilated(x * a + b, k, (1, 1), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y * c + d

    for new, rep in fold_check(f, x, k, a, b, c, d, folds=2, freeze_from=1):
        assert sorted(s.pattern for s in rep.folded) == ["affine_conv", "conv_affine"]
        assert conv_consumers(new) == [["add"]]


# --------------------------------------------------- a shift in front of a padded conv

PADDED = {  # name: (kernel, stride, padding, lhs dilation, rhs dilation, groups, cin, cout)
    "same": (3, 1, "SAME", 1, 1, 1, 4, 6),
    "same-strided": (3, 2, "SAME", 1, 1, 1, 4, 6),
    "stem-7x7/2": (7, 2, ((3, 3), (3, 3)), 1, 1, 1, 3, 8),
    "asymmetric": (3, 1, ((2, 0), (0, 3)), 1, 1, 1, 4, 6),
    "cropped-and-padded": (3, 1, ((-1, 2), (1, -1)), 1, 1, 1, 4, 6),
    "dilated-same": (3, 1, "SAME", 1, 2, 1, 4, 6),
    "transposed": (3, 1, ((2, 2), (1, 2)), 2, 1, 1, 4, 6),
    "depthwise-same": (3, 2, "SAME", 1, 1, 4, 4, 8),
}


def padded_conv(case):
    kh, stride, pad, ld, rd, groups, cin, cout = PADDED[case]
    k = RNG.standard_normal((kh, kh, cin // groups, cout)).astype(np.float32)

    def conv(x, k):
        return lax.conv_general_dilated(x, k, (stride, stride), pad, lhs_dilation=(ld, ld),
                                        rhs_dilation=(rd, rd), feature_group_count=groups,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = jnp.asarray(RNG.standard_normal((8, 9, 10, cin)), jnp.float32)
    return conv, x, k, cin


@pytest.mark.parametrize("case", list(PADDED))
def test_shift_before_a_padded_conv_folds_into_a_bias_map(case):
    """``conv(pad(x·s + t), K) = conv(pad(x), K ⊙ s) + conv(pad(t), K)``: the border's
    taps read the padding, not t, so the bias varies with the position."""
    conv, x, k, cin = padded_conv(case)
    mean, std = vec(cin) + 2.0, vec(cin, lo=True)    # a large shift: borders differ a lot
    f = lambda x: conv((x - mean) / std, k)
    new, rep = fold_jaxpr_checked(f, x, folds=1)
    site = rep.folded[0]
    assert site.pattern == "affine_conv" and site.absorbed == ["sub", "div"]
    assert "bias map" in site.note
    conv_eqn = next(e for e in new.jaxpr.eqns if e.primitive.name == "conv_general_dilated")
    assert conv_eqn.invars[0] is new.jaxpr.invars[0]     # the conv reads x itself
    assert conv_consumers(new) == [["add"]]
    # at the border: the folded program equals the unfolded one where a per-channel bias
    # (every tap sees t) would be wrong by far more than rounding
    ref = np.asarray(f(x), np.float64)
    out = np.asarray(jax.jit(C.jaxpr_as_fun(new))(x)[0], np.float64)
    border = np.zeros(ref.shape[1:3], bool)
    border[[0, -1], :] = border[:, [0, -1]] = True
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(out - ref)[:, border]) <= 1e-5 * scale
    per_channel = np.asarray(conv(jnp.ones((1,) + x.shape[1:]) * ((0 - mean) / std), k),
                             np.float64)[0]
    interior = per_channel[ref.shape[1] // 2, ref.shape[2] // 2]
    assert np.max(np.abs(per_channel[border] - interior)) > 1e-2 * scale, \
        "the case does not exercise the border"


def test_padded_conv_nchw_1d_and_3d():
    for dims, shape in ((("NCH", "OIH", "NCH"), (4, 4, 11)),
                        (("NCHW", "OIHW", "NCHW"), (4, 4, 7, 6)),
                        (("NDHWC", "DHWIO", "NDHWC"), (2, 5, 6, 4, 4))):
        n = len(shape) - 2
        cin = shape[1] if dims[0][1] == "C" else shape[-1]
        kshape = (6, cin) + (3,) * n if dims[1][0] == "O" else (3,) * n + (cin, 6)
        x = jnp.asarray(RNG.standard_normal(shape), jnp.float32)
        k = RNG.standard_normal(kshape).astype(np.float32)
        s, t = vec(cin, lo=True), vec(cin) + 1.0
        bshape = [1] * len(shape)
        bshape[dims[0].index("C")] = cin
        f = lambda x: lax.conv_general_dilated(x * s.reshape(bshape) + t.reshape(bshape), k,
                                               (1,) * n, "SAME", dimension_numbers=dims)
        new, rep = fold_jaxpr_checked(f, x, folds=1)
        assert conv_consumers(new) == [["add"]], dims


def test_bias_map_merges_the_bn_after_the_conv():
    """Standardization → SAME stem conv → BatchNorm: one add of ``s·B + t`` remains."""
    conv, x, k, cin = padded_conv("stem-7x7/2")
    mean, std = vec(cin), vec(cin, lo=True)
    g, b = vec(8, lo=True), vec(8)
    f = lambda x: conv((x - mean) / std, k) * g + b
    new, rep = fold_jaxpr_checked(f, x, folds=2)
    assert sorted(s.pattern for s in rep.folded) == ["affine_conv", "conv_affine"]
    assert conv_consumers(new) == [["add"]]
    assert not set(primitives(new)) & {"sub", "div", "mul"}


def test_scale_before_a_padded_conv_needs_no_map():
    """A scale alone commutes with zero padding: folded with traced parameters too, and no
    per-position bias."""
    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((3, 3, 4, 6)), jnp.float32)
    s = vec(4, lo=True)
    f = lambda x, k, s: lax.conv_general_dilated(x * s, k, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    for new, rep in fold_check(f, x, k, s, folds=1, freeze_from=1):
        assert "bias map" not in (rep.folded[0].note or "")
        assert conv_consumers(new) == [["<output>"]]


@pytest.mark.parametrize("mode", ["guarded", "prepared"])
def test_bias_map_with_a_traced_kernel_refused(mode):
    """The map is computed once, at transform time; with the kernel traced it would be a
    convolution per call, so the forward fold is refused (the decorator prepares it)."""
    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((3, 3, 4, 6)), jnp.float32)
    m = vec(4)
    f = lambda x, k, m: lax.conv_general_dilated(x - m, k, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    closed = jax.make_jaxpr(f)(x, k, m)
    new, rep = hlofold.fold_jaxpr(closed, in_graph=mode)
    assert rep.num_folded == 0 and new is closed
    site = next(s for s in rep.sites if s.pattern == "affine_conv")
    assert site.status == "refused" and site.reason == BIAS_MAP_IN_GRAPH


def test_bias_map_costlier_than_the_affine_refused():
    """The map is read on every call: at batch 1 a 3 → 64 conv's map (the output's size)
    is larger than the input pass the fold removes, so the fold is refused; at batch 32 it
    is smaller, and folds."""
    k = RNG.standard_normal((3, 3, 3, 64)).astype(np.float32)
    m = vec(3)
    f = lambda x: lax.conv_general_dilated(x - m, k, (1, 1), "SAME",
                                           dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x1 = jnp.asarray(RNG.standard_normal((1, 8, 8, 3)), jnp.float32)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x1))
    assert rep.num_folded == 0
    site = next(s for s in rep.sites if s.pattern == "affine_conv")
    assert site.status == "refused" and "costs more than the affine pass" in site.reason
    assert "4096 elements" in site.reason and "192 elements" in site.reason
    fold_jaxpr_checked(f, jnp.asarray(RNG.standard_normal((32, 8, 8, 3)), jnp.float32),
                       folds=1)


def test_bias_map_after_a_fused_elementwise_op_refused():
    """conv → ReLU → BatchNorm → SAME conv: the BN is computed in the ReLU's loop (free),
    so a bias map would only add work: refused, naming the ReLU's ``max``."""
    k1 = RNG.standard_normal((3, 3, 4, 4)).astype(np.float32)
    k2 = RNG.standard_normal((3, 3, 4, 4)).astype(np.float32)
    a, b = vec(4, lo=True), vec(4)
    conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME",  # noqa: E731
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    f = lambda x: conv(jnp.maximum(conv(x, k1), 0) * a + b, k2)
    x = jnp.asarray(RNG.standard_normal((8, 8, 8, 4)), jnp.float32)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x))
    assert rep.num_folded == 0
    site = next(s for s in rep.sites if s.pattern == "affine_conv")
    assert site.status == "refused" and "in one loop with the max" in site.reason


def test_bias_map_with_symbolic_spatial_sizes_refused():
    k = RNG.standard_normal((3, 3, 4, 6)).astype(np.float32)
    m = vec(4)
    f = lambda x: lax.conv_general_dilated(x - m, k, (1, 1), "SAME",
                                           dimension_numbers=("NHWC", "HWIO", "NHWC"))
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, h, w, 4"), jnp.float32)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(spec))
    assert rep.num_folded == 0
    site = next(s for s in rep.sites if s.pattern == "affine_conv")
    assert site.status == "refused" and "symbolic spatial size" in site.reason


def test_decorator_prepares_the_bias_map():
    """Parameters passed as arguments: the prepare step computes the map per value."""
    conv, x, k, cin = padded_conv("same-strided")
    f = lambda p, x: conv((x - p["mean"]) / p["std"], p["k"]) * p["g"] + p["b"]
    p = {"mean": vec(cin), "std": vec(cin, lo=True), "k": jnp.asarray(k),
         "g": vec(6, lo=True), "b": vec(6)}
    ff, rep, _, _ = fold_checked(f, p, x, folds=2)
    assert all(s.rescale == "prepared" for s in rep.folded)
    assert conv_consumers(ff.jaxpr(p, x)) == [["add"]]


def test_flax_batchnorm_before_a_same_conv():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=True)(x)
            return nn.Conv(6, (3, 3), padding="SAME")(x)

    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
    v = Block().init(jax.random.key(0), x)
    v = jax.tree.map(lambda a: a + jnp.asarray(np.abs(RNG.standard_normal(a.shape)) + 0.3,
                                               a.dtype), v)
    ff, rep, _, _ = fold_checked(lambda v, x: Block().apply(v, x), v, x, folds=1)
    assert rep.folded[0].pattern == "affine_conv" and "bias map" in rep.folded[0].note
    assert not set(primitives(ff.jaxpr(v, x))) & {"rsqrt", "sub", "mul"}


def test_keras_normalization_before_a_same_conv():
    import keras
    inp = keras.Input((8, 8, 3))
    norm = keras.layers.Normalization(mean=[0.485, 0.456, 0.406],
                                      variance=[0.052, 0.050, 0.051])
    model = keras.Model(inp, keras.layers.Conv2D(6, 3, padding="same")(norm(inp)))
    tv = [w.value for w in model.trainable_variables]
    ntv = [w.value for w in model.non_trainable_variables]
    x = jnp.asarray(RNG.uniform(size=(4, 8, 8, 3)), jnp.float32)
    ff, rep, _, _ = fold_checked(lambda ws, x: model.stateless_call(ws[0], ws[1], x)[0],
                                 (tv, ntv), x, folds=1)
    assert "bias map" in rep.folded[0].note


def test_bias_map_is_written_back_as_a_shift_kept_in_front():
    """A per-position bias has no parameter to live in: ``fold_params`` keeps the shift in
    front of the convolution as ``t/s`` (here ``mean``, unchanged) and puts ``1/std`` in the
    kernel; the border exact."""
    conv, x, k, cin = padded_conv("same")
    f = lambda p, x: conv((x - p["mean"]) / p["std"], p["k"])
    p = {"mean": vec(cin) + 2.0, "std": vec(cin, lo=True), "k": jnp.asarray(k)}
    out = hlofold.fold_params(f, p, x)
    assert len(out.changes) == 1 and out.changes[0].front == "['mean']"
    np.testing.assert_allclose(np.asarray(out.params["mean"]), p["mean"], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.params["std"]), 1.0)
    ref, got = np.asarray(f(p, x), np.float64), np.asarray(f(out.params, x), np.float64)
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_multi_consumer_input_refused():
    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((1, 1, 4, 6)), jnp.float32)
    m = vec(4)

    def f(x, k, m):
        xn = x - m
        return lax.conv_general_dilated(xn, k, (1, 1), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")), xn
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x, k, m))
    assert rep.num_folded == 0
    site = next(s for s in rep.sites if s.pattern == "affine_conv")
    assert site.status == "refused" and "2 consumers" in site.reason


def test_per_pixel_input_affine_not_folded():
    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((1, 1, 4, 6)), jnp.float32)
    pix = jnp.asarray(RNG.standard_normal((1, 8, 8, 1)), jnp.float32)
    f = lambda x, k, p: lax.conv_general_dilated(x * p, k, (1, 1), "VALID",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x, k, pix))
    assert rep.num_folded == 0


def test_bias_map_after_jax_nn_relu_refused():
    """``jax.nn.relu`` is a custom_jvp call that XLA inlines: the BN after it is fused all
    the same, so the map is refused naming the ``max`` inside."""
    k1 = RNG.standard_normal((3, 3, 4, 4)).astype(np.float32)
    k2 = RNG.standard_normal((3, 3, 4, 4)).astype(np.float32)
    a, b = vec(4, lo=True), vec(4)
    conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME",  # noqa: E731
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    f = lambda x: conv(jax.nn.relu(conv(x, k1)) * a + b, k2)
    x = jnp.asarray(RNG.standard_normal((8, 8, 8, 4)), jnp.float32)
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x))
    site = next(s for s in rep.sites if s.pattern == "affine_conv")
    assert rep.num_folded == 0 and "in one loop with the max" in site.reason


def test_bias_map_refusals_have_their_kind():
    from hlofold._base.reasons import reason_kind
    from hlofold._fold.core.rules import bias_map_refusal
    assert reason_kind(BIAS_MAP_IN_GRAPH) == "bias-map"
    assert reason_kind(bias_map_refusal(10, 5, None)) == "bias-map"
    assert reason_kind(bias_map_refusal(10, 50, "max")) == "bias-map"
    assert bias_map_refusal(10, 50, None) is None
