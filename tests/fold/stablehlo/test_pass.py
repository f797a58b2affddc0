"""The StableHLO pass: FileCheck expectations on tests/testdata/stablehlo, numeric checks
of folded vs original modules, artifact kinds, and jax.export round trips."""
from __future__ import annotations

import glob
import io
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold import examples
from hlofold._ir.stablehlo.artifacts import input_specs, module_callable
from tests.helpers import DATA
from tests.helpers.modules import huge_module

FILES = sorted(glob.glob(os.path.join(DATA, "*.mlir")))
FILECHECK = os.path.join(os.path.dirname(sys.executable), "filecheck")

EXPECTED = {  # file: (folded, refused, reason fragment of the refusal)
    "conv_bn_inference_nchw.mlir": (1, 0, None),
    "keras_tf_args.mlir": (3, 0, None),
    "conv_bn_inference_nhwc_args.mlir": (1, 0, None),
    "bn_feature_index_not_feature.mlir": (0, 1, "not the output-feature dimension"),
    "depthwise_decomposed.mlir": (1, 0, None),
    "transposed_conv_bn.mlir": (1, 0, None),
    "conv_bias_bn.mlir": (1, 0, None),
    "multi_consumer.mlir": (0, 1, "2 consumers"),
    "resnet_block_jax.mlir": (2, 0, None),
    "chain_across_call.mlir": (1, 0, None),
    "bn_inference_after_call.mlir": (1, 0, None),
    "rmsnorm_dot_args.mlir": (1, 0, None),
    # squeeze-excite: a block's input read by the pool and by the gating multiply
    # 49 BatchNorms, and each squeeze-excitation's mean scale (÷ H·W) folded forward into
    # its first conv through the reshape in front of it (11)
    "efficientnet_b0_torch_xla.mlir": (60, 4, "2 consumers"),
    # train-time multi-branch blocks: each BN folds; the branches (weights are arguments,
    # each site guarded) stay, one refused merge per block (test_merge: with params=)
    "repvgg_a0_torch_xla.mlir": (44, 22, "module arguments"),
    "mobileone_s0_torch_xla.mlir": (191, 43, "module arguments"),
    # + the BatchNorms of its token mixers' sums, which only a merge takes (test_merge)
    "repvit_m0_9_torch_xla.mlir": (94, 90, "module arguments"),
}


def random_inputs(art, seed=0):
    rng = np.random.default_rng(seed)
    # positive values: some inputs are BN variances
    return [rng.uniform(0.5, 1.5, s.shape).astype(s.dtype) for s in input_specs(art)]


def test_every_testdata_file_has_expectations():
    assert {os.path.basename(f) for f in FILES} == set(EXPECTED)


# the networks PyTorch/XLA exported (tens of layers): the slow tier
@pytest.mark.parametrize("path", [pytest.param(f, marks=pytest.mark.slow) if "torch_xla" in f
                                  else f for f in FILES], ids=os.path.basename)
def test_filecheck_and_numerics(path):
    text = open(path).read()
    folded, report = hlofold.fold_stablehlo(text, in_graph=True)  # argument weights included
    n_fold, n_ref, why = EXPECTED[os.path.basename(path)]
    assert report.num_folded == n_fold, str(report)
    assert report.num_refused == n_ref, str(report)
    if why:
        assert any(why in (s.reason or "") for s in report.refused), str(report)
    body = folded
    if not report.num_folded:     # comes back exactly as given; FileCheck reads it printed
        assert folded == text
        from hlofold._fold.stablehlo.fold import parse_module
        body = str(parse_module(text))
    r = subprocess.run([FILECHECK, path], input=body, text=True, capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr + "\n--- folded module ---\n" + folded
    args = random_inputs(text)
    rep = hlofold.verify(text, folded, *args)
    assert rep.passed and rep.rows
    if n_fold == 0:
        assert rep.rows[0].max_abs == 0.0


def test_bytecode_in_bytecode_out():
    from hlofold._fold.stablehlo.fold import fold_module_text
    path = os.path.join(DATA, "conv_bn_inference_nhwc_args.mlir")
    text = open(path).read()
    module, _ = fold_module_text("\n".join(l for l in text.splitlines()
                                           if not l.startswith("//")))
    # an unfolded module as bytecode: parse the text again and write bytecode
    from hlofold import _compat as C
    ir = C.mlir()[0]
    with C.mlir_context():
        m = ir.Module.parse(text)
        buf = io.BytesIO()
        m.operation.write_bytecode(buf)
    data = buf.getvalue()
    folded, report = hlofold.fold_stablehlo(data, in_graph=True)
    assert isinstance(folded, bytes) and folded.startswith(b"ML\xefR")
    assert report.num_folded == 1
    args = random_inputs(text)
    assert hlofold.verify(data, folded, *args).passed


def _resnet():
    p = examples.init_resnet(10, width=8)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 32, 32, 3)), jnp.float32)
    return p, x


