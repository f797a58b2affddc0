"""Forward folding: a per-input-channel affine *before* a conv or Dense."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from tests.helpers import conv_consumers, fold_jaxpr_checked

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


def test_same_padding_refused():
    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((3, 3, 4, 6)), jnp.float32)
    m = vec(4)
    f = lambda x, k, m: lax.conv_general_dilated(x - m, k, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    closed = jax.make_jaxpr(f)(x, k, m)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 0 and new is closed
    site = next(s for s in rep.sites if s.pattern == "affine_conv")
    assert site.status == "refused" and "padding" in site.reason and "border" in site.reason


def test_transposed_conv_refused():
    x = jnp.asarray(RNG.standard_normal((2, 5, 5, 4)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((3, 3, 4, 6)), jnp.float32)
    m = vec(4)
    f = lambda x, k, m: lax.conv_general_dilated(x - m, k, (1, 1), [(0, 0)] * 2, lhs_dilation=(2, 2),
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x, k, m))
    assert rep.num_folded == 0
    assert "lhs dilation" in next(s for s in rep.sites if s.pattern == "affine_conv").reason


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
