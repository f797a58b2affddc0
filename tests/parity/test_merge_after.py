"""An affine after a merged sum, and a BatchNorm in front of a dense layer (issue 50, item 19),
on both paths.

* ``bn(conv3x3_bn(x) + conv1x1(x) + x)`` — a BatchNorm of a block's output, after the sum of
  its branches (Flax linen layers): the branches merge into one convolution and the outer
  BatchNorm joins it (``conv(x, K·s) + (b·s + t)``) on every entry point: ``fold``,
  ``freeze=``, ``fold_jaxpr`` with prepared weights, ``lower``/``export``, StableHLO with
  constants, ``params=`` and ``split=``. Where the sum is not the merged branches alone (a
  term that is no branch, a branch left out), the affine stays, and the outputs are right.
* PyTorch/XLA's ``BatchNorm1d → Linear`` head (``batch_norm_inference`` in front of a
  ``dot_general``, weights as arguments): folded forward into the Linear on StableHLO.
* ``x + branches(x)`` where ``x`` is a layer's output (RepViT's first block): ``x`` is the
  identity branch, on both paths.
* ``split=`` of a module whose identity branch is a ``batch_norm_inference`` (timm's
  RepVGG/MobileOne from PyTorch/XLA): the merged bias keeps that BatchNorm's shift (before,
  it was dropped: 2 % off on RepVGG-A0).
"""
from __future__ import annotations

import json
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold import _compat as C
from hlofold._ir.stablehlo.artifacts import input_specs, module_callable
from tests.helpers import DATA, assert_close
from tests.helpers.torch_weights import weight

AFTER = "sub·mul·add after the sum"


class Block(nn.Module):
    """A depthwise RepVGG-style block with a BatchNorm of its output; ``extra``: a term of
    the sum that is no branch (``sin(x)``), or a branch left out (``tanh`` of a conv)."""
    channels: int = 8
    extra: str = ""

    @nn.compact
    def __call__(self, x):
        bn = lambda: nn.BatchNorm(use_running_average=True)                 # noqa: E731
        c = self.channels
        y = bn()(nn.Conv(c, (3, 3), feature_group_count=c, use_bias=False)(x)) \
            + nn.Conv(c, (1, 1), feature_group_count=c)(x) + x
        if self.extra == "other":
            y = y + jnp.sin(x)
        elif self.extra == "nonlinear":
            y = y + jnp.tanh(bn()(nn.Conv(c, (1, 1), use_bias=False)(x)))
        return bn()(y)


def _trained(v, rng):
    """BatchNorm statistics and scales that look trained (not the identity)."""
    def f(path, a):
        name = str(path[-1])
        if "var" in name:
            return jnp.asarray(rng.uniform(0.5, 2.0, a.shape), a.dtype)
        if "mean" in name or "bias" in name:
            return jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype)
        if "scale" in name:
            return jnp.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype)
        return a
    return jax.tree_util.tree_map_with_path(f, v)


def _block(extra=""):
    m = Block(extra=extra)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 7, 7, 8)), jnp.float32)
    v = _trained(m.init(jax.random.key(0), x), np.random.default_rng(2))
    return m.apply, v, x, jax.jit(m.apply)(v, x)


def _prims(closed) -> list:
    return [e.primitive.name for e in closed.jaxpr.eqns]


def _hlo_ops(text, op: str) -> int:
    return len(re.findall(rf"stablehlo\.{op}\b", str(text)))


def test_a_batchnorm_after_a_merged_sum_joins_the_merged_conv_on_every_jaxpr_entry_point():
    apply, v, x, ref = _block()
    for f in (hlofold.fold(apply), hlofold.fold(apply, freeze=0)):
        assert_close(ref, f(v, x), depth=4)
        rep = f.report(v, x)
        (m,) = rep.merged
        assert m.absorbed[-1] == AFTER and m.absorbed[:-1] == ["3×3 conv g8", "1×1 conv g8",
                                                                "identity"], m
        assert not [s for s in rep.sites if s.status == "not-reached"], rep
        prims = _prims(f.jaxpr(v, x))
        assert prims.count("conv_general_dilated") == 1
        assert not {"mul", "sub", "rsqrt", "div"} & set(prims), prims
    closed = jax.make_jaxpr(apply)(v, x)
    for mode in ("prepared", "unguarded"):              # merged in the graph
        folded, rep = hlofold.fold_jaxpr(closed, in_graph=mode)
        (m,) = rep.merged
        assert m.absorbed[-1] == AFTER and m.rescale == "in-graph"
        assert_close(ref, C.jaxpr_as_fun(folded)(*jax.tree.leaves(v), x)[0], depth=4)
    exp = hlofold.export(hlofold.fold(apply), v, x, freeze=0)
    text = exp.mlir_module()
    assert _hlo_ops(text, "convolution") == 1 and _hlo_ops(text, "multiply") == 0
    assert_close(ref, exp.call(x), depth=4)


