"""Scanned layer stacks on the StableHLO path (issue 39 item 1).

``lax.scan`` over stacked parameters and the ``fori_loop`` form ``params["K"][i]`` lower to a
``stablehlo.while`` whose loop-invariant operands are the stacks, read in the body through
``dynamic_slice`` at a counter. With the stacks known (constants in the module, or
``params=``), the body folds once per layer and the loop reads the folded kernels and biases
at the iteration number: the body runs conv + bias, the old stacks are gone, one record per
site with the stack length — the same decisions as the jaxpr path. A stack whose layers do not
fold alike is left as it was, with that reason.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold._base.reasons import reason_kind
from hlofold._ir.stablehlo.artifacts import module_callable
from hlofold._ir.stablehlo.ir import op_name
from hlofold._ir.stablehlo.module import parse_module
from tests.helpers import assert_close, assert_nothing_left_behind, unread_ops, lower_with_constants
from tests.fold.jaxpr.test_stacks import (CNN, CNN_VARS, X, ScannedDecoder, _hand_stack,
                                     _perturbed, branch_stack, fori_stack, nested_stack)

NORM_OPS = {"stablehlo.rsqrt", "stablehlo.subtract", "stablehlo.divide"}


def _ops(block, out):
    for op in block.operations:
        out.append(op_name(op))
        for region in op.regions:
            for b in region.blocks:
                _ops(b, out)
    return out


def loop_bodies(text) -> list[list[str]]:
    """The op names in each ``stablehlo.while`` body of ``text`` (nested ones included)."""
    m = parse_module(text)
    with m.context:
        found, todo = [], list(m.body.operations)
        while todo:
            op = todo.pop()
            if op_name(op) == "stablehlo.while":
                found.append(_ops(op.regions[1].blocks[0], []))
            todo += [inner for region in op.regions for b in region.blocks
                     for inner in b.operations]
        return found


def main_constants(text) -> list[str]:
    """The types of the constants at the top of ``@main``."""
    m = parse_module(text)
    with m.context:
        main = next(op for op in m.body.operations if op_name(op) == "func.func")
        return [str(op.results[0].type) for op in main.regions[0].blocks[0].operations
                if op_name(op) == "stablehlo.constant"]


def first(out):
    return np.asarray(jax.tree.leaves(out)[0])


def run(text, *args):
    return first(module_callable(text)(*args))


@pytest.mark.parametrize("reverse", [False, True])
def test_stacks_in_the_module_fold_per_layer(reverse):
    f, p, x = _hand_stack(reverse=reverse)
    text = lower_with_constants(jax.jit(lambda x: f(p, x)), x).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1 and not rep.refused, str(rep)
    assert rep.folded[0].layers == 3
    (body,) = loop_bodies(folded)
    assert not set(body) & NORM_OPS and body.count("stablehlo.multiply") == 0, body
    assert body.count("stablehlo.convolution") == 1 and "stablehlo.dynamic_slice" in body
    # the old stacks (kernel, mean, variance) are gone: one kernel stack, one bias stack
    consts = main_constants(folded)
    assert consts.count("tensor<3x3x3x8x8xf32>") == 1 and consts.count("tensor<3x8xf32>") == 1
    assert_nothing_left_behind(text, folded)
    assert_close(f(p, x), run(folded, x))


def test_params_bound_stacks_fold_per_layer_and_the_loop_reads_the_prepared_stacks():
    f, p, x = _hand_stack()
    exp = jax.export.export(jax.jit(f))(p, x)
    leaves = jax.tree.leaves(p)
    new, rep, prepared = hlofold.fold_stablehlo(
        exp, params={f"arg{i}": np.asarray(l) for i, l in enumerate(leaves)})
    assert rep.num_folded == 1 and rep.folded[0].layers == 3, str(rep)
    # one stacked kernel and one stacked bias: the shared γ is in the folded kernels
    assert sorted(q.shape for q in prepared) == [(3, 3, 3, 8, 8), (3, 8)]
    assert_close(exp.call(p, x), new.call(x, *prepared))


def test_flax_scan_stack_folds_alike_on_both_paths():
    text = lower_with_constants(jax.jit(lambda x: CNN.apply(CNN_VARS, x)), X).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    jrep = hlofold.fold(jax.jit(CNN.apply)).report(CNN_VARS, X)
    assert sorted((s.status, s.layers or 1) for s in rep.sites) == \
        sorted((s.status, s.layers or 1) for s in jrep.sites), (str(rep), str(jrep))
    assert [s.layers for s in rep.folded] == [4]
    (body,) = loop_bodies(folded)
    assert not set(body) & NORM_OPS
    assert_close(CNN.apply(CNN_VARS, X), run(folded, X))


def test_maxtext_style_scanned_decoder_folds_every_norm_on_both_paths():
    m = ScannedDecoder()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 32)), jnp.float32)
    params = _perturbed(m.init(jax.random.PRNGKey(0), x))
    exp = jax.export.export(jax.jit(m.apply))(params, x)
    leaves = jax.tree.leaves(params)
    new, rep, prepared = hlofold.fold_stablehlo(
        exp, params={f"arg{i}": np.asarray(l) for i, l in enumerate(leaves)})
    jrep = hlofold.fold(jax.jit(m.apply), fold_costly=True).report(params, x)
    assert rep.num_folded == jrep.num_folded == 5, (str(rep), str(jrep))
    assert {s.layers for s in rep.folded} == {3}
    assert sorted(s.status for s in rep.sites) == sorted(s.status for s in jrep.sites)
    (body,) = loop_bodies(new.mlir_module())
    assert "stablehlo.rsqrt" in body            # the per-token factor stays, γ is folded
    assert_close(exp.call(params, x), new.call(x, *prepared))


@pytest.mark.parametrize("unroll", [2, 4])
def test_an_unrolled_scans_later_layers_fold_their_norms_too(unroll):
    """A decoder scanned with ``unroll`` (4 layers: ``unroll`` a loop iteration, each reading
    its rows of one block of the stacks): every layer's norms fold as the first's — the
    stacks bound are known weights, which link no layer to the next (the later layers'
    activations are computed from the first's γ rows, read from the same stacks: not an
    activation's statistic) — as many folds as the loop unrolled by 1, and the same
    outputs."""
    from jax import lax
    rng = np.random.default_rng(3)
    d, n = 16, 4
    p = {"g": jnp.asarray(rng.uniform(0.5, 2, (n, d)), jnp.float32),
         "w": jnp.asarray(rng.standard_normal((n, d, d)) / 4, jnp.float32),
         "g2": jnp.asarray(rng.uniform(0.5, 2, (n, d)), jnp.float32),
         "up": jnp.asarray(rng.standard_normal((n, d, 2 * d)) / 4, jnp.float32)}

    def norm(x, g):
        return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    def layer(x, lp):
        x = x + norm(x, lp["g"]) @ lp["w"]
        return x + (jax.nn.relu(norm(x, lp["g2"]) @ lp["up"]))[..., :d], None
    x = jnp.asarray(rng.standard_normal((2, 5, d)), jnp.float32)
    counts = []
    for u in (1, unroll):
        f = jax.jit(lambda p, x, u=u: lax.scan(layer, x, p, unroll=u)[0])
        exp = jax.export.export(f)(p, x)
        new, rep, prepared = hlofold.fold_stablehlo(exp, params=_bound(p))
        counts.append(sum(s.layers or 1 for s in rep.folded))
        assert_close(f(p, x), new.call(x, *prepared))
        for body in loop_bodies(new.mlir_module()):
            assert body.count("stablehlo.multiply") == 4 * min(u, n), (u, body)  # x·r, x·x
    assert counts == [2 * n, 2 * n], counts


def test_the_fori_loop_form_folds_per_layer():
    f, p, x = fori_stack(4)
    text = lower_with_constants(jax.jit(lambda x: f(p, x)), x).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1 and rep.folded[0].layers == 4, str(rep)
    (body,) = loop_bodies(folded)
    assert body.count("stablehlo.multiply") == 0, body
    assert_close(f(p, x), run(folded, x))


def test_nested_stacks_count_every_layer():
    f, p, x = nested_stack()
    text = lower_with_constants(jax.jit(lambda x: f(p, x)), x).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1 and rep.folded[0].layers == 6, str(rep)
    assert_close(f(p, x), run(folded, x))


def test_layers_that_fold_differently_leave_the_loop_with_the_reason():
    f, params, x = _hand_stack(shared_gamma=False)
    var = np.asarray(params["var"]).copy()
    var[1, 2] = -1e-5                  # layer 1: σ² + ε = 0 in one channel: its fold is refused
    params = {**params, "var": jnp.asarray(var)}
    text = lower_with_constants(jax.jit(lambda x: f(params, x)), x).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 0, str(rep)
    (site,) = rep.refused
    assert reason_kind(site.reason) == "stack-layers-differ", site.reason
    assert "layer 1" in site.reason and site.layers == 3
    assert str(parse_module(folded)) == str(parse_module(text))
    # in the graph, the usual rule: folded per iteration behind its guard
    folded, rep = hlofold.fold_stablehlo(text, in_graph=True)
    assert rep.num_folded == 1 and rep.folded[0].guarded, str(rep)
    out = run(folded, x)
    assert np.array_equal(np.isnan(out), np.isnan(np.asarray(f(params, x))))


def test_stacks_as_arguments_say_how_to_fold_them():
    """Without the weight values the loop's sites stay, and the reason names what folds
    them per layer (params=) — not the jaxpr path."""
    f, p, x = _hand_stack()
    text = lower_with_constants(jax.jit(f), p, x).as_text()
    _, rep = hlofold.fold_stablehlo(text)
    (site,) = rep.refused
    assert "stablehlo.while" in site.reason and "params=" in site.reason
    assert "module arguments" not in site.reason.split("stablehlo.while")[0]


def test_split_prepares_the_stacks_once_and_apply_reads_them():
    """``split=``: prepare runs one loop over the layers that fills the folded kernel and
    bias stacks from the weight stacks (checked finite once); apply's loop runs conv + bias
    reading them at the iteration number — nothing computed from the weights per call."""
    f, p, x = _hand_stack()
    text = lower_with_constants(jax.jit(f), p, x).as_text()            # gamma, k, mean, var, x
    apply, rep, prepare = hlofold.fold_stablehlo(text, split=["arg4"])
    assert rep.num_folded == 1 and rep.folded[0].layers == 3, str(rep)
    (body,) = loop_bodies(apply)
    assert not set(body) & NORM_OPS and "stablehlo.multiply" not in body, body
    assert "hlofold_" not in apply + prepare
    weights = [p["gamma"], p["k"], p["mean"], p["var"]]
    *prepared, ok = module_callable(prepare)(*weights)
    assert bool(ok) and sorted(q.shape for q in prepared) == [(3, 3, 3, 8, 8), (3, 8)]
    assert_close(f(p, x), first(module_callable(apply)(x, *prepared)))
    bad = dict(p, var=p["var"].at[2, 1].set(-1e-5))      # σ² + ε = 0 in layer 2: not ok
    assert not bool(module_callable(prepare)(*[bad[k] for k in ("gamma", "k", "mean",
                                                                "var")])[-1])


def test_a_bfloat16_stack_folds_within_the_originals_error():
    """A bfloat16 stack (constants, and params=): folded per layer, the folded module no
    further from the float32 result than the module as given."""
    f, p, x = _hand_stack()
    pb, xb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p), x.astype(jnp.bfloat16)
    ref = np.asarray(f(p, x))
    text = lower_with_constants(jax.jit(lambda x: f(pb, x)), xb).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1 and rep.folded[0].layers == 3, str(rep)
    err = lambda out: float(np.max(np.abs(np.asarray(out, np.float32) - ref)))  # noqa: E731
    assert err(run(folded, xb)) <= 1.25 * err(run(text, xb))
    exp = jax.export.export(jax.jit(f))(pb, xb)
    new, rep, prepared = hlofold.fold_stablehlo(
        exp, params={i: np.asarray(l) for i, l in enumerate(jax.tree.leaves(pb))})
    assert rep.num_folded == 1
    assert err(new.call(xb, *prepared)) <= 1.25 * err(exp.call(pb, xb))


def test_a_one_layer_stack_leaves_nothing_behind():
    """One layer: every folded constant is the same in every layer (kept in the body, no
    stacked operand, no row read) — and no op is left that nobody reads."""
    k = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 4)), jnp.float32)

    def f(x):
        return jax.lax.scan(lambda h, kk: (jnp.tanh(-(h @ kk + 1.0) + 2.0), None), x, k)[0]
    x = jnp.ones((2, 4), jnp.float32)
    text = lower_with_constants(jax.jit(f), x).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1 and rep.folded[0].layers == 1, str(rep)
    assert_nothing_left_behind(text, folded)
    assert_close(f(x), run(folded, x))


def test_split_of_the_fori_loop_form_leaves_nothing_behind():
    f, p, x = fori_stack(4)
    text = lower_with_constants(jax.jit(f), p, x).as_text()                 # k, s, t, x
    apply, rep, prepare = hlofold.fold_stablehlo(text, split=["arg3"])
    assert rep.num_folded == 1 and rep.folded[0].layers == 4, str(rep)
    assert_nothing_left_behind(text, apply)
    assert unread_ops(prepare) == 0
    *prepared, ok = module_callable(prepare)(p["k"], p["s"], p["t"])
    assert bool(ok)
    assert_close(f(p, x), first(module_callable(apply)(x, *prepared)))


def _bound(tree) -> dict:
    return {f"arg{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(tree))}


def test_summed_branches_in_a_stack_merge_per_layer():
    """A RepVGG block as a scanned body: on StableHLO, as on the jaxpr path, each layer's
    branches merge into one 3×3 conv (in the module, ``params=``, ``split=``), the loop
    runs one convolution, outputs equal."""
    f, p, x = branch_stack()
    want = np.asarray(f(p, x))
    text = lower_with_constants(jax.jit(lambda x: f(p, x)), x).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    (merge,) = rep.merged
    assert merge.layers == 3 and "3 branches" in merge.note, str(rep)
    (body,) = loop_bodies(folded)
    assert body.count("stablehlo.convolution") == 1 and not set(body) & NORM_OPS, body
    assert_close(want, run(folded, x))
    exp = jax.export.export(jax.jit(f))(p, x)
    new, rep2, prepared = hlofold.fold_stablehlo(exp, params=_bound(p))
    assert [m.layers for m in rep2.merged] == [3], str(rep2)
    assert sorted(q.shape for q in prepared) == [(3, 3, 3, 8, 8), (3, 8)]
    assert_close(want, new.call(x, *prepared))
    leaves = jax.tree.leaves(p)
    text = lower_with_constants(jax.jit(f), p, x).as_text()
    apply, rep3, prepare = hlofold.fold_stablehlo(text, split=[f"arg{len(leaves)}"])
    assert [m.layers for m in rep3.merged] == [3], str(rep3)
    *made, ok = module_callable(prepare)(*leaves)
    assert bool(ok)
    (abody,) = loop_bodies(apply)
    assert abody.count("stablehlo.convolution") == 1 and not set(abody) & NORM_OPS, abody
    assert_close(want, first(module_callable(apply)(x, *made)))


def test_stack_folds_from_many_threads_alike():
    """``fold_stablehlo`` of scanned stacks from eight threads at once (each its own MLIR
    context): every result is the serial one."""
    from concurrent.futures import ThreadPoolExecutor
    f, p, x = branch_stack()
    texts = [lower_with_constants(jax.jit(lambda x: f(p, x)), x).as_text(),
             lower_with_constants(jax.jit(lambda x: CNN.apply(CNN_VARS, x)), X).as_text()]
    serial = [str(hlofold.fold_stablehlo(t)[0]) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: (i % 2, str(hlofold.fold_stablehlo(texts[i % 2])[0])),
                            range(16)))
    assert all(out == serial[k] for k, out in got)


def _branch_in_layer():
    """A scanned layer whose conv → BN runs inside a ``lax.cond`` on the activations (both
    branches): each layer's folded kernels live in the ``case``'s branches."""
    rng = np.random.default_rng(5)
    L, C = 3, 8
    p = {"k": jnp.asarray(rng.standard_normal((L, 3, 3, C, C)) * .3, jnp.float32),
         "m": jnp.asarray(rng.standard_normal((L, C)), jnp.float32),
         "v": jnp.asarray(rng.uniform(.5, 2, (L, C)), jnp.float32),
         "g": jnp.asarray(rng.uniform(.5, 2, (L, C)), jnp.float32)}

    def f(p, x):
        def body(h, q):
            def conv_bn(h):
                y = jax.lax.conv_general_dilated(h, q["k"], (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
                return (y - q["m"]) * jax.lax.rsqrt(q["v"] + 1e-5) * q["g"]
            y = jax.lax.cond(jnp.sum(h) > 0, conv_bn, lambda h: conv_bn(-h), h)
            return jax.nn.relu(y), None
        return jax.lax.scan(body, x, p)[0]
    x = jnp.asarray(rng.standard_normal((2, 6, 6, C)), jnp.float32)
    return f, p, x


def test_per_layer_constants_inside_branches_are_read_per_layer():
    """The folded kernels of each layer, inside the branches of a ``case``, are restacked
    and read at the iteration number before it (values of the enclosing block may be read in
    its branches): the loop folds, both branches run conv + bias, outputs equal (was: the
    loop left, its layers said to differ)."""
    f, p, x = _branch_in_layer()
    text = lower_with_constants(jax.jit(lambda x: f(p, x)), x).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    # (the other branch's negation folds forward into its kernel too), as on the jaxpr path
    ff = hlofold.fold(jax.jit(f))
    jrep = ff.report(p, x)
    assert rep.num_folded == jrep.num_folded == 3 and not rep.refused, str(rep)
    assert all(s.layers == 3 for s in rep.folded), str(rep)
    (body,) = loop_bodies(folded)
    assert not set(body) & NORM_OPS and body.count("stablehlo.convolution") == 2, body
    assert "stablehlo.case" in body and body.count("stablehlo.dynamic_slice") >= 2, body
    assert_close(f(p, x), run(folded, x))
    assert_close(f(p, -x), run(folded, -x))                   # the other branch
    exp = jax.export.export(jax.jit(f))(p, x)
    new, rep2, prepared = hlofold.fold_stablehlo(exp, params=_bound(p))
    assert rep2.num_folded == 3, str(rep2)
    assert_close(f(p, x), new.call(x, *prepared))
