"""Modules exported for several platforms (``jax.export(..., platforms=[...])``): JAX lowers
each convolution once per platform inside a ``stablehlo.case`` on the platform index, so
before, the pass saw no convolution and folded nothing (found on an H200, where such an
export is how one artifact serves CPU and GPU). A case whose branches are the same is its
branch; one whose branches differ is left, and so is what it holds. ``params=`` takes an
export's inputs by their flat position, after the platform index and without the inputs the
module drops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold import examples
from hlofold._ir.stablehlo.artifacts import module_callable
from tests.helpers import flat_resnet

PLATFORMS = [["cpu"], ["cpu", "cuda"], ["cuda", "tpu", "cpu"]]


def _resnet():
    return flat_resnet()


def _err(ref, out) -> float:
    return float(jnp.max(jnp.abs(ref - out)))


@pytest.mark.slow
@pytest.mark.parametrize("platforms", PLATFORMS, ids="+".join)
def test_multi_platform_export_folds_as_one_platform(platforms):
    f, P, leaves, x = _resnet()
    exp = jax.export.export(jax.jit(f), platforms=platforms)(*leaves, x)
    assert (exp.mlir_module().count("stablehlo.case") > 0) == (len(platforms) > 1)
    ref = jax.jit(f)(*leaves, x)
    tol = 1e-5 * float(jnp.max(jnp.abs(ref))) + 1e-6
    want = examples.count_bn(P) + 1             # every BN, and the pool's 1/HW into the head
    # in the graph (guarded): every conv's case is gone, every BN folded
    new, rep = hlofold.fold_stablehlo(exp, in_graph=True)
    assert rep.num_folded == want, str(rep)
    assert new.mlir_module().count("stablehlo.case") <= 1   # (the index → branch map)
    assert new.platforms == exp.platforms
    assert _err(ref, new.call(*leaves, x)) <= tol
    # with the weight values: the export's own input numbering
    params = {i: np.asarray(a) for i, a in enumerate(leaves)}
    apply, rep2, prepared = hlofold.fold_stablehlo(exp, params=params)
    assert rep2.num_folded == want, str(rep2)
    assert apply.platforms == exp.platforms and len(apply.in_avals) == 1 + len(prepared)
    assert "stablehlo.case" not in apply.mlir_module()
    out = apply.call(x, *prepared)
    assert _err(ref, out) <= tol
    blob, _, prepared2 = hlofold.fold_stablehlo(exp.serialize(), params=params)
    np.testing.assert_array_equal(np.asarray(jax.export.deserialize(blob).call(x, *prepared2)),
                                  np.asarray(out))


def test_same_folds_as_the_single_platform_export():
    f, _, leaves, x = _resnet()
    one = hlofold.fold_stablehlo(jax.export.export(jax.jit(f))(*leaves, x), in_graph=True)[1]
    many = hlofold.fold_stablehlo(jax.export.export(jax.jit(f), platforms=["cpu", "cuda"])(
        *leaves, x), in_graph=True)[1]
    key = lambda r: sorted((s.status, s.pattern, s.line, s.absorbed) for s in r.sites)  # noqa: E731
    assert key(one) == key(many)


def _conv_bn(w, m, s, x):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu((y - m) * s)


def _small():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 3, 3, 4)), jnp.float32)
    m = jnp.asarray(rng.standard_normal(4), jnp.float32)
    s = jnp.asarray(rng.uniform(0.5, 1.5, 4), jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, 8, 8, 3)), jnp.float32)
    return w, m, s, x


@pytest.mark.parametrize("platforms", PLATFORMS[:2], ids="+".join)
def test_params_skip_inputs_the_module_drops(platforms):
    w, m, s, x = _small()

    def g(w, unused, m, s, x):
        return _conv_bn(w, m, s, x)
    exp = jax.export.export(jax.jit(g), platforms=platforms)(w, jnp.ones(7), m, s, x)
    assert tuple(exp.module_kept_var_idx) == (0, 2, 3, 4)
    ref = _conv_bn(w, m, s, x)
    # the unused input bound too: the apply export takes x, then the prepared weights
    apply, rep, prepared = hlofold.fold_stablehlo(
        exp, params={0: w, 1: np.ones(7, np.float32), "arg2": m, "3": s})
    assert rep.num_folded == 1 and [tuple(a.shape) for a in apply.in_avals][0] == (1, 8, 8, 3)
    assert _err(ref, apply.call(x, *prepared)) <= 1e-5
    # left unbound, it stays an input the module does not read
    apply, rep, prepared = hlofold.fold_stablehlo(exp, params={0: w, 2: m, 3: s})
    assert rep.num_folded == 1 and tuple(apply.in_avals[0].shape) == (7,)
    assert tuple(apply.module_kept_var_idx) == tuple(range(1, 2 + len(prepared)))
    assert _err(ref, apply.call(jnp.ones(7), x, *prepared)) <= 1e-5


def test_bad_params_name_the_export_input():
    w, m, s, x = _small()
    exp = jax.export.export(jax.jit(_conv_bn), platforms=["cpu", "cuda"])(w, m, s, x)
    with pytest.raises(hlofold.StableHLOError, match=r"arg0: float32\[3, 3, 3, 5\], the "
                       r"export's input is float32\[3, 3, 3, 4\]"):
        hlofold.fold_stablehlo(exp, params={0: np.ones((3, 3, 3, 5), np.float32)})
    with pytest.raises(hlofold.StableHLOError, match="arg9: the export takes 4 inputs"):
        hlofold.fold_stablehlo(exp, params={9: np.ones(3, np.float32)})


CASE = """
module {
  func.func public @main(%p: tensor<i32>, %x: tensor<1x8x8x3xf32>) -> tensor<1x8x8x4xf32> {
    %k = stablehlo.constant dense<0.5> : tensor<3x3x3x4xf32>
    %k2 = stablehlo.constant dense<KSECOND> : tensor<3x3x3x4xf32>
    %s = stablehlo.constant dense<[1.5, 2.0, 0.5, 3.0]> : tensor<4xf32>
    %y = "stablehlo.case"(%p) ({
      %c = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x8x8x3xf32>, tensor<3x3x3x4xf32>) -> tensor<1x8x8x4xf32>
      stablehlo.return %c : tensor<1x8x8x4xf32>
    }, {
      %c = stablehlo.convolution(%x, SECOND) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x8x8x3xf32>, tensor<3x3x3x4xf32>) -> tensor<1x8x8x4xf32>
      stablehlo.return %c : tensor<1x8x8x4xf32>
    }) : (tensor<i32>) -> tensor<1x8x8x4xf32>
    %sb = stablehlo.broadcast_in_dim %s, dims = [3] : (tensor<4xf32>) -> tensor<1x8x8x4xf32>
    %z = stablehlo.multiply %y, %sb : tensor<1x8x8x4xf32>
    return %z : tensor<1x8x8x4xf32>
  }
}
"""


@pytest.mark.parametrize("second,folds", [("%k", 1), ("%k2", 0)], ids=["same", "different"])
def test_case_is_inlined_only_when_its_branches_are_the_same(second, folds):
    text = CASE.replace("KSECOND", "0.25").replace("SECOND", second)
    new, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == folds, str(rep)
    assert ("stablehlo.case" in new) == (folds == 0)
    if not folds:                             # each conv says why it was not followed
        whys = [s.reason for s in rep.sites if s.status == "no-pattern"]
        assert len(whys) == 2 and all("branches differ" in w for w in whys), whys
    x = np.random.default_rng(0).standard_normal((1, 8, 8, 3)).astype(np.float32)
    for p in (0, 1, 5):                       # (an index out of range runs the last branch)
        ref = module_callable(text)(np.int32(p), x)[0]
        out = module_callable(new)(np.int32(p), x)[0]
        assert _err(ref, out) <= 1e-5 * float(jnp.max(jnp.abs(ref))), p