def test_a_batchnorm_after_a_merged_sum_joins_the_merged_conv_on_stablehlo():
    apply, v, x, ref = _block()
    exp = jax.export.export(jax.jit(lambda x: apply(v, x)))(x)
    got, rep = hlofold.fold_stablehlo(exp)                              # constants
    (m,) = rep.merged
    assert m.absorbed[-1] == AFTER and not [s for s in rep.sites if s.status == "not-reached"]
    text = got.mlir_module()
    assert _hlo_ops(text, "convolution") == 1 and _hlo_ops(text, "multiply") == 0
    assert_close(ref, got.call(x), depth=4)
    leaves, tree = jax.tree.flatten(v)
    exp = jax.export.export(jax.jit(lambda *a: apply(jax.tree.unflatten(tree, a[:-1]),
                                                     a[-1])))(*leaves, x)
    got, rep, prepared = hlofold.fold_stablehlo(                        # params=
        exp, params={i: np.asarray(a) for i, a in enumerate(leaves)})
    assert rep.merged[0].absorbed[-1] == AFTER
    assert _hlo_ops(got.mlir_module(), "multiply") == 0
    assert_close(ref, got.call(x, *prepared), depth=4)
    app, rep, prep = hlofold.fold_stablehlo(exp.mlir_module(),          # split=
                                            split=[f"arg{len(leaves)}"])
    (m,) = rep.merged
    assert m.absorbed[-1] == AFTER and m.rescale == "in-graph"
    *made, ok = module_callable(prep)(*leaves)
    assert bool(ok)
    assert _hlo_ops(app, "convolution") == 1 and _hlo_ops(app, "multiply") == 0
    assert_close(ref, module_callable(app)(x, *made)[0], depth=4)


@pytest.mark.parametrize("extra", ["other", "nonlinear"])
def test_an_affine_after_a_sum_not_merged_whole_stays_on_both_paths(extra):
    """A sum with a term that is no branch, or a branch left out of the merge: the affine
    after it applies to that term too, so it stays (and the outputs are right)."""
    apply, v, x, ref = _block(extra)
    f = hlofold.fold(apply, freeze=0)
    assert_close(ref, f(v, x), depth=4)
    rep = f.report(v, x)
    assert rep.merged and all(AFTER not in s.absorbed for s in rep.merged), rep
    assert "mul" in _prims(f.jaxpr(v, x))
    got, srep = hlofold.fold_stablehlo(jax.export.export(jax.jit(lambda x: apply(v, x)))(x))
    assert srep.merged and all(AFTER not in s.absorbed for s in srep.merged), srep
    assert_close(ref, got.call(x), depth=4)


class StemBlock(nn.Module):
    """RepViT's first token mixer (timm ``RepVggDw``): its input is the stem's conv +
    BatchNorm, so the sum's identity term ``x`` is itself a layer's output; ``then``: a
    residual ``y + bn(conv1x1(y))`` after it, whose identity is the merged block's output."""
    then: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=True)(
            nn.Conv(8, (3, 3), strides=2, use_bias=False)(x))
        y = Block()(x)
        if self.then:
            y = y + nn.BatchNorm(use_running_average=True)(
                nn.Conv(8, (1, 1), use_bias=False)(y))
        return y


