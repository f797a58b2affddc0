"""Differential test: the jaxpr path and the StableHLO path fold the same programs the same way.

The generated programs of ``test_generated`` (1–6 conv layers with random layouts, chains,
wrappers and parameter modes) are built in float16, bfloat16, float32 and float64, folded
by ``fold_jaxpr`` and, lowered to StableHLO, by ``fold_stablehlo(in_graph=True)`` (the
StableHLO pass's counterpart of the jaxpr path's guarded in-graph fold). For every program:

1. the two paths decide the same for the chains after the roots (``conv_affine`` sites) and
   for the affine ops in front of them (forward folds, ``affine_conv``): the same number
   folded, and the refused ones refused for the same kind of reason;
2. both folded programs compute the unfolded program's outputs within the tolerance model of
   ``test_generated`` (float32, float64: ``bound`` scaled by the dtype's epsilon;
   bfloat16/float16: ``bf16_bound`` against a float32 run of the same numbers).

The generated affine ops in front of the first convolution (``Spec.pre``: a scalar or
per-channel add/sub/mul/div, on either side, or a per-token factor as RMSNorm's) are folded
forward on both paths.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

import hlofold  # noqa: E402
import hlofold._compat as C  # noqa: E402
from hlofold._ir.stablehlo.artifacts import module_callable  # noqa: E402
from hlofold._base.reasons import reason_kind  # noqa: E402
from tests.helpers import (assert_close, assert_nothing_left_behind,  # noqa: E402
                           lower_with_constants)
from tests.helpers.programs import LOW, bf16_bound, bound, build, err, specs  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _decisions(report, pattern_prefix):
    """Counter of (status, reason kind) over the sites of ``report`` of one pattern."""
    return collections.Counter(
        (s.status, reason_kind(s.reason) if s.status == "refused" else None)
        for s in report.sites if s.pattern.startswith(pattern_prefix))


def _tolerance(spec, ref) -> float:
    return bound(spec, ref, np.dtype(spec.dtype))


def check_both_paths(spec):
    f, args = build(spec)
    closed = jax.make_jaxpr(f)(*args)
    new, rep = hlofold.fold_jaxpr(closed)
    text = lower_with_constants(jax.jit(f, keep_unused=True), *args).as_text()
    folded_text, srep = hlofold.fold_stablehlo(text, in_graph=True)
    assert_nothing_left_behind(text, folded_text)
    for jp, sp in (("conv_affine", "stablehlo_conv"), ("affine_conv", "stablehlo_affine_conv")):
        dj, ds = _decisions(rep, jp), _decisions(srep, sp)
        assert dj == ds, f"{jp}: jaxpr {dict(dj)} vs StableHLO {dict(ds)}\n{rep}\n{srep}"
    # every refusal says which rule wrote it (set where it is written, not read from text)
    assert not [s.reason for r in (rep, srep) for s in r.sites
                if s.status == "refused" and reason_kind(s.reason) == "other"]

    ref = jax.jit(C.jaxpr_as_fun(closed))(*args)
    outs = {"jaxpr": jax.jit(C.jaxpr_as_fun(new))(*args),
            "stablehlo": module_callable(folded_text)(*args)}
    if spec.dtype in LOW:
        f32, args32 = build(spec, ref=True)
        ref32 = jax.jit(f32)(*args32)
    for path, out in outs.items():
        for k, (r, o) in enumerate(zip(ref, out)):
            if spec.dtype in LOW:
                err_u, err_f = err(ref32[k], r), err(ref32[k], o)
                b = bf16_bound(err_u, ref32[k]) * (8 if spec.dtype == "float16" else 1)
                assert err_f <= b, f"{path} output {k}: {err_f:.3g} > {b:.3g}"
            else:
                e, b = err(r, o), _tolerance(spec, r)
                assert e <= b, f"{path} output {k}: max|Δ| {e:.3g} > {b:.3g}"


@pytest.mark.slow
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          max_examples=40)
@given(specs(dtypes=DTYPES))
def test_jaxpr_and_stablehlo_paths_agree(spec):
    with jax.enable_x64(spec.dtype == "float64"):
        check_both_paths(spec)


@pytest.mark.slow
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much], max_examples=25)
@given(specs(dtypes=DTYPES).filter(lambda s: bool(s.pre)))
def test_both_paths_fold_the_affine_in_front_the_same_way(spec):
    """Only programs with affine ops in front of the first conv (a quarter of the others)."""
    with jax.enable_x64(spec.dtype == "float64"):
        check_both_paths(spec)


@pytest.mark.slow
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much], max_examples=20)
@given(specs(dtypes=DTYPES).filter(lambda s: any(op.operand in ("token", "token-vec")
                                                 for op in s.pre)))
def test_both_paths_keep_per_token_factors_the_same_way(spec):
    """Programs with an RMSNorm-like per-token factor (``rsqrt`` of the mean square over the
    channels, alone or times a per-channel γ) in front of the first conv: both paths keep
    the factor in the graph and fold what is per channel, or refuse for the same reason."""
    with jax.enable_x64(spec.dtype == "float64"):
        check_both_paths(spec)


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
@pytest.mark.parametrize("net", ["decoder-32", "resnet-101"])
def test_both_paths_decide_deep_programs_the_same_way(net):
    """Deep programs (issue 30): a 32-layer Llama-style decoder and ResNet-101 get the same
    decision per pattern on both paths (the StableHLO path used to stop folding after about
    ten layers of a decoder), and the same outputs."""
    from hlofold import examples
    if net == "decoder-32":
        f, args = examples.decoder_apply, (examples.init_decoder(32, d=16, ffn=32, vocab=32),
                                           jnp.asarray([[1, 2, 3, 4]], jnp.int32))
    else:
        f, args = examples.resnet_apply, (examples.init_resnet(101, width=4),
                                          jnp.ones((1, 16, 16, 3)))
    closed = jax.make_jaxpr(f)(*args)
    new, rep = hlofold.fold_jaxpr(closed)
    text = lower_with_constants(jax.jit(f), *args).as_text()
    folded, srep = hlofold.fold_stablehlo(text, in_graph=True)
    for pattern in ("affine_dot", "dot_affine", "conv_affine"):
        dj, ds = _decisions(rep, pattern), _decisions(srep, "stablehlo_" + pattern)
        assert dj == ds, f"{pattern}: jaxpr {dict(dj)} vs StableHLO {dict(ds)}"
    assert rep.num_folded == srep.num_folded == (161 if net == "decoder-32" else 105)
    leaves = jax.tree.leaves(args)
    ref = jax.jit(f)(*args)
    assert_close(ref, jax.jit(C.jaxpr_as_fun(new))(*leaves)[0])
    assert_close(ref, module_callable(folded)(*leaves)[0])
