"""fold_jaxpr on hand-written programs: spellings, a parameter grid, refusals, nesting."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
import hlofold._compat as C
from tests.helpers import (assert_close, assert_no_scaling_after_convs, conv_consumers,
                           primitives)
from tests.helpers import fold_jaxpr_checked as fold_and_check

RNG = np.random.default_rng(0)


def bn_stats(c, dtype=np.float32):
    return dict(mean=(0.3 * RNG.standard_normal(c)).astype(dtype),
                var=np.exp(0.5 * RNG.standard_normal(c)).astype(dtype),
                gamma=(1 + 0.3 * RNG.standard_normal(c)).astype(dtype),
                beta=(0.2 * RNG.standard_normal(c)).astype(dtype))


def run(closed, *args):
    return C.jaxpr_as_fun(closed)(*args)


def conv_nhwc(x, k, **kw):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)


X = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)
K = jnp.asarray(RNG.standard_normal((3, 3, 4, 6)), jnp.float32)
S = bn_stats(6)


# --------------------------------------------------------------------------- spellings

def flax_style(x, k, m, v, g, b):
    y = conv_nhwc(x, k)
    return (y - m) * (lax.rsqrt(v + 1e-5) * g) + b


def equinox_style(x, k, m, v, g, b):
    y = conv_nhwc(x, k)
    return (y - m) / jnp.sqrt(v + 1e-5) * g + b


def keras_style(x, k, m, v, g, b):
    y = conv_nhwc(x, k)
    inv = lax.rsqrt(v + 1e-3) * g
    return y * inv + (b - m * inv)


def reshape_style(x, k, m, v, g, b):
    y = conv_nhwc(x, k)
    r = lambda a: a.reshape(1, 1, 1, -1)
    return (y - r(m)) * r(g) / jnp.sqrt(r(v) + 1e-5) + r(b)


def torch_style_neg(x, k, m, v, g, b):
    y = conv_nhwc(x, k)
    s = g / jnp.sqrt(v + 1e-5)
    return -(-y * s) + (b - m * s)


def bias_then_bn_then_scale(x, k, m, v, g, b):
    y = conv_nhwc(x, k) + m * 0.5                  # a conv bias
    y = (y - m) * (lax.rsqrt(v + 1e-5) * g) + b    # BN
    return 2.0 * y - 1.0                            # further scalar affine


def rsub_style(x, k, m, v, g, b):
    y = conv_nhwc(x, k)
    return b - (y - m) * g


@pytest.mark.parametrize("spelling", [flax_style, equinox_style, keras_style, reshape_style,
                                      torch_style_neg, bias_then_bn_then_scale, rsub_style])
@pytest.mark.parametrize("frozen", [False, True])
def test_spellings_fold(spelling, frozen):
    args = (X, K, S["mean"], S["var"], S["gamma"], S["beta"])
    if frozen:
        f = lambda x: spelling(x, *args[1:])
        new, rep = fold_and_check(f, X, folds=1)
        assert rep.sites[0].rescale == "constant"
        assert "mul" not in primitives(new), "constant fold leaves no multiply at all"
    else:
        new, rep = fold_and_check(spelling, *args, folds=1)
        assert rep.sites[0].rescale == "in-graph"
        assert rep.sites[0].params  # operands come from named inputs
    assert_no_scaling_after_convs(new)
    (users,) = conv_consumers(new)
    assert users == ["add"]


def test_chain_through_transpose_and_merging_reshape():
    def f(x, k, m, v, g, b):
        y = conv_nhwc(x, k)                          # (N, H, W, C)
        y = jnp.transpose(y, (0, 3, 1, 2))           # NCHW: channel now axis 1
        y = (y - m[:, None, None]) * lax.rsqrt(v[:, None, None] + 1e-5)
        y = y.reshape(y.shape[0], y.shape[1], -1)    # (N, C, H*W): channel kept
        return y * g[:, None] + b[:, None]
    new, rep = fold_and_check(f, X, K, *S.values(), folds=1)
    assert rep.sites[0].absorbed == ["transpose", "sub", "mul", "reshape", "mul", "add"]
    assert_no_scaling_after_convs(new)


def test_reshape_that_splits_the_channel_stops_the_chain():
    def f(x, k, g):
        y = conv_nhwc(x, k) * g                      # folds
        return y.reshape(2, 8, 8, 2, 3) * 3.0        # channel split: the chain ends
    new, rep = fold_and_check(f, X, K, S["gamma"], folds=1)
    assert rep.sites[0].absorbed == ["mul"]
    assert "splits the channel axis" in rep.sites[0].note


def test_scale_only_chain_has_no_add():
    f = lambda x, k, g: conv_nhwc(x, k) * g
    new, rep = fold_and_check(f, X, K, S["gamma"], folds=1)
    assert conv_consumers(new) == [["<output>"]]


# --------------------------------------------------------------------------- grid

def _perm_layout(rank, perm_seed):
    """A random permutation of dimension-number letters for rank 1/2/3 convs."""
    sp = "WHD"[:rank][::-1]
    lhs, rhs = list("NC" + sp), list("OI" + sp)
    r = np.random.default_rng(perm_seed)
    if perm_seed:
        r.shuffle(lhs), r.shuffle(rhs)
    out = list("NC" + sp)
    if perm_seed:
        r.shuffle(out)
    return "".join(lhs), "".join(rhs), "".join(out)


GRID = list(itertools.product(
    [1, 2, 3],                              # rank
    [0, 1, 2],                              # layout permutation seed (0 = NC.../OI...)
    [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 1, 2)],
    # (stride, rhs_dilation, lhs_dilation(transposed), groups)
    ["SAME", "VALID"],
))


@pytest.mark.parametrize("rank,perm,geo,padding", GRID)
def test_grid(rank, perm, geo, padding):
    stride, rdil, ldil, groups = geo
    lhs_l, rhs_l, out_l = _perm_layout(rank, perm)
    cin, cout, n = 4, 6, 2
    sp = [7, 6, 5][:rank]
    dims = {"N": n, "C": cin}
    dims.update(dict(zip("WHD"[:rank][::-1], sp)))
    lhs_shape = [dims[c] for c in lhs_l]
    kd = {"O": cout, "I": cin // groups}
    kd.update(dict(zip("WHD"[:rank][::-1], [3, 2, 3][:rank])))
    rhs_shape = [kd[c] for c in rhs_l]
    x = jnp.asarray(RNG.standard_normal(lhs_shape), jnp.float32)
    k = jnp.asarray(RNG.standard_normal(rhs_shape), jnp.float32)
    st = bn_stats(cout)
    pad = padding if ldil == 1 else [(1, 1)] * rank
    c_axis = out_l.index("C")

    def f(x, k, m, v, g, b):
        y = lax.conv_general_dilated(x, k, (stride,) * rank, pad, lhs_dilation=(ldil,) * rank,
                                     rhs_dilation=(rdil,) * rank,
                                     dimension_numbers=(lhs_l, rhs_l, out_l),
                                     feature_group_count=groups)
        shape = [1] * (rank + 2)
        shape[c_axis] = cout
        r = lambda a: a.reshape(shape)
        return (y - r(m)) * (lax.rsqrt(r(v) + 1e-5) * r(g)) + r(b)

    args = (x, k, st["mean"], st["var"], st["gamma"], st["beta"])
    new, rep = fold_and_check(f, *args, folds=1)
    assert_no_scaling_after_convs(new)
    # frozen parameters as well
    g = lambda x: f(x, *args[1:])
    new, rep = fold_and_check(g, x, folds=1)
    assert rep.sites[0].rescale == "constant"


def test_conv_transpose_and_batch_groups():
    x = jnp.asarray(RNG.standard_normal((2, 6, 6, 4)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((3, 3, 6, 4)), jnp.float32)  # transposed: O=4 in
    st = bn_stats(6)

    def f(x, k, m, v, g, b):
        y = lax.conv_transpose(x, k, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                               transpose_kernel=True)
        return (y - m) * (lax.rsqrt(v + 1e-5) * g) + b

    fold_and_check(f, x, k, *st.values(), folds=1)

    # batch_group_count > 1 (the shape of a weight-gradient conv)
    xb = jnp.asarray(RNG.standard_normal((4, 5, 5, 3)), jnp.float32)
    kb = jnp.asarray(RNG.standard_normal((3, 3, 3, 6)), jnp.float32)

    def h(x, k, m, v, g, b):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME", batch_group_count=2,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (y - m) * (lax.rsqrt(v + 1e-5) * g) + b

    fold_and_check(h, xb, kb, *st.values(), folds=1)


def test_preferred_element_type_bf16():
    x = X.astype(jnp.bfloat16)
    k = K.astype(jnp.bfloat16)

    def f(x, k, m, v, g, b):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                     preferred_element_type=jnp.float32)
        return (y - m) * (lax.rsqrt(v + 1e-5) * g) + b

    closed = jax.make_jaxpr(f)(x, k, *S.values())
    # a bf16 kernel accumulated in float32: rounding K·s to bf16 would cost float32 accuracy
    for frozen in (False, True):
        c = jax.make_jaxpr(lambda x: f(x, k, *S.values()))(x) if frozen else closed
        new, rep = hlofold.fold_jaxpr(c)
        assert rep.num_folded == 0 and new is c, str(rep)
        assert "the kernel is bfloat16 but the chain computes in float32" in \
            rep.refused[0].reason
    # float32_kernels=True folds it with a float32 kernel: float32 accuracy
    new, rep = hlofold.fold_jaxpr(closed, float32_kernels=True)
    assert rep.num_folded == 1
    ref = run(closed, x, k, *S.values())[0]
    out = run(new, x, k, *S.values())[0]
    assert out.dtype == ref.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(ref - out))) <= 1e-5 * float(jnp.max(jnp.abs(ref)))


# --------------------------------------------------------------------------- refusals

def test_multi_consumer_conv_output():
    def f(x, k, m, v, g, b):
        y = conv_nhwc(x, k)
        return (y - m) * (lax.rsqrt(v + 1e-5) * g) + b + y   # residual reads the conv output

    new, rep = fold_and_check(f, X, K, *S.values(), folds=0)
    (site,) = rep.sites
    assert site.status == "refused"
    assert "2 consumers" in site.reason and "conv output" in site.reason
    assert new is jax.make_jaxpr(f)(X, K, *S.values()) or primitives(new).count(
        "conv_general_dilated") == 1


def test_multi_consumer_mid_chain_folds_prefix_only():
    def f(x, k, m, v, g, b):
        y = conv_nhwc(x, k) * g        # foldable prefix
        z = y + b
        return z * v, y                # y is read twice: stop after the mul
    new, rep = fold_and_check(f, X, K, *S.values(), folds=1)
    (site,) = rep.sites
    assert site.absorbed == ["mul"]
    assert "consumers" in site.note
    assert primitives(new).count("conv_general_dilated") == 1   # never duplicated


def test_per_pixel_operand_refused():
    pix = jnp.asarray(RNG.standard_normal((1, 8, 8, 1)), jnp.float32)
    f = lambda x, k, p: conv_nhwc(x, k) * p
    new, rep = fold_and_check(f, X, K, pix, folds=0)
    (site,) = rep.sites
    assert site.status == "refused" and "varies along axis 1" in site.reason


def test_channel_axis_mismatch_with_equal_sizes_refused():
    # conv output NHWC (2, 6, 6, 6): a (6,) vector broadcast along W has the channel size.
    x = jnp.asarray(RNG.standard_normal((2, 6, 6, 4)), jnp.float32)
    v = jnp.asarray(RNG.standard_normal(6), jnp.float32) + 2

    def f(x, k, v):
        y = conv_nhwc(x, k)
        return y * lax.broadcast_in_dim(v, y.shape, (2,))
    new, rep = fold_and_check(f, x, K, v, folds=0)
    (site,) = rep.sites
    assert site.status == "refused"
    assert "axis 2" in site.reason and "output-feature axis 3" in site.reason


@pytest.mark.parametrize("bad", ["zero_var_zero_eps", "nan_gamma", "inf_scale"])
def test_non_finite_scale_refused(bad):
    st = bn_stats(6)
    eps = 1e-5
    if bad == "zero_var_zero_eps":
        st["var"][2], eps = 0.0, 0.0
    elif bad == "nan_gamma":
        st["gamma"][1] = np.nan
    else:
        st["gamma"][0] = np.inf
    f = lambda x: (conv_nhwc(x, K) - st["mean"]) * (lax.rsqrt(st["var"] + eps) * st["gamma"]) \
        + st["beta"]
    closed = jax.make_jaxpr(f)(X)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 0
    assert "not finite" in rep.sites[0].reason
    assert new is closed


def test_one_by_one_outputs_residual_and_gate_are_not_parameters():
    # batch 1 and a 1x1 spatial output: every activation is "per-channel" by shape. A
    # residual add of two conv+BN branches and a squeeze-excite style gate must not fold.
    x = jnp.asarray(RNG.standard_normal((1, 1, 1, 4)), jnp.float32)
    k1 = jnp.asarray(RNG.standard_normal((1, 1, 4, 6)), jnp.float32)
    k2 = jnp.asarray(RNG.standard_normal((1, 1, 4, 6)), jnp.float32)

    def f(x, k1, k2, m, v, g, b):
        h = (conv_nhwc(x, k1) - m) * g + b
        sc = (conv_nhwc(x, k2) - m) / v
        gate = jax.nn.sigmoid(jnp.mean(conv_nhwc(x, k2), axis=(1, 2), keepdims=True))
        return h + sc, conv_nhwc(x, k1) * gate

    new, rep = fold_and_check(f, x, k1, k2, *S.values(), folds=2)
    reasons = [s.note or s.reason for s in rep.sites]
    assert sum("computed from a convolution output" in r for r in reasons if r) == 3, reasons


def test_integer_conv_refused():
    xi = jnp.ones((1, 4, 4, 2), jnp.int32)
    ki = jnp.ones((3, 3, 2, 3), jnp.int32)
    f = lambda x, k: conv_nhwc(x, k) * 2
    new, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(xi, ki))
    assert rep.num_folded == 0 and "integer" in rep.sites[0].reason


def test_divisor_refused():
    f = lambda x, k, g: g / conv_nhwc(x, k)
    new, rep = fold_and_check(f, X, K, S["gamma"], folds=0)
    assert "divisor" in rep.sites[0].reason


def test_no_pattern_and_canonical_are_unchanged():
    f = lambda x, k: jax.nn.relu(conv_nhwc(x, k))
    closed = jax.make_jaxpr(f)(X, K)
    new, rep = hlofold.fold_jaxpr(closed)
    assert new is closed and rep.sites[0].status == "no-pattern"
    g = lambda x, k, b: jax.nn.relu(conv_nhwc(x, k) + b)
    closed = jax.make_jaxpr(g)(X, K, S["beta"])
    new, rep = hlofold.fold_jaxpr(closed)
    assert new is closed and rep.sites[0].status == "canonical"
    h = lambda x: jnp.sin(x) * 2
    closed = jax.make_jaxpr(h)(X)
    new, rep = hlofold.fold_jaxpr(closed)
    assert new is closed and rep.sites == []


# --------------------------------------------------------------------------- nesting

def _block(x, k, st):
    return jax.nn.relu((conv_nhwc(x, k) - st["mean"]) * (lax.rsqrt(st["var"] + 1e-5)
                                                          * st["gamma"]) + st["beta"])


K2 = jnp.asarray(RNG.standard_normal((3, 3, 6, 4)), jnp.float32)
S2 = bn_stats(4)


def test_nested_jit_scan_cond_while_remat():
    @jax.jit
    def inner(x, k, st):
        return _block(x, k, st)

    def f(x, k, st, k2, st2, pred):
        y = inner(x, k, st)                                      # jit

        def body(c, _):
            return _block(_block(c, k, st), k2, st2), None
        y2, _ = lax.scan(body, x, None, length=2)                # scan
        y3 = lax.cond(pred, lambda a: _block(a, k, st),           # cond branches
                      lambda a: _block(a, k, st) * 0.5, x)
        y4 = lax.while_loop(lambda c: c[0] < 2,                     # while
                            lambda c: (c[0] + 1, _block(_block(c[1], k, st), k2, st2)),
                            (0, x))[1]
        y5 = jax.checkpoint(lambda a: _block(a, k, st))(x)        # remat
        y6 = jax.custom_jvp(lambda a: _block(a, k, st))
        y6.defjvp(lambda p, t: (y6(*p), t[0]))
        return y, y2, y3, y4, y5, y6(x)

    args = (X, K, S, K2, S2, True)
    for frozen in (False, True):
        if frozen:
            g = lambda x, pred: f(x, K, S, K2, S2, pred)
            gargs = (X, True)
        else:
            g, gargs = f, args
        closed = jax.make_jaxpr(g)(*gargs)
        new, rep = hlofold.fold_jaxpr(closed)
        C.check_jaxpr(new.jaxpr)
        # jit 1 + scan 2 + cond 2 branches + while 2 + remat 1 + custom_jvp 1
        assert rep.num_folded == 9, str(rep)
        scopes = {s.scope.split("/")[-1].split("(")[0] for s in rep.folded}
        assert {"jit", "scan", "cond[0]", "cond[1]", "while", "remat2",
                "custom_jvp_call"} <= scopes, scopes
        if frozen:
            assert {s.rescale for s in rep.folded} == {"constant"}
        assert_no_scaling_after_convs(new)
        assert_close(run(closed, *jax.tree.leaves(gargs)), run(new, *jax.tree.leaves(gargs)))


def test_closed_over_params_in_inner_jit_are_constant():
    params = (K, S)
    f = jax.jit(lambda p, x: _block(x, p[0], p[1]))
    g = jax.jit(lambda x: f(params, x))
    closed = jax.make_jaxpr(g)(X)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 1 and rep.folded[0].rescale == "constant"
    assert "mul" not in primitives(new)
    assert_close(run(closed, X), run(new, X))


# --------------------------------------------------------------------------- whole nets

def test_small_resnet_folds_every_bn():
    from hlofold import examples
    p = examples.init_resnet(10, width=8)
    x = jnp.asarray(RNG.standard_normal((2, 32, 32, 3)), jnp.float32)
    closed = jax.make_jaxpr(examples.resnet_apply)(p, x)
    leaves = jax.tree.leaves((p, x))
    new, rep = hlofold.fold_jaxpr(closed)
    assert [s.pattern for s in rep.folded].count("conv_affine") == examples.count_bn(p) == 12
    assert rep.num_folded == 13           # + the mean-pool scale folded into the head Dense
    assert rep.num_refused == 0
    assert_no_scaling_after_convs(new)
    assert_close(run(closed, *leaves), run(new, *leaves))


def test_idempotent():
    args = (X, K, *S.values())
    closed = jax.make_jaxpr(flax_style)(*args)
    once, rep1 = hlofold.fold_jaxpr(closed)
    twice, rep2 = hlofold.fold_jaxpr(once)
    assert rep1.num_folded == 1 and rep2.num_folded == 0
    assert twice is once
    assert rep2.sites[0].status == "canonical"


def test_report_location_and_json():
    args = (X, K, *S.values())
    _, rep = hlofold.fold_jaxpr(jax.make_jaxpr(flax_style)(*args),
                                invar_names=["x", "k", "bn.mean", "bn.var", "bn.g", "bn.b"])
    site = rep.folded[0]
    assert site.file.endswith("test_fold.py")
    assert site.line == conv_nhwc.__code__.co_firstlineno + 1
    assert site.layout == "NHWC,HWIO->NHWC"
    assert (site.in_channels, site.out_channels) == (4, 6)
    assert site.params == ["bn.b", "bn.g", "bn.mean", "bn.var"] and site.kernel == "k"
    d = rep.to_dict()
    import json
    assert json.loads(rep.to_json())["num_folded"] == 1 == d["num_folded"]
    assert "folded" in str(rep) and "test_fold.py" in str(rep)


def test_repeated_blocks_share_one_traced_template():
    """Sites of identical structure are traced once and cloned: the clones must be valid,
    distinct equations (every variable defined once) with the right numbers."""
    from hlofold import examples
    p = examples.init_resnet(18, width=8)          # stages of 2 identical basic blocks
    x = jnp.asarray(RNG.standard_normal((2, 32, 32, 3)), jnp.float32)
    closed = jax.make_jaxpr(examples.resnet_apply)(p, x)
    leaves = jax.tree.leaves((p, x))
    new, rep = hlofold.fold_jaxpr(closed)
    C.check_jaxpr(new.jaxpr)
    defined = [o for e in new.jaxpr.eqns for o in e.outvars]
    assert len(defined) == len(set(defined))
    assert [s.pattern for s in rep.folded].count("conv_affine") == examples.count_bn(p)
    assert_no_scaling_after_convs(new)
    assert_close(run(closed, *leaves), run(new, *leaves))
