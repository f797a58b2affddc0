"""Scanned layer stacks (issue 39 item 1): ``lax.scan`` over stacked parameters folds per layer.

The forms large models are written in — ``flax.linen.scan`` of a conv → BatchNorm → relu
block, a MaxText-style decoder (``nn.scan`` of RMSNorm → ``DenseGeneral`` q/k/v), a
hand-written ``lax.scan`` with a parameter shared by every layer — fold on every jaxpr entry
point: the scan body runs conv + bias with the folded kernels and biases as scanned operands of
its own (computed once for the stack, the old stacked parameters no longer read), one record
per site with the stack length, ``fold_params`` rewrites the stacked leaves. A stack whose
layers do not fold alike is left as the loop it was, with that reason.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
import hlofold._compat as C
from hlofold._base.reasons import reason_kind
from tests.helpers import (assert_close, fold_checked, fold_jaxpr_checked, primitives,
                           walk_eqns)

NORM_OPS = {"rsqrt", "sub", "div"}


class ConvBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        y = nn.Conv(16, (3, 3), use_bias=False)(x)
        y = nn.BatchNorm(use_running_average=True)(y)
        return nn.relu(y), None


class ScannedCNN(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3))(x)
        stack = nn.scan(ConvBlock, variable_axes={"params": 0, "batch_stats": 0},
                        split_rngs={"params": True}, length=self.layers)
        x, _ = stack()(x, None)
        return x.mean((1, 2))


def _perturbed(tree, seed=1):
    leaves, td = jax.tree.flatten(tree)
    rng = np.random.default_rng(seed)
    return td.unflatten([jnp.asarray(np.asarray(l) + rng.uniform(0.1, 0.5, l.shape),
                                     l.dtype) for l in leaves])


X = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 8, 3)), jnp.float32)
CNN = ScannedCNN()
CNN_VARS = _perturbed(CNN.init(jax.random.PRNGKey(0), X))


def scans(closed):
    return [e for e, _ in walk_eqns(closed) if e.primitive.name == "scan"]


def body_prims(closed) -> set:
    (scan,) = scans(closed)
    return set(primitives(scan.params["jaxpr"]))


def test_flax_scan_stack_folds_per_layer_in_the_decorator():
    f = jax.jit(CNN.apply)
    ff, rep, _, _ = fold_checked(f, CNN_VARS, X, folds=1)
    (site,) = rep.folded
    assert site.layers == 4 and site.rescale == "prepared", str(rep)
    assert "conv×4" in str(rep)
    program = ff.jaxpr(CNN_VARS, X)
    assert not body_prims(program) & NORM_OPS, body_prims(program)
    (scan,) = scans(program)
    # the body reads the carry, the folded kernel and bias only: the old stacked kernel and
    # BatchNorm leaves are no longer scanned
    assert len(scan.invars) == 3, scan
    assert [tuple(v.aval.shape) for v in scan.invars[1:]] == [(4, 3, 3, 16, 16), (4, 1, 1, 1, 16)]
    # the lowered program too: no rsqrt anywhere
    assert "rsqrt" not in ff.lower(CNN_VARS, X).as_text()
    # a new parameter value folds again (the same apply program, new prepared values)
    other = _perturbed(CNN_VARS, seed=7)
    assert_close(f(other, X), ff(other, X))
    sp = ff.split(CNN_VARS, X)            # prepare once for the stack, apply under jit
    assert any("ScanConvBlock_0" in n for n in sp.prepared_from)
    assert_close(f(other, X), jax.jit(sp.apply)(sp.prepare(other, X), other, X))


def test_flax_scan_stack_frozen_and_fold_jaxpr():
    fold_checked(jax.jit(CNN.apply), CNN_VARS, X, folds=1, freeze=0)
    new, rep = fold_jaxpr_checked(lambda x: CNN.apply(CNN_VARS, x), X, folds=1)
    assert rep.folded[0].rescale == "constant" and rep.folded[0].layers == 4
    assert not body_prims(new) & NORM_OPS
    # parameters as inputs: folded in the graph per iteration (guarded), one record
    leaves, tree = jax.tree.flatten(CNN_VARS)
    flat = lambda *a: CNN.apply(tree.unflatten(a[:-1]), a[-1])     # noqa: E731
    new, rep = fold_jaxpr_checked(flat, *leaves, X, folds=1)
    assert rep.folded[0].guarded and rep.folded[0].layers == 4


def test_fold_params_rewrites_the_stacked_leaves():
    ref = CNN.apply(CNN_VARS, X)
    wb = hlofold.fold_params(CNN.apply, CNN_VARS, X)
    (change,) = wb.changes
    assert "ScanConvBlock_0" in change.kernel and change.site.layers == 4, str(wb)
    assert change.bias.endswith("['BatchNorm_0']['bias']")
    new = wb.params
    assert new["params"]["ScanConvBlock_0"]["Conv_0"]["kernel"].shape == (4, 3, 3, 16, 16)
    np.testing.assert_array_equal(np.asarray(new["params"]["ScanConvBlock_0"]["BatchNorm_0"]["scale"]),
                                  1.0)
    np.testing.assert_array_equal(np.asarray(new["batch_stats"]["ScanConvBlock_0"]["BatchNorm_0"]["mean"]),
                                  0.0)
    assert_close(ref, CNN.apply(new, X))            # the unchanged model, the new leaves
    # the kernel is K ⊙ s per layer: the first layer's equals its own fold's
    k0 = np.asarray(CNN_VARS["params"]["ScanConvBlock_0"]["Conv_0"]["kernel"][0], np.float64)
    bn = {k: np.asarray(v[0], np.float64) for k, v in
          {**CNN_VARS["params"]["ScanConvBlock_0"]["BatchNorm_0"],
           **CNN_VARS["batch_stats"]["ScanConvBlock_0"]["BatchNorm_0"]}.items()}
    s = bn["scale"] / np.sqrt(bn["var"] + 1e-5)
    np.testing.assert_allclose(np.asarray(new["params"]["ScanConvBlock_0"]["Conv_0"]["kernel"][0]),
                               k0 * s, rtol=1e-6)


def _hand_stack(reverse=False, shared_gamma=True):
    rng = np.random.default_rng(3)
    L, C = 3, 8
    k = jnp.asarray(rng.standard_normal((L, 3, 3, C, C)) * 0.3, jnp.float32)
    mean = jnp.asarray(rng.standard_normal((L, C)), jnp.float32)
    var = jnp.asarray(rng.uniform(0.5, 2, (L, C)), jnp.float32)
    gamma = jnp.asarray(rng.uniform(0.5, 2, (C,)), jnp.float32)    # one γ for every layer

    def f(params, x):
        def body(h, p):
            kk, mu, s2 = p
            g = params["gamma"] if shared_gamma else 1.0
            y = lax.conv_general_dilated(h, kk, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jax.nn.relu((y - mu) * lax.rsqrt(s2 + 1e-5) * g), None
        return lax.scan(body, x, (params["k"], params["mean"], params["var"]),
                        reverse=reverse)[0]
    x = jnp.asarray(rng.standard_normal((2, 6, 6, C)), jnp.float32)
    return f, {"k": k, "mean": mean, "var": var, "gamma": gamma}, x


@pytest.mark.parametrize("reverse", [False, True])
def test_a_parameter_shared_by_every_layer_stays_one_operand(reverse):
    f, params, x = _hand_stack(reverse=reverse)
    ff, rep, _, _ = fold_checked(jax.jit(f), params, x, folds=1)
    assert rep.folded[0].layers == 3
    (scan,) = scans(ff.jaxpr(params, x))
    assert scan.params["reverse"] == reverse
    assert not set(primitives(scan.params["jaxpr"])) & {"rsqrt", "mul", "sub"}
    wb = hlofold.fold_params(f, params, x)
    # γ is a scan constant (read by every layer): written back only where every layer
    # agrees on one value, which a per-layer identity γ = 1 would not be — so not written
    assert_close(f(params, x), f(wb.params, x))


def test_layers_that_fold_differently_leave_the_loop_with_the_reason():
    f, params, x = _hand_stack(shared_gamma=False)
    var = np.asarray(params["var"]).copy()
    var[1, 2] = -1e-5                  # layer 1: σ² + ε = 0 in one channel: its fold is refused
    params = {**params, "var": jnp.asarray(var)}
    ff = hlofold.fold(jax.jit(f))
    rep = ff.report(params, x)
    assert rep.num_folded == 0, str(rep)
    (site,) = rep.refused
    assert reason_kind(site.reason) == "stack-layers-differ", site.reason
    assert "layer 1" in site.reason and site.layers == 3
    ref, out = jax.jit(f)(params, x), ff(params, x)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(out))


def nested_stack():
    """``(f, params, x)``: a scan over 2 outer layers of a scan over 3 inner ones."""
    rng = np.random.default_rng(5)
    params = {"k": jnp.asarray(rng.standard_normal((2, 3, 8, 8)) * 0.3, jnp.float32),
              "s": jnp.asarray(rng.uniform(0.5, 2, (2, 3, 8)), jnp.float32),
              "t": jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)}

    def f(p, x):
        def outer(h, q):
            def inner(h, r):
                kk, ss, tt = r
                return jnp.tanh(h @ kk * ss + tt), None
            return lax.scan(inner, h, q)[0], None
        return lax.scan(outer, x, (p["k"], p["s"], p["t"]))[0]
    return f, params, jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)


def fori_stack(layers: int = 4):
    """``(f, params, x)``: ``lax.fori_loop`` reading ``params["k"][i]`` (no scanned
    operand: the stacks are loop constants read at the counter the loop carries)."""
    rng = np.random.default_rng(7)
    params = {"k": jnp.asarray(rng.standard_normal((layers, 8, 8)) * 0.3, jnp.float32),
              "s": jnp.asarray(rng.uniform(0.5, 2, (layers, 8)), jnp.float32),
              "t": jnp.asarray(rng.standard_normal((layers, 8)), jnp.float32)}

    def f(p, x):
        return lax.fori_loop(0, layers, lambda i, h: jnp.tanh(h @ p["k"][i] * p["s"][i] +
                                                              p["t"][i]), x)
    return f, params, jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)


def test_nested_stacks_count_every_layer():
    f, params, x = nested_stack()
    ff, rep, _, _ = fold_checked(jax.jit(f), params, x, folds=1, fold_costly=True)
    assert rep.folded[0].layers == 6, str(rep)
    wb = hlofold.fold_params(f, params, x)
    assert_close(f(params, x), f(wb.params, x))


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        g = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


class DecoderLayer(nn.Module):
    heads: int = 4
    head_dim: int = 8

    @nn.compact
    def __call__(self, x, _):
        h = RMSNorm()(x)
        q, k, v = (nn.DenseGeneral((self.heads, self.head_dim), use_bias=False, name=n)(h)
                   for n in ("q", "k", "v"))
        a = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / 8.0, -1)
        o = jnp.einsum("bhts,bshd->bthd", a, v)
        x = x + nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, name="o")(o)
        h = RMSNorm()(x)
        return x + nn.Dense(x.shape[-1], use_bias=False)(
            jax.nn.silu(nn.Dense(64, use_bias=False, name="gate")(h)) *
            nn.Dense(64, use_bias=False, name="up")(h)), None


class ScannedDecoder(nn.Module):
    layers: int = 3

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(DecoderLayer, variable_axes={"params": 0},
                        split_rngs={"params": True}, length=self.layers)
        return stack()(x, None)[0]


def test_maxtext_style_scanned_decoder_folds_every_norm():
    m = ScannedDecoder()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 32)), jnp.float32)
    params = _perturbed(m.init(jax.random.PRNGKey(0), x))
    ff, rep, _, _ = fold_checked(jax.jit(m.apply), params, x, folds=5, fold_costly=True)
    assert {s.layers for s in rep.folded} == {3}, str(rep)
    wb = hlofold.fold_params(m.apply, params, x)
    assert len(wb.changes) == 5, str(wb)
    scales = [v for k, v in jax.tree_util.tree_flatten_with_path(wb.params)[0]
              if "scale" in jax.tree_util.keystr(k)]
    assert len(scales) == 2 and all(np.all(np.asarray(s) == 1) for s in scales)
    assert_close(m.apply(params, x), m.apply(wb.params, x))


def test_one_folded_stack_called_from_many_threads():
    """Threads calling one folded function with two parameter sets (each prepares its own
    stack, the apply program is shared) get their own set's outputs."""
    from concurrent.futures import ThreadPoolExecutor
    f = jax.jit(CNN.apply)
    ff = hlofold.fold(f)
    sets = [CNN_VARS, _perturbed(CNN_VARS, seed=11)]
    refs = [np.asarray(f(p, X)) for p in sets]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: (i % 2, np.asarray(ff(sets[i % 2], X))), range(32)))
    for k, out in outs:
        assert_close(refs[k], out)
    assert ff.report(sets[1], X).folded[0].layers == 4


