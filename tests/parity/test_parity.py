"""The same guarantees on both paths: directed cases of rules that each path once had alone.

Each test folds one program on the jaxpr path (``fold_jaxpr``) and, lowered, on the StableHLO
path (``fold_stablehlo``), and asserts the same decision (fold count, refusal reason kind)
and numerics within the stated tolerance. ``test_differential.py`` does the same for
generated programs.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
import hlofold._compat as C
from hlofold._ir.stablehlo.artifacts import module_callable
from hlofold._fold.jaxpr.emit import is_guard
from hlofold._base.reasons import reason_kind
from hlofold._fold.stablehlo.fold import fold_module, parse_module
from tests.helpers import fold_both, lower_with_constants

RNG = np.random.default_rng(7)


def conv(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def both_paths(f, *args, in_graph=True):
    """``[(path, report, outputs of the folded program)]`` and the unfolded outputs
    (``helpers.fold_both``)."""
    results, ref, _ = fold_both(f, *args, in_graph=in_graph)
    return [(p, r, o.astype(np.float64)) for p, r, o, _ in results], ref.astype(np.float64)


# ------------------------------------------------------------------ chains through shape ops


def test_chain_through_transpose_and_reshape_folds_on_both_paths():
    x = RNG.standard_normal((2, 5, 5, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    s, t = RNG.uniform(0.5, 2, 4).astype(np.float32), RNG.standard_normal(4).astype(np.float32)

    def f(x):
        y = jnp.transpose(conv(x, k), (0, 3, 1, 2))           # NCHW
        y = y.reshape(2, 4, 25) * s[None, :, None]             # merges H, W: channel kept
        return y + t[None, :, None]
    results, ref = both_paths(f, x)
    for path, rep, out in results:
        assert rep.num_folded == 1, (path, str(rep))
        assert np.max(np.abs(out - ref)) <= 1e-5 * np.max(np.abs(ref)), path


def test_reshape_merging_the_channel_axis_stops_both_paths():
    x = RNG.standard_normal((2, 5, 5, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    s = RNG.uniform(0.5, 2, 20).astype(np.float32)

    def f(x):
        return conv(x, k).reshape(2, 5, 20) * s             # W and C merged: not per-channel
    results, ref = both_paths(f, x)
    for path, rep, out in results:
        assert rep.num_folded == 0, (path, str(rep))
        site = next(s for s in rep.sites if "forward" not in s.pattern)
        assert "merges or splits the channel axis" in site.reason, (path, site.reason)
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("size, words", [
    (5, "varies along axis 1 (size 5), not only along the output-feature axis 3"),
    (4, "varies along axis 1 (size 4), not only along the output-feature axis 3 (same size "
        "as the channels: matched by axis, not size)"),
])
def test_operand_refusals_are_the_same_words_on_both_paths(size, words):
    """One operand rule (``_base.chain_rules.resolve_channel_operand``) on both adapters: the
    same refusal, in the same words."""
    x = RNG.standard_normal((2, size, size, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    s = RNG.uniform(0.5, 2, size).astype(np.float32)

    def f(x, s):
        return conv(x, k) * s.reshape(1, size, 1, 1)
    results, ref = both_paths(f, x, s)
    reasons = []
    for path, rep, out in results:
        assert rep.num_folded == 0, (path, str(rep))
        site = next(z for z in rep.sites if "forward" not in z.pattern)
        assert words in site.reason, (path, site.reason)
        reasons.append(site.reason.split(": ", 1)[-1])
        np.testing.assert_array_equal(out, ref)
    assert reasons[0] == reasons[1], reasons


# ------------------------------------------------------------------ float64


@pytest.mark.parametrize("params", ["constants", "arguments"])
def test_float64_folds_to_float64_precision_on_both_paths(params):
    with jax.enable_x64(True):
        x = RNG.standard_normal((2, 6, 6, 3))
        k = RNG.standard_normal((3, 3, 3, 5))
        g, b, m = (RNG.standard_normal(5) for _ in range(3))
        v = RNG.uniform(0.5, 2, 5)

        def bn(x, k, g, b, m, v):
            return (conv(x, k) - m) * (g / jnp.sqrt(v + 1e-5)) + b
        if params == "constants":
            f, args = (lambda x: bn(x, k, g, b, m, v)), (x,)
        else:
            f, args = bn, (x, k, g, b, m, v)
        results, ref = both_paths(f, *args)
        if params == "arguments":     # and with the weights bound on the host (params=)
            text = lower_with_constants(jax.jit(f), *args).as_text()
            apply, rep, prepared = hlofold.fold_stablehlo(
                text, params={f"arg{i}": a for i, a in enumerate(args) if i})
            results.append(("stablehlo params=", rep,
                            np.asarray(module_callable(apply)(x, *prepared)[0])))
        for path, rep, out in results:
            assert rep.num_folded == 1, (path, str(rep))
            err = np.max(np.abs(out - ref))
            assert err <= 1e-12 * np.max(np.abs(ref)), (path, err)


# ------------------------------------------------------------------ underflow


def test_float16_underflow_is_refused_on_both_paths():
    x = RNG.standard_normal((1, 4, 4, 2)).astype(np.float16)
    k = (1e-3 * RNG.standard_normal((1, 1, 2, 3))).astype(np.float16)
    s = np.array([1.0, 1e-4, 1.0], np.float16)    # K·s of channel 1 is far below f16's normal range

    def f(x):
        return conv(x, k) * s
    results, ref = both_paths(f, x)
    for path, rep, out in results:
        assert rep.num_folded == 0, (path, str(rep))
        assert [reason_kind(r.reason) for r in rep.refused] == ["underflow"], (path, str(rep))
        np.testing.assert_array_equal(out, ref)


# ------------------------------------------------------------------ nothing changes unless folded

CALL_REFUSED = """
module {
  func.func @main(%x: tensor<1x4x4x2xf32>, %k: tensor<1x1x2x3xf32>, %s: tensor<1x4x1x1xf32>) -> tensor<1x4x4x3xf32> {
    %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x4x4x2xf32>, tensor<1x1x2x3xf32>) -> tensor<1x4x4x3xf32>
    %1 = call @scale(%0, %s) : (tensor<1x4x4x3xf32>, tensor<1x4x1x1xf32>) -> tensor<1x4x4x3xf32>
    return %1 : tensor<1x4x4x3xf32>
  }
  func.func private @scale(%y: tensor<1x4x4x3xf32>, %s: tensor<1x4x1x1xf32>) -> tensor<1x4x4x3xf32> {
    %sb = stablehlo.broadcast_in_dim %s, dims = [0, 1, 2, 3] : (tensor<1x4x1x1xf32>) -> tensor<1x4x4x3xf32>
    %0 = stablehlo.multiply %y, %sb : tensor<1x4x4x3xf32>
    return %0 : tensor<1x4x4x3xf32>
  }
}
"""


def test_refused_chain_across_a_private_call_leaves_the_module_unchanged():
    module = parse_module(CALL_REFUSED)
    before = str(module)
    with module.context:
        report = fold_module(module, in_graph=True)
    assert report.num_folded == 0 and report.num_refused == 1, str(report)
    assert "not only along the output-feature axis" in report.refused[0].reason
    assert str(module) == before


def test_a_folded_chain_elsewhere_does_not_inline_the_refused_one():
    k2 = "dense<[[[[0.5, 1.0, 2.0], [1.0, 1.5, 0.5]]]]> : tensor<1x1x2x3xf32>"
    text = CALL_REFUSED.replace(
        "    return %1 : tensor<1x4x4x3xf32>\n  }\n  func.func private",
        f"    %k2 = stablehlo.constant {k2}\n"
        "    %2 = stablehlo.convolution(%x, %k2) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->"
        "[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], lhs_dilate = [1, 1],"
        " rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} :"
        " (tensor<1x4x4x2xf32>, tensor<1x1x2x3xf32>) -> tensor<1x4x4x3xf32>\n"
        "    %c = stablehlo.constant dense<[2.0, 3.0, 4.0]> : tensor<3xf32>\n"
        "    %cb = stablehlo.broadcast_in_dim %c, dims = [3] : (tensor<3xf32>) -> "
        "tensor<1x4x4x3xf32>\n"
        "    %3 = stablehlo.multiply %2, %cb : tensor<1x4x4x3xf32>\n"
        "    %4 = stablehlo.add %1, %3 : tensor<1x4x4x3xf32>\n"
        "    return %4 : tensor<1x4x4x3xf32>\n  }\n  func.func private", 1)
    text = text.replace("    return %1 : tensor<1x4x4x3xf32>\n", "", 1)
    module = parse_module(text)
    with module.context:
        report = fold_module(module, in_graph=True)
    assert report.num_folded == 1 and report.num_refused == 1, str(report)
    out = str(module)
    assert "call @scale" in out and "func.func private @scale" in out
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in
            [(1, 4, 4, 2), (1, 1, 2, 3), (1, 4, 1, 1)]]
    ref = np.asarray(module_callable(text)(*args)[0])
    np.testing.assert_allclose(np.asarray(module_callable(out)(*args)[0]), ref, rtol=1e-5,
                               atol=1e-5)


# ------------------------------------------------------------------ template cloning (jaxpr)


def _structure(closed):
    """Each equation as (primitive, params with nested jaxprs printed, inputs and outputs
    numbered by first appearance, name scope): comparable across two programs."""
    ids: dict = {}

    def atom(v):
        return repr(v.val) if isinstance(v, C.Literal) else ids.setdefault(v, len(ids))
    for v in closed.jaxpr.invars:
        atom(v)
    out = []
    for e in closed.jaxpr.eqns:
        params = tuple(sorted((k, str(v)) for k, v in e.params.items()))
        out.append((e.primitive.name, params, tuple(map(atom, e.invars)),
                    tuple(map(atom, e.outvars)), str(e.source_info.name_stack)))
    return out


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
@pytest.mark.parametrize("in_graph", ["guarded", "prepared"])
def test_cloned_templates_equal_a_trace_per_site(monkeypatch, in_graph):
    from benchmarks import models
    from hlofold._fold.jaxpr import emit as _jaxpr_emit
    model, _, variables, _ = models.build("resnet18", image_size=32, width=8)
    x = np.zeros((1, 32, 32, 3), np.float32)
    closed = jax.make_jaxpr(lambda v, x: model.apply(v, x))(variables, x)
    cloned, rep = hlofold.fold_jaxpr(closed, in_graph=in_graph)
    monkeypatch.setattr(_jaxpr_emit, "CLONE_TEMPLATES", False)
    traced, rep2 = hlofold.fold_jaxpr(closed, in_graph=in_graph)
    assert rep.num_folded == rep2.num_folded >= 20, str(rep)
    assert _structure(cloned) == _structure(traced)
    from tests.helpers import walk_eqns
    scopes = [str(e.source_info.name_stack) for e, _ in walk_eqns(cloned)
              if e.primitive.name == "conv_general_dilated"]
    assert len(set(scopes)) == len(scopes) == 20      # each clone keeps its own layer's scope
    assert all(s.count("conv") == 1 for s in scopes), scopes


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
@pytest.mark.parametrize("in_graph", ["guarded", "prepared"])
def test_spliced_activation_side_equals_the_traced_one(monkeypatch, in_graph):
    """A site's activation side (root on the rescaled kernel, shape steps, bias add, guard)
    made of its own equations computes what tracing it computes, bit for bit, with the same
    equations: a ``cond`` per guarded site whose branches hold the same primitives."""
    from benchmarks import models
    from hlofold._fold.jaxpr import emit as _jaxpr_emit
    from tests.helpers import primitives
    model, _, variables, _ = models.build("resnet18", image_size=32, width=8)
    x = RNG.standard_normal((2, 32, 32, 3)).astype(np.float32)
    closed = jax.make_jaxpr(lambda v, x: model.apply(v, x))(variables, x)
    spliced, rep = hlofold.fold_jaxpr(closed, in_graph=in_graph)
    monkeypatch.setattr(_jaxpr_emit, "SPLICE_ACTIVATIONS", False)
    traced, rep2 = hlofold.fold_jaxpr(closed, in_graph=in_graph)
    assert rep.num_folded == rep2.num_folded >= 20, str(rep)
    assert [s.guarded for s in rep.sites] == [s.guarded for s in rep2.sites]
    C.check_jaxpr(spliced.jaxpr)
    assert collections.Counter(primitives(spliced)) == collections.Counter(primitives(traced))
    guards = [e for e in spliced.jaxpr.eqns if is_guard(e)]
    assert len(guards) == (rep.num_folded if in_graph == "guarded" else 0)
    args = jax.tree.leaves((variables, x))
    np.testing.assert_array_equal(jax.jit(C.jaxpr_as_fun(spliced))(*args)[0],
                                  jax.jit(C.jaxpr_as_fun(traced))(*args)[0])


def test_operand_computed_from_an_activation_is_refused_in_the_same_words():
    """A per-channel gate computed from another conv's output (squeeze-excite style) is not
    a parameter: both paths refuse it, in the shared words of ``_base.chain_rules``."""
    from hlofold._fold.core.chain import FROM_ACTIVATION
    x = RNG.standard_normal((2, 5, 5, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    k2 = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)

    def f(x):
        return conv(x, k) * jnp.mean(conv(x, k2), axis=(0, 1, 2))
    results, ref = both_paths(f, x)
    for path, rep, out in results:
        assert rep.num_folded == 0, (path, str(rep))
        site = next(z for z in rep.sites if "forward" not in z.pattern and z.reason and
                    "operand" in z.reason)
        assert site.reason.endswith(FROM_ACTIVATION), (path, site.reason)
        np.testing.assert_array_equal(out, ref)


# ------------------------------------------------------------------ one chain walk (_chain.walk)


def _main_site(rep):
    return next(z for z in rep.sites if "forward" not in z.pattern
                and z.pattern != "unreached_affine")


def test_a_second_consumer_is_refused_in_the_same_words():
    """The walk's consumer rule, written once in ``_fold.core.chain.walk``: the conv output read twice
    is refused on both paths with the same sentence (the ops named as each IR names them)."""
    x = RNG.standard_normal((2, 5, 5, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    s = RNG.uniform(0.5, 2, 4).astype(np.float32)

    def f(x):
        y = conv(x, k)
        return y * s, jnp.tanh(y)
    closed = jax.make_jaxpr(f)(x)
    _, rep = hlofold.fold_jaxpr(closed)
    _, srep = hlofold.fold_stablehlo(lower_with_constants(jax.jit(f), x).as_text(), in_graph=True)
    for path, r in (("jaxpr", rep), ("stablehlo", srep)):
        assert r.num_folded == 0, (path, str(r))
        site = _main_site(r)
        assert site.reason.startswith("the conv output has 2 consumers ("), (path, site.reason)
        assert site.reason.endswith("); folding would change them"), (path, site.reason)
        assert reason_kind(site.reason) == "consumers"


def test_kernel_from_an_activation_and_a_canonical_bias_in_the_same_words():
    from hlofold._fold.core.chain import CANONICAL_BIAS, KERNEL_FROM_ACTIVATION
    x = RNG.standard_normal((2, 5, 5, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 3)).astype(np.float32)
    s = RNG.uniform(0.5, 2, 3).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)

    def attention_like(x):          # the second conv's kernel is the first conv's output
        y = conv(x, k)
        kk = jnp.transpose(y[0, :3, :3, :], (0, 1, 2))[:, :, :, None] * jnp.ones((1, 1, 1, 3))
        return conv(x, kk) * s

    def biased(x):
        return conv(x, k) + b
    for f, words in ((attention_like, KERNEL_FROM_ACTIVATION), (biased, CANONICAL_BIAS)):
        _, rep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x))
        _, srep = hlofold.fold_stablehlo(lower_with_constants(jax.jit(f), x).as_text(), in_graph=True)
        for path, r in (("jaxpr", rep), ("stablehlo", srep)):
            assert r.num_folded == 0, (path, str(r))
            assert any(z.reason == words for z in r.sites), (path, str(r))


def test_a_chain_that_is_returned_stops_in_the_same_words():
    x = RNG.standard_normal((2, 5, 5, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    s = RNG.uniform(0.5, 2, 4).astype(np.float32)

    def f(x):
        return conv(x, k) * s
    results, ref = both_paths(f, x)
    for path, rep, out in results:
        assert rep.num_folded == 1, (path, str(rep))
        assert _main_site(rep).note.startswith("chain stopped: value is an output of the "), \
            (path, _main_site(rep).note)
        assert np.max(np.abs(out - ref)) <= 1e-5 * np.max(np.abs(ref)), path


# ------------------------------------------------------------ one decision, in one order


def _decisions(f, *args, jaxpr_mode, in_graph):
    """The main site's (status, reason kind) on both paths (``_fold.core.decide.decide``'s order)."""
    results, _, unchanged = fold_both(f, *args, jaxpr_mode=jaxpr_mode, in_graph=in_graph,
                                      run=False)
    got = {}
    for path, r, _, _ in results:
        site = _main_site(r)
        got[path] = (site.status, reason_kind(site.reason))
        if r.num_folded == 0:
            assert unchanged[path], path
    return got


@pytest.mark.parametrize("in_graph", [False, True])
def test_a_site_failing_two_rules_is_refused_for_the_same_one(in_graph):
    """A kernel that is an argument (a policy question) and a scale that is not finite (σ² = 0
    with ε = 0): both paths apply the scale rule first, whatever the in-graph policy, so they
    refuse for the same reason. The StableHLO path once asked the policy first."""
    x = RNG.standard_normal((1, 5, 5, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    var = np.array([1, 0, 1, 1], np.float32)             # σ² = 0 with ε = 0

    def f(x, k):
        return conv(x, k) * lax.rsqrt(jnp.asarray(var)) + 1.0
    got = _decisions(f, x, k, jaxpr_mode="guarded" if in_graph else "never",
                     in_graph=in_graph)
    assert got == {"jaxpr": ("refused", "not-finite"),
                   "stablehlo": ("refused", "not-finite")}, got


def test_weights_known_only_at_run_time_are_refused_for_the_same_kind():
    """in_graph off, weights as inputs: refused on both paths as weights-not-known."""
    x = RNG.standard_normal((1, 5, 5, 3)).astype(np.float32)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
    s = RNG.uniform(0.5, 2, 4).astype(np.float32)
    got = _decisions(lambda x, k, s: conv(x, k) * s + 1.0, x, k, s, jaxpr_mode="never",
                     in_graph=False)
    assert got == {"jaxpr": ("refused", "weights-not-known"),
                   "stablehlo": ("refused", "weights-not-known")}, got


@pytest.mark.parametrize("params", ["constants", "arguments"])
def test_an_fp8_kernel_with_float32_math_is_refused_on_both_paths(params):
    """An fp8 kernel accumulating in float32: K·s rounded to fp8 would lose what the unfolded
    program keeps (rel. error 3e-2). The StableHLO path did not know the fp8 element types
    and, with the kernel an argument, folded it in the graph."""
    x = RNG.standard_normal((1, 5, 5, 3)).astype(jnp.float8_e4m3fn)
    k = RNG.standard_normal((3, 3, 3, 4)).astype(jnp.float8_e4m3fn)
    s = RNG.uniform(0.5, 2, 4).astype(np.float32)

    def conv32(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        preferred_element_type=jnp.float32)
    if params == "constants":
        f, args = (lambda x: conv32(x, jnp.asarray(k)) * s + 1.0), (x,)
    else:
        f, args = (lambda x, k: conv32(x, k) * s + 1.0), (x, k)
    got = _decisions(f, *args, jaxpr_mode="guarded", in_graph=True)
    assert got == {"jaxpr": ("refused", "precision"),
                   "stablehlo": ("refused", "precision")}, got


# ------------------------------------------------------------------ values entering a region


@pytest.mark.parametrize("wrap", ["scan", "jit"])
def test_frozen_float16_weights_inside_a_loop_or_helper_fold_now_on_both_paths(wrap):
    """Constant fp16 weights reaching a conv through a ``scan`` (a ``while`` loop's
    invariant argument) or a jitted helper's argument (a private function called once) are
    known at transform time on both paths, so both fold them as constants; the StableHLO
    pass used to see an argument and refuse (an fp16 rescale in the graph cannot be
    range-checked)."""
    x = RNG.standard_normal((1, 6, 6, 3)).astype(np.float16)
    k = (0.3 * RNG.standard_normal((1, 1, 3, 3))).astype(np.float16)
    s = RNG.uniform(0.5, 2.0, 3).astype(np.float16)
    t = RNG.standard_normal(3).astype(np.float16)

    def layer(h, k, s, t):
        return jnp.tanh(conv(h, k) * s + t)

    if wrap == "scan":
        def f(x):
            return lax.scan(lambda h, _: (layer(h, k, s, t), None), x, None, length=2)[0]
    else:
        def f(x):
            return jax.jit(layer)(x, k, s, t)
    results, ref = both_paths(f, x)
    for path, rep, out in results:
        assert [(z.status, z.rescale) for z in rep.sites] == [("folded", "constant")], \
            (path, str(rep))
        assert np.max(np.abs(out - ref)) <= 2e-2 * np.max(np.abs(ref)), path


def test_a_value_both_branches_of_a_cond_read_is_one_reader_on_both_paths():
    """A conv output read inside both branches of a ``lax.cond``: on a jaxpr the ``cond``
    equation is its one reader (the chain ends there); StableHLO's branches read it from
    above, and the pass counted each branch as a reader ("2 consumers", refused). Now a
    read inside a region is the read of the op holding it, once."""
    x = RNG.standard_normal((1, 6, 6, 3)).astype(np.float32)
    k = RNG.standard_normal((1, 1, 3, 3)).astype(np.float32)
    k2 = RNG.standard_normal((1, 1, 3, 3)).astype(np.float32)

    def f(x, p):
        y = conv(x, k)
        return lax.cond(p, lambda h: jnp.tanh(conv(h, k2)), lambda h: conv(h, k2) * 2.0, y)
    results, ref = both_paths(f, x, np.bool_(True))
    first = [[(z.status, reason_kind(z.reason) if z.status == "refused" else None)
              for z in rep.sites][0] for _, rep, _ in results]
    assert first == [("no-pattern", None)] * 2, [str(r) for _, r, _ in results]


@pytest.mark.parametrize("lhs", ["weight", "activation"])
def test_a_dot_read_with_its_lhs_as_the_weight_is_tried_for_a_weight_only(lhs):
    """``dot(W, h)`` with W an input through a transpose (Equinox's ``W @ x``) is read with
    the lhs as the weight on both paths and folds; with the lhs computed by a non-layout op
    (``tanh``) no reading is tried and both refuse with the root's own reason (the
    StableHLO pass used to raise ``TypeError`` here)."""
    w = RNG.standard_normal((4, 6)).astype(np.float32)
    h = RNG.standard_normal((4, 3, 5)).astype(np.float32)
    s = RNG.uniform(0.5, 2.0, (6, 1, 1)).astype(np.float32)

    def f(w, h, s):
        a = w.T if lhs == "weight" else jnp.tanh(w.T)
        act = jnp.tanh(jnp.tanh(h) * 2.0 + 1.0)        # computed: the activations
        return lax.dot_general(a, act, (([1], [0]), ([], []))) * s

    results, ref = both_paths(f, w, h, s)
    kinds = []
    for path, rep, out in results:
        assert np.max(np.abs(out - ref)) <= 1e-5 * np.max(np.abs(ref)), (path, str(rep))
        assert len(rep.folded) == (lhs == "weight"), (path, str(rep))
        kinds.append([(x.status, reason_kind(x.reason) if x.reason else None)
                      for x in rep.sites])
    assert kinds[0] == kinds[1], kinds


# ------------------------------------------------------------------ counts mean what they say


@pytest.mark.parametrize("meet", ["residual", "gate", "product", "input residual"])
def test_a_chain_meeting_another_activation_is_not_a_refusal(meet):
    """Issue 39 item 4: a conv whose output meets another activation with nothing folded
    before (a residual add, an SE-style gate, a product with another branch) was counted
    "refused" (an operand that is not per channel); nothing was there to fold. Now the chain
    ends there, on both paths, with the same words: no site refused, none folded, and a BN
    before such an add still folds."""
    x = RNG.standard_normal((2, 5, 5, 4)).astype(np.float32)
    k, k2 = (RNG.standard_normal((3, 3, 4, 4)).astype(np.float32) for _ in range(2))
    s = RNG.uniform(0.5, 2, 4).astype(np.float32)

    def f(x, bn):
        y = conv(x, k) * s if bn else conv(x, k)
        z = jnp.tanh(conv(jnp.tanh(x), k2))  # (another input: a nonlinear branch of x
        #                                       itself is a refused merge, issue 38)
        if meet == "residual":
            return y + z
        if meet == "gate":
            return y * jax.nn.sigmoid(jnp.mean(z, axis=(1, 2), keepdims=True))
        if meet == "product":
            return y * z
        return y + x * x               # (not x itself: conv + x would merge into one conv)
    for bn in (False, True):
        results, ref = both_paths(lambda x: f(x, bn), x)
        for path, rep, out in results:
            assert rep.num_refused == 0, (path, str(rep))
            assert rep.num_folded == int(bn), (path, str(rep))
            ends = [s for s in rep.sites if s.status == "no-pattern" and s.reason and
                    ("meets another activation" in s.reason or "a residual or a gate" in s.reason)]
            assert len(ends) == (0 if bn else 1), (path, str(rep))
            assert np.max(np.abs(out - ref)) <= 1e-5 * np.max(np.abs(ref)), path
