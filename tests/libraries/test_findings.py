"""Regressions for what trying real model zoos found (issue 13): jnp.var in the program,
float64, measure_precision's re-typing, StableHLO portable artifacts, ``stablehlo.dot``
roots, StableHLO locations, layer names in reports, and normalizations no root reaches."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.mlir.dialects import stablehlo as shlo

import hlofold
from hlofold._front.artifacts import report_stablehlo
from hlofold._ir.stablehlo.artifacts import module_callable
from tests.helpers import assert_close, lower_with_constants

RNG = np.random.default_rng(13)
DN = ("NHWC", "HWIO", "NHWC")


def arr(*shape, lo=None, dtype=np.float32):
    a = RNG.standard_normal(shape)
    return jnp.asarray(np.abs(a) + lo if lo is not None else a, dtype)


def conv(x, k, padding="SAME"):
    return lax.conv_general_dilated(x, k, (1, 1), padding, dimension_numbers=DN)


P = {"k": arr(3, 3, 4, 8), "k2": arr(1, 1, 8, 8), "s": arr(8, lo=0.5), "t": arr(8),
     "m": arr(8), "s2": arr(16, lo=0.5)}
X = arr(2, 8, 8, 4)


# ------------------------------------------------------------------ jnp.var / jnp.std


def var_net(p, x):
    y = conv(x, p["k"]) * p["s"] + p["t"]
    return y - jnp.var(y, axis=-1, keepdims=True) + jnp.std(y, axis=-1, keepdims=True)


def test_jnp_var_in_the_program_folds_with_params_as_inputs():
    """jnp.var holds a NaN-filled constant: it must not reach the finite check of the
    prepared values (which covers the folded kernels and biases only)."""
    ff = hlofold.fold(var_net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # no "not finite ... running the unfolded"
        out = ff(P, X)
        split = ff.split(P, X)
    assert_close(jax.jit(var_net)(P, X), out)
    rep = ff.report(P, X)
    assert rep.num_folded == 1 and rep.running is None, str(rep)
    prepared = split.prepare(P, X)
    assert_close(jax.jit(var_net)(P, X), jax.jit(split.apply)(prepared, P, X))


@pytest.mark.parametrize("lib", ["flax", "haiku"])
def test_layernorm_programs_run_folded_with_params_as_inputs(lib):
    """conv → BN → LayerNorm (jnp.var inside) in the libraries' own layers."""
    x = X
    if lib == "flax":
        import flax.linen as nn

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.Conv(8, (3, 3))(x)
                x = nn.BatchNorm(use_running_average=True)(x)
                return nn.LayerNorm()(nn.relu(x))
        m = Net()
        v = m.init(jax.random.key(0), x)
        v = jax.tree.map(lambda a: a + 0.3 * jnp.abs(arr(*a.shape)), v)   # non-trivial BN
        f, args = m.apply, (v, x)
    else:
        import haiku as hk

        def fwd(x, training=False):
            x = hk.Conv2D(8, 3)(x)
            x = hk.BatchNorm(True, True, 0.9)(x, is_training=training)
            return hk.LayerNorm(-1, True, True)(jax.nn.relu(x))
        t = hk.transform_with_state(fwd)
        params, state = t.init(jax.random.key(0), x, True)
        state = jax.tree.map(lambda a: a + 0.3 * jnp.abs(arr(*a.shape)), state)
        f, args = (lambda p, s, x: t.apply(p, s, None, x)[0]), (params, state, x)
    ff = hlofold.fold(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ff(*args)
    rep = ff.report(*args)
    assert rep.num_folded == 1 and rep.running is None, str(rep)
    assert_close(jax.jit(f)(*args), out)


# ------------------------------------------------------------------ float64


def head_net(p, x):
    """conv → BN → global average pooling → dense: the pooling's division folds forward."""
    y = conv(x, p["k"]) * p["s"] + p["t"]
    return jnp.mean(y, axis=(1, 2)) @ p["w"] + p["b"]


@pytest.mark.parametrize("mode", ["inputs", "frozen", "closed", "guarded", "prepared",
                                  "never"])
def test_float64_programs_fold_or_refuse_never_raise(mode):
    with jax.enable_x64(True):
        p = {**{k: v.astype(jnp.float32) for k, v in P.items()}, "w": arr(8, 5),
             "b": arr(5)}
        x = X.astype(jnp.float32)
        ref = jax.jit(head_net)(p, x)
        if mode in ("inputs", "frozen", "closed"):
            ff = (hlofold.fold(lambda x: head_net(p, x)) if mode == "closed" else
                  hlofold.fold(head_net, freeze=0 if mode == "frozen" else ()))
            args = (x,) if mode == "closed" else (p, x)
            out, rep = ff(*args), ff.report(*args)
        else:
            closed = jax.make_jaxpr(head_net)(p, x)
            new, rep = hlofold.fold_jaxpr(closed, in_graph=mode)
            out = jax.core.eval_jaxpr(new.jaxpr, new.consts, *jax.tree.leaves((p, x)))[0]
        # the pooling's division is left by hlofold.fold's cost rule with inputs (fused into
        # the reduction: no pass to remove); it folds as a constant or with fold_jaxpr
        assert rep.num_folded == (0 if mode == "never" else 1 if mode == "inputs" else 2), \
            str(rep)
        assert_close(ref, out)


# ------------------------------------------------------------------ measure_precision


def test_measure_precision_handles_pad_and_literals_in_bf16():
    """jnp.pad's padding value is an int32 literal converted to bf16; the float32 reference
    must convert it to float32 (from any dtype), not keep the int."""
    p = {k: v.astype(jnp.bfloat16) for k, v in P.items()}

    def f(p, x):
        x = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        y = conv(x, p["k"], "VALID") * p["s"] + p["t"]
        return jnp.pad(y, ((0, 0), (1, 0), (1, 0), (0, 0)), constant_values=2)
    ff = hlofold.fold(f, freeze=0)
    res = ff.measure_precision(p, X.astype(jnp.bfloat16))
    assert res["reference"] == "float32" and res["ratio"] <= 1.5, res
    assert ff.report(p, X.astype(jnp.bfloat16)).precision is res


# ------------------------------------------------------------------ StableHLO


def _one_conv_text(loc=None):
    k = np.asarray(P["k"])
    s, t = np.asarray(P["s"]), np.asarray(P["t"])
    f = jax.jit(lambda x: conv(x, k) * s + t)
    text = lower_with_constants(f, X).as_text(debug_info=True)
    return text


@pytest.mark.parametrize("target", ["1.0.0", shlo.get_current_version()])
def test_portable_artifact_in_portable_artifact_out(tmp_path, target):
    text = _one_conv_text()
    art = shlo.serialize_portable_artifact_str(text, target)
    out, rep = hlofold.fold_stablehlo(art)
    assert rep.num_folded == 1, str(rep)
    assert isinstance(out, bytes) and out.startswith(b"ML\xefR")
    assert out[5:].startswith(f"StableHLO_v{target}\0".encode())      # same target version
    back = shlo.deserialize_portable_artifact_str(out)
    assert "stablehlo.multiply" not in str(back)
    ref = module_callable(text)(X)
    assert_close(ref[0], module_callable(out)(X)[0])
    # the CLI: portable in, portable out, verified; exit 0
    src, dst = tmp_path / "in.vhlo", tmp_path / "out.vhlo"
    src.write_bytes(art)
    r = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o", str(dst),
                        "--verify"], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert dst.read_bytes()[5:].startswith(f"StableHLO_v{target}\0".encode())