def test_export_round_trip_of_folded_function():
    p, x = _resnet()
    ref = jax.jit(examples.resnet_apply)(p, x)
    exp = hlofold.export(examples.resnet_apply, p, x, in_graph=True)
    back = jax.export.deserialize(exp.serialize())
    np.testing.assert_allclose(back.call(p, x), ref, rtol=2e-5, atol=1e-5 * float(
        jnp.abs(ref).max()))
    # frozen params: no BN arithmetic at all in the artifact
    frozen = hlofold.export(examples.resnet_apply, p, x, freeze=0)
    assert "rsqrt" not in frozen.mlir_module()
    np.testing.assert_allclose(jax.export.deserialize(frozen.serialize()).call(x), ref,
                               rtol=2e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_export_with_symbolic_batch():
    p, x = _resnet()
    b, = jax.export.symbolic_shape("b")
    exp = hlofold.export(examples.resnet_apply, p, jax.ShapeDtypeStruct((b, 32, 32, 3),
                                                                       jnp.float32))
    back = jax.export.deserialize(exp.serialize())
    for n in (1, 3):
        xn = jnp.tile(x[:1], (n, 1, 1, 1))
        ref = examples.resnet_apply(p, xn)
        np.testing.assert_allclose(back.call(p, xn), ref, rtol=2e-5,
                                   atol=1e-5 * float(jnp.abs(ref).max()))


def test_unfolded_export_artifact_folds():
    p, x = _resnet()
    ref = jax.jit(examples.resnet_apply)(p, x)
    data = jax.export.export(jax.jit(examples.resnet_apply))(p, x).serialize()
    folded, report = hlofold.fold_stablehlo(data, in_graph=True)
    assert report.num_folded == examples.count_bn(p) + 1  # and the pool's 1/HW, folded forward into the head (both paths)
    back = jax.export.deserialize(folded)
    out = back.call(p, x)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    assert "rsqrt" in jax.export.deserialize(data).mlir_module()
    text = back.mlir_module()
    # weights are arguments: each site guarded (folded conv | original conv + BN ops; the
    # head's bias is an argument too)
    assert text.count("stablehlo.convolution") == 2 * examples.count_bn(p)
    assert text.count("stablehlo.if") == examples.count_bn(p) + 1
    # the in-memory Exported works as well, and the input object is untouched
    exp = jax.export.deserialize(data)
    before = exp.mlir_module_serialized
    new, _ = hlofold.fold_stablehlo(exp, in_graph=True)
    assert isinstance(new, jax.export.Exported) and exp.mlir_module_serialized == before


def test_lower_matches_and_cached_module_is_untouched():
    p, x = _resnet()
    lowered = jax.jit(examples.resnet_apply).lower(p, x)
    text = lowered.as_text()
    folded, rep = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep.num_folded == examples.count_bn(p) + 1  # and the pool's 1/HW, folded forward into the head (both paths)
    assert lowered.as_text() == text           # we work on a copy, never on JAX's module
    t2 = hlofold.lower(examples.resnet_apply, p, x, freeze=0)
    assert "rsqrt" not in t2 and t2.count("stablehlo.convolution") == examples.count_bn(p)


def test_verify_reports_and_detects_a_wrong_fold():
    path = os.path.join(DATA, "conv_bn_inference_nhwc_args.mlir")
    text = open(path).read()
    folded, _ = hlofold.fold_stablehlo(text, in_graph=True)
    broken = folded.replace("stablehlo.add %", "stablehlo.subtract %", 1)
    args = random_inputs(text)
    rep = hlofold.verify(text, broken, *args, raise_on_failure=False, backends=["cpu"])
    assert not rep.passed
    with pytest.raises(hlofold.VerificationError, match="FAIL"):
        hlofold.verify(text, broken, *args, backends=["cpu"])
    ok = hlofold.verify(text, folded, *args, backends=["cpu"])
    d = ok.to_dict()
    assert d["passed"] and d["backends"] == ["cpu"] and d["rows"][0]["eps_units"] < 50
    # callables too
    f = module_callable(text)
    g = module_callable(folded)
    assert hlofold.verify(f, g, *args).passed


@pytest.mark.parametrize("bad,msg", [
    (b"", "empty"),
    (np.random.default_rng(5).bytes(64) + b"\x00", "unknown artifact"),
    (b"module { func.func @main() { \"foo.bar\"() : () -> () return } }", "unregistered dialect"),
    ("this is not mlir", "not an MLIR module"),
], ids=["empty", "random-bytes", "unknown-dialect", "not-mlir"])
def test_bad_artifacts_raise_clear_errors(bad, msg):
    with pytest.raises(hlofold.StableHLOError, match=msg):
        hlofold.fold_stablehlo(bad, in_graph=True)


def test_truncated_bytecode():
    from hlofold import _compat as C
    ir = C.mlir()[0]
    with C.mlir_context():
        m = ir.Module.parse(open(os.path.join(DATA, "multi_consumer.mlir")).read())
        buf = io.BytesIO()
        m.operation.write_bytecode(buf)
    with pytest.raises(hlofold.StableHLOError, match="truncated or corrupt"):
        hlofold.fold_stablehlo(buf.getvalue()[:60], in_graph=True)


def test_huge_module_folds_in_bounded_time():
    import time
    text = huge_module(2000)                       # 10,000 ops
    t0 = time.perf_counter()
    folded, report = hlofold.fold_stablehlo(text, in_graph=True)
    elapsed = time.perf_counter() - t0
    assert report.num_folded == 2000
    assert elapsed < 30, f"{elapsed:.1f} s for 10k ops"     # measured here: 1.6-1.9 s
    # every residual add stops its chain, with the reason named
    assert all("stablehlo.add: the chain ends where it meets another activation" in s.note
               for s in report.folded)


def test_bf16_constants_are_read_exactly_in_every_printed_form():
    """The bindings give no buffer for bf16 elements; the pass reads them from the
    attribute's printed form (decimals, a hex blob, hex bits for non-finite values), bit
    for bit, so a bf16 constant kernel folds on the host as on the jaxpr path."""
    from hlofold import _compat as C
    from hlofold._ir.stablehlo.ir import dense_to_numpy, numpy_to_dense
    ir = C.mlir()[0]
    cases = [np.arange(6, dtype=np.float32).reshape(2, 3) / 3,
             np.random.default_rng(0).standard_normal((5, 7, 9)).astype(np.float32),
             np.array([np.inf, -np.inf, np.nan, 1.5, -0.0], np.float32)]
    with C.mlir_context(), ir.Location.unknown():
        for x in cases:
            got = dense_to_numpy(numpy_to_dense(x, ir.BF16Type.get()))
            assert got is not None and got.shape == x.shape
            np.testing.assert_array_equal(got.view(np.uint16),
                                          x.astype(C.bfloat16).view(np.uint16))


def test_a_fold_erases_what_it_replaced_and_nothing_else():
    """After a fold, the ops it replaced are gone, and with them what computed only their
    operands (the BN's broadcasts and constants, the old kernel); an unused op the module
    came with, which hlofold did not write, stays (nothing the user gave is changed
    beyond the folds)."""
    from tests.helpers import unread_ops
    text = huge_module(2, constants=True).replace(
        "    %mb =", "    %unused = stablehlo.constant dense<7.0> : tensor<3xf32>\n    %mb =", 1)
    assert unread_ops(text) == 1
    folded, report = hlofold.fold_stablehlo(text)
    assert report.num_folded == 2
    assert unread_ops(folded) == 1 and "dense<7.000000e+00> : tensor<3xf32>" in folded
    for gone in ("stablehlo.subtract", "stablehlo.multiply",
                 "dense<2.500000e-01>", "dense<5.000000e-01>"):   # μ's and K's constants
        assert gone not in folded, gone
    ref, out = (module_callable(t)(*random_inputs(t)) for t in (text, folded))
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)


def test_the_collector_is_paused_during_a_fold_and_left_as_it_was():
    """fold_module pauses Python's cyclic GC (its many wrapper objects would trigger full
    collections): on again after, off if the caller had it off, and with folds in several
    threads at once, on only when the last one is done."""
    import gc
    import threading
    from hlofold._ir.stablehlo.module import gc_paused
    text = open(os.path.join(DATA, "conv_bn_inference_nhwc_args.mlir")).read()
    seen = []
    with gc_paused():
        seen.append(gc.isenabled())
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        hlofold.fold_stablehlo(text, in_graph=True)
        assert not gc.isenabled()
    finally:
        gc.enable()
    inside, release = threading.Event(), threading.Event()

    def hold():
        with gc_paused():
            inside.set()
            release.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    hlofold.fold_stablehlo(text, in_graph=True)     # ends while the other is still inside
    assert not gc.isenabled()
    release.set()
    t.join()
    assert gc.isenabled()