def test_a_bfloat16_stack_folds_within_the_originals_error():
    """bf16 kernels and statistics: each layer's K ⊙ s is computed on the host and rounded
    once to bf16, as for an unrolled layer; against a float32 reference the folded stack
    errs no more than the bf16 original (here 0.10 vs 0.16 of an output scale of 18)."""
    f, params32, x32 = _hand_stack()
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params32)
    x = x32.astype(jnp.bfloat16)
    ff = hlofold.fold(jax.jit(f))
    (site,) = ff.report(params, x).folded
    assert site.layers == 3 and site.dtype == "bfloat16"
    ref = np.asarray(jax.jit(f)(jax.tree.map(lambda a: a.astype(jnp.float32), params),
                                x.astype(jnp.float32)))
    err_orig = np.max(np.abs(np.asarray(jax.jit(f)(params, x), np.float32) - ref))
    err_fold = np.max(np.abs(np.asarray(ff(params, x), np.float32) - ref))
    assert err_fold <= 1.5 * err_orig, (err_fold, err_orig)


def branch_stack(L: int = 3, C: int = 8):
    """A RepVGG block (3×3 conv+BN, 1×1 conv+BN, identity) as the body of a scanned stack
    of ``L`` layers: ``(f, params, x)``."""
    rng = np.random.default_rng(0)

    def bn():
        return {"m": jnp.asarray(rng.standard_normal((L, C)), jnp.float32),
                "v": jnp.asarray(rng.uniform(.5, 2, (L, C)), jnp.float32),
                "g": jnp.asarray(rng.uniform(.5, 2, (L, C)), jnp.float32),
                "b": jnp.asarray(rng.standard_normal((L, C)), jnp.float32)}
    p = {"k3": jnp.asarray(rng.standard_normal((L, 3, 3, C, C)) * .2, jnp.float32),
         "k1": jnp.asarray(rng.standard_normal((L, 1, 1, C, C)) * .2, jnp.float32),
         "bn3": bn(), "bn1": bn()}

    def norm(y, s):
        return (y - s["m"]) * lax.rsqrt(s["v"] + 1e-5) * s["g"] + s["b"]

    def f(p, x):
        def body(h, q):
            def conv(k, pad):
                return lax.conv_general_dilated(h, k, (1, 1), pad,
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jax.nn.relu(norm(conv(q["k3"], "SAME"), q["bn3"]) +
                               norm(conv(q["k1"], "VALID"), q["bn1"]) + h), None
        return lax.scan(body, x, p)[0]
    x = jnp.asarray(rng.standard_normal((2, 6, 6, C)), jnp.float32)
    return f, p, x


def test_summed_branches_in_a_stack_merge_per_layer():
    """Each layer's branches merge into one 3×3 conv, restacked; fold_params writes each
    branch's BN and says the merge is not written."""
    f, p, x = branch_stack()
    ff, rep, _, _ = fold_checked(jax.jit(f), p, x, folds=2)
    (merge,) = rep.merged
    assert merge.layers == 3 and "3 branches" in merge.note, str(rep)
    body = primitives(scans(ff.jaxpr(p, x))[0].params["jaxpr"])
    assert body.count("conv_general_dilated") == 1 and "mul" not in body, body
    wb = hlofold.fold_params(f, p, x)
    assert len(wb.changes) == 2
    (kept,) = wb.report.refused
    assert reason_kind(kept.reason) == "not-written" and "merge" in kept.reason
    assert_close(f(p, x), f(wb.params, x))


def test_the_fori_loop_form_folds_per_layer():
    """The fori_loop form: each layer folds with its counter known, the new scan takes the
    folded stacks as scanned operands."""
    L = 4
    f, params, x = fori_stack(L)
    _, rep, _, _ = fold_checked(jax.jit(f), params, x, folds=1, freeze=0, fold_costly=True)
    assert rep.folded[0].layers == L, str(rep)
    ff, rep, _, _ = fold_checked(jax.jit(f), params, x, folds=1, fold_costly=True)
    assert rep.folded[0].layers == L, str(rep)
    (scan,) = scans(ff.jaxpr(params, x))
    assert "mul" not in primitives(scan.params["jaxpr"])
    assert "dynamic_slice" not in primitives(scan.params["jaxpr"])
    wb = hlofold.fold_params(f, params, x)      # each layer's row of the stacked leaves
    assert len(wb.changes) == 1 and np.all(np.asarray(wb.params["s"]) == 1), str(wb)
    k0 = np.asarray(params["k"][2], np.float64) * np.asarray(params["s"][2], np.float64)
    np.testing.assert_allclose(np.asarray(wb.params["k"][2]), k0, rtol=1e-6)
    assert_close(f(params, x), f(wb.params, x))
    # the rows read in another order (layer l reads row L-1-l): each written to its row
    g = lambda p, x: lax.fori_loop(0, L, lambda i, h: jnp.tanh(                 # noqa: E731
        h @ p["k"][L - 1 - i] * p["s"][L - 1 - i] + p["t"][L - 1 - i]), x)
    wb = hlofold.fold_params(g, params, x)
    assert len(wb.changes) == 1 and np.all(np.asarray(wb.params["s"]) == 1), str(wb)
    np.testing.assert_allclose(np.asarray(wb.params["k"][2]), k0, rtol=1e-6)
    assert_close(g(params, x), g(wb.params, x))
    # rows read twice and others not at all (layer l reads row l % 2): said, not written
    h = lambda p, x: lax.fori_loop(0, L, lambda i, h: jnp.tanh(                 # noqa: E731
        h @ p["k"][i % 2] * p["s"][i % 2] + p["t"][i % 2]), x)
    wb = hlofold.fold_params(h, params, x)
    assert not wb.changes and "row of a stacked parameter" in str(wb), str(wb)
    assert_close(h(params, x), h(wb.params, x))
    new, rep2 = hlofold.fold_jaxpr(jax.make_jaxpr(lambda x: f(params, x))(x))
    assert rep2.num_folded == 1 and rep2.folded[0].layers == L, str(rep2)
    assert_close(f(params, x), C.jaxpr_as_fun(new)(x)[0])