def test_corrupt_portable_artifact_is_named():
    art = shlo.serialize_portable_artifact_str(_one_conv_text(), "1.0.0")
    with pytest.raises(hlofold.StableHLOError, match="portable artifact"):
        hlofold.fold_stablehlo(art[:len(art) // 2])


def _dense(a: np.ndarray) -> str:
    return "dense<" + np.array2string(a, separator=", ", threshold=10**6,
                                      floatmode="unique").replace("\n", "") + ">"


def _dot_bn_module(rank1: bool = False) -> tuple[str, np.ndarray]:
    """TensorFlow's spelling of Dense → BN: ``stablehlo.dot`` (not ``dot_general``)."""
    w, s, t = (np.asarray(arr(16, 4)), np.asarray(arr(4, lo=0.5)), np.asarray(arr(4)))
    lhs = "tensor<16xf32>" if rank1 else "tensor<2x16xf32>"
    out = "tensor<4xf32>" if rank1 else "tensor<2x4xf32>"
    dims = "[0]" if rank1 else "[1]"
    text = f"""module {{
  func.func @main(%x: {lhs}) -> {out} {{
    %w = stablehlo.constant {_dense(w)} : tensor<16x4xf32>
    %s = stablehlo.constant {_dense(s)} : tensor<4xf32>
    %t = stablehlo.constant {_dense(t)} : tensor<4xf32>
    %y = stablehlo.dot %x, %w : ({lhs}, tensor<16x4xf32>) -> {out} loc("dense_1/MatMul")
    %sb = stablehlo.broadcast_in_dim %s, dims = {dims} : (tensor<4xf32>) -> {out}
    %tb = stablehlo.broadcast_in_dim %t, dims = {dims} : (tensor<4xf32>) -> {out}
    %m = stablehlo.multiply %y, %sb : {out}
    %a = stablehlo.add %m, %tb : {out}
    return %a : {out}
  }}
}}"""
    x = np.asarray(arr(16) if rank1 else arr(2, 16))
    return text, x


@pytest.mark.parametrize("rank1", [False, True], ids=["matrix", "vector"])
def test_stablehlo_dot_roots_fold_like_dot_general(rank1):
    text, x = _dot_bn_module(rank1)
    out, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1 and rep.folded[0].primitive == "stablehlo.dot", str(rep)
    assert "stablehlo.multiply" not in out and "stablehlo.dot " in out
    assert rep.folded[0].in_channels == 16 and rep.folded[0].out_channels == 4
    assert rep.folded[0].name_stack == "dense_1/MatMul"
    assert_close(module_callable(text)(x)[0], module_callable(out)(x)[0])


def test_dot_with_a_residual_is_refused_on_both_spellings():
    text, _ = _dot_bn_module()
    bad = text.replace("%m = stablehlo.multiply %y, %sb", "%m = stablehlo.multiply %y, %y")
    out, rep = hlofold.fold_stablehlo(bad)
    assert rep.num_folded == 0 and out == bad, str(rep)


LOCS = {
    'loc("model.py":42:7)': ("model.py", 42, ""),
    'loc(fused["conv1_conv_1/convolution", "/x/tensorflow/ops.py":1221:0])':
        ("/x/tensorflow/ops.py", 1221, "conv1_conv_1/convolution"),
    'loc("jit(f)/M/stem/conv_general_dilated"("/a/model.py":12:3))':
        ("/a/model.py", 12, "jit(f)/M/stem/conv_general_dilated"),
    'loc(callsite("features.0"("torch/nn/conv.py":5:1) at "net.py":9:2))':
        ("torch/nn/conv.py", 5, "features.0"),
    "loc(unknown)": (None, None, ""),
}


@pytest.mark.parametrize("loc", list(LOCS))
def test_stablehlo_report_reads_locations_layout_and_channels(loc):
    file, line, name = LOCS[loc]
    text = _one_conv_text()
    lines = [l if "stablehlo.convolution" not in l else l.rsplit(" loc(", 1)[0] + " " + loc
             for l in text.splitlines()]
    rep = report_stablehlo("\n".join(lines))
    site = rep.folded[0]
    assert (site.file, site.line, site.name_stack) == (file, line, name), site
    assert site.layout == "NHWC,HWIO->NHWC" and (site.in_channels, site.out_channels) == (4, 8)
    printed = str(rep)
    if name:
        assert name.split("/")[-2 if name.startswith("jit") else 0] in printed
    if file:
        assert f"{os.path.basename(file)}:{line}" in printed
    assert ":None" not in printed


# ------------------------------------------------------------------ reports by layer


def test_report_names_layers_and_groups_repeated_reasons():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(12):
                x = nn.Conv(4, (3, 3), name=f"conv{i}")(x)
                x = nn.relu(x)
            return x
    m = Net()
    v = m.init(jax.random.key(0), X)
    rep = hlofold.fold(m.apply).report(v, X)
    text = str(rep)
    assert rep.num_folded == 0 and len(rep.sites) == 12, text
    assert "Net/conv0" in text and "Net/conv11" in text
    # the one reason (a bias then a ReLU: canonical) is printed once, with the count
    assert text.count("already conv + per-channel bias") == 1, text
    assert "12 sites: already conv + per-channel bias" in text
    assert max(len(l) for l in text.splitlines()) < 250


def test_nnx_sites_are_named_by_their_kernel_path():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Conv(4, 8, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.stem(x))
    g, state = nnx.split(Net(nnx.Rngs(0)))
    rep = hlofold.fold(lambda s, x: nnx.merge(g, s)(x)).report(state, X)
    assert rep.num_folded == 1 and "['stem']['kernel']" in str(rep), str(rep)


# ------------------------------------------------------------------ unreached normalizations


def preact_net(p, x):
    """A pre-activation block: BN after a residual add, BN after a concatenate."""
    a = conv(x, p["k"]) + conv(x, p["k"])
    y = jax.nn.relu((a - p["m"]) * p["s"] + p["t"])         # BN after add: unreachable
    z = jnp.concatenate([y, a], -1) * p["s2"] + 1.0          # BN after concat: unreachable
    return conv(jax.nn.relu(z[..., :8]), p["k2"]) * p["s"]   # folds


def test_normalizations_no_root_reaches_are_accounted_for():
    ff = hlofold.fold(preact_net)
    rep = ff.report(P, X)
    unreached = [s for s in rep.sites if s.status == "not-reached"]
    assert rep.num_folded == 1 and len(unreached) == 2, str(rep)
    after = sorted(s.reason.split(" ")[3] for s in unreached)
    assert after == ["add", "concatenate"], [s.reason for s in unreached]
    assert {s.out_channels for s in unreached} == {8, 16}
    assert any("p['s2']" in s.params for s in unreached)
    assert "2 normalizations no conv/dense reaches" in str(rep)
    assert_close(jax.jit(preact_net)(P, X), ff(P, X))
    # a scale that *is* on a root's chain gets no second record
    rep2 = hlofold.fold(var_net).report(P, X)
    assert not [s for s in rep2.sites if s.status == "not-reached"], str(rep2)


def test_unreached_after_a_guarded_site_on_the_stablehlo_path():
    """A site folded in the graph sits in a guard (``stablehlo.if``); what comes after it
    is still an activation: the BN after the residual add is accounted for."""
    def f(p, x):
        y = jax.nn.relu(conv(x, p["k"]) * p["s"] + p["t"])       # folds (guarded)
        a = y + conv(y, p["k2"])                                  # residual
        return (a - p["m"]) * p["s"] + p["t"]                     # BN after add
    text = lower_with_constants(jax.jit(f), P, X).as_text()
    rep = report_stablehlo(text, in_graph=True)
    assert rep.num_folded == 1 and rep.folded[0].guarded, str(rep)
    unreached = [s for s in rep.sites if s.status == "not-reached"]
    assert len(unreached) == 1 and "after add" in unreached[0].reason, str(rep)
    # the jaxpr path says the same where it folds in the graph too (guarded)
    _, jrep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(P, X))
    assert [s.reason for s in jrep.sites if s.status == "not-reached"] == \
        [unreached[0].reason], str(jrep)
    # with the weights known (hlofold.fold prepares them), ``y + conv(y, k2)`` is an
    # identity and a conv branch: merged, and the BatchNorm after the sum joins the merge
    jrep = hlofold.fold(f).report(P, X)
    assert not [s for s in jrep.sites if s.status == "not-reached"], str(jrep)
    assert jrep.merged[0].absorbed[-1] == "sub·mul·add after the sum", str(jrep)


@pytest.mark.parametrize("weights", ["constants", "arguments", "arguments, in_graph"])
def test_unreached_normalizations_on_the_stablehlo_path_too(weights):
    """The same rule on both paths: the StableHLO of preact_net gets the same records (also
    when the sites before them are folded in the graph, behind a run-time guard)."""
    if weights == "constants":
        text = lower_with_constants(jax.jit(lambda x: preact_net(P, x)), X).as_text()
    else:
        text = lower_with_constants(jax.jit(preact_net), P, X).as_text()
    rep = report_stablehlo(text, in_graph=weights.endswith("in_graph"))
    if weights.endswith("in_graph"):
        assert rep.num_folded == 1 and rep.folded[0].guarded, str(rep)
    unreached = [s for s in rep.sites if s.status == "not-reached"]
    assert len(unreached) == 2, str(rep)
    assert sorted(s.reason.split(" ")[3] for s in unreached) == ["add", "concatenate"]
    assert {s.out_channels for s in unreached} == {8, 16}
    assert "2 normalizations no conv/dense reaches" in str(rep)


def test_batch_norm_inference_after_a_residual_is_accounted_for():
    """PyTorch/XLA's spelling: ``batch_norm_inference`` after the add of two convolutions
    (a pre-activation block) gets a not-reached record; after one conv it folds."""
    t = "tensor<1x4x4x2xf32>"
    text = f"""module {{
  func.func @main(%x: {t}, %k: tensor<1x1x2x2xf32>, %s: tensor<2xf32>, %b: tensor<2xf32>,
                  %m: tensor<2xf32>, %v: tensor<2xf32>) -> {t} {{
    %c1 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {{}} {{batch_group_count = 1 : i64, feature_group_count = 1 : i64}} : ({t}, tensor<1x1x2x2xf32>) -> {t}
    %c2 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {{}} {{batch_group_count = 1 : i64, feature_group_count = 1 : i64}} : ({t}, tensor<1x1x2x2xf32>) -> {t}
    %a = stablehlo.add %c1, %c2 : {t}
    %y = "stablehlo.batch_norm_inference"(%a, %s, %b, %m, %v) {{epsilon = 1.0e-5 : f32, feature_index = 3 : i64}} : ({t}, tensor<2xf32>, tensor<2xf32>, tensor<2xf32>, tensor<2xf32>) -> {t} loc("layer1.0.bn1")
    return %y : {t}
  }}
}}"""
    rep = report_stablehlo(text, in_graph=True)
    unreached = [s for s in rep.sites if s.status == "not-reached"]
    assert len(unreached) == 1 and unreached[0].primitive == "stablehlo.batch_norm_inference"
    assert unreached[0].name_stack == "layer1.0.bn1" and unreached[0].out_channels == 2
    assert "after add" in unreached[0].reason
    # a BN right after one conv is that conv's chain: folded, no second record
    one = text.replace("%a = stablehlo.add %c1, %c2 : " + t, "%a = stablehlo.abs %c2 : " + t)
    rep = report_stablehlo(one.replace("(%a, %s", "(%c1, %s"), in_graph=True)
    assert rep.num_folded == 1 and not [s for s in rep.sites if s.status == "not-reached"]