@pytest.mark.parametrize("then", [False, True], ids=["block", "then-residual"])
def test_the_identity_of_a_sum_whose_input_is_a_layers_output_merges_on_both_paths(then):
    """``x + branches(x)`` with ``x = bn(conv(x'))``: ``x`` is the identity branch, not a
    branch of ``x'`` (before, on both paths, the identity and the BatchNorm after the sum
    were left — timm's RepViT kept one BatchNorm its deploy form does not have)."""
    m = StemBlock(then=then)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 14, 14, 3)), jnp.float32)
    v = _trained(m.init(jax.random.key(0), x), np.random.default_rng(2))
    ref = jax.jit(m.apply)(v, x)
    block = ["3×3 conv g8", "1×1 conv g8", "identity", AFTER]
    want = [block] + ([["identity", "1×1 conv"]] if then else [])
    for f in (hlofold.fold(m.apply), hlofold.fold(m.apply, freeze=0)):
        assert_close(ref, f(v, x), depth=6)
        rep = f.report(v, x)
        assert [s.absorbed for s in rep.merged] == want, rep
        assert not [s for s in rep.sites if s.status == "not-reached"], rep
        prims = _prims(f.jaxpr(v, x))
        assert prims.count("conv_general_dilated") == 2 + then, prims
        assert not {"mul", "sub", "rsqrt", "div"} & set(prims), prims
    got, srep = hlofold.fold_stablehlo(jax.export.export(jax.jit(lambda x: m.apply(v, x)))(x))
    assert sorted(s.absorbed for s in srep.merged) == sorted(want), srep
    assert not [s for s in srep.sites if s.status == "not-reached"], srep
    text = got.mlir_module()
    assert _hlo_ops(text, "convolution") == 2 + then and _hlo_ops(text, "multiply") == 0
    assert_close(ref, got.call(x), depth=6)


_HEAD = """module {
  func.func @main(%x: tensor<2x16xf32>, %w: tensor<4x16xf32>, %b: tensor<4xf32>,
                  %g: tensor<16xf32>, %beta: tensor<16xf32>, %mu: tensor<16xf32>,
                  %var: tensor<16xf32>) -> tensor<2x4xf32> {
    %0 = "stablehlo.batch_norm_inference"(%x, %g, %beta, %mu, %var) {epsilon = 1.0e-05 : f32,
      feature_index = 1 : i64} : (tensor<2x16xf32>, tensor<16xf32>, tensor<16xf32>,
      tensor<16xf32>, tensor<16xf32>) -> tensor<2x16xf32>
    %1 = stablehlo.transpose %w, dims = [1, 0] : (tensor<4x16xf32>) -> tensor<16x4xf32>
    %2 = stablehlo.dot_general %0, %1, contracting_dims = [1] x [0]
      : (tensor<2x16xf32>, tensor<16x4xf32>) -> tensor<2x4xf32>
    %3 = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32>
    %4 = stablehlo.add %2, %3 : tensor<2x4xf32>
    return %4 : tensor<2x4xf32>
  }
}
"""


def test_pytorch_xla_batchnorm1d_in_front_of_a_linear_folds_forward():
    """PyTorch/XLA's ``BatchNorm1d → Linear`` (its ops, weights as arguments): the BatchNorm
    folds into the Linear's kernel and bias with ``params=`` and with ``split=``."""
    names = ["input", "fc.weight", "fc.bias", "bn.weight", "bn.bias", "bn.running_mean",
             "bn.running_var"]
    specs = input_specs(_HEAD)
    w = [weight(n, s.shape) for n, s in zip(names[1:], specs[1:])]
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    ref = module_callable(_HEAD)(x, *w)[0]
    got, rep, prepared = hlofold.fold_stablehlo(_HEAD, params={i + 1: a for i, a in
                                                                enumerate(w)})
    assert rep.num_folded == 1 and rep.sites[0].absorbed == ["batch_norm_inference"], rep
    assert "batch_norm_inference" not in str(got)
    assert_close(ref, module_callable(got)(x, *prepared)[0])
    app, rep, prep = hlofold.fold_stablehlo(_HEAD, split=["arg0"])
    assert rep.num_folded == 1 and "batch_norm_inference" not in str(app)
    *made, ok = module_callable(prep)(*w)
    assert bool(ok)
    assert_close(ref, module_callable(app)(x, *made)[0])


@pytest.mark.parametrize("arch", ["repvgg_a0", pytest.param("mobileone_s0", marks=pytest.mark.slow)])
def test_split_keeps_an_identity_branchs_batch_norm_inference_shift(arch):
    text = open(os.path.join(DATA, f"{arch}_torch_xla.mlir")).read()
    names = json.load(open(os.path.join(DATA, f"{arch}_torch_xla.json")))["args"]
    io = np.load(os.path.join(DATA, f"{arch}_torch_xla_io.npz"))
    full = [io["x"] if n == "input" else weight(n, sp.shape)
            for n, sp in zip(names, input_specs(text))]
    ref = module_callable(text)(*full)[0]
    xi = names.index("input")
    app, rep, prep = hlofold.fold_stablehlo(text, split=[f"arg{xi}"])
    assert rep.merged and all(s.rescale == "in-graph" for s in rep.merged)
    *made, ok = module_callable(prep)(*[a for i, a in enumerate(full) if i != xi])
    assert bool(ok)
    assert_close(ref, module_callable(app)(io["x"], *made)[0], depth=40)
