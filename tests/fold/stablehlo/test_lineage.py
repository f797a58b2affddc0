"""The values' lineage in the pass (``ChainWalker._sweep`` / ``_lineage``): for every value,
the block arguments it is computed from and whether it is computed from a root's output.
The sweep fills it in program order; a value added afterwards is walked lazily: both must
agree, also through an op's regions (values read from above); an inlined private function
drops only what it erases."""
import jax
import jax.numpy as jnp
import numpy as np

import hlofold
from hlofold import _compat as C
from hlofold._fold.stablehlo import match
from hlofold._ir.stablehlo.artifacts import module_callable
from hlofold._fold.stablehlo.fold import _Pass
from hlofold._ir.stablehlo.ir import op_name
from hlofold._fold.stablehlo.match import UNREACHED_OPS
from hlofold._ir.stablehlo.module import parse_module

ir, stablehlo, _ = C.mlir()

MODULE = """
func.func @main(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %g: tensor<4xf32>, %p: tensor<i1>)
    -> tensor<2x4xf32> {
  %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0]
      : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %gb = stablehlo.broadcast_in_dim %g, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32>
  %h = stablehlo.multiply %y, %gb : tensor<2x4xf32>
  %c = "stablehlo.if"(%p) ({
    stablehlo.return %gb : tensor<2x4xf32>
  }, {
    stablehlo.return %h : tensor<2x4xf32>
  }) : (tensor<i1>) -> tensor<2x4xf32>
  %r = stablehlo.add %c, %x : tensor<2x4xf32>
  return %r : tensor<2x4xf32>
}
"""


def _pass_and_values(text):
    module = parse_module(text)
    p = _Pass(module)
    main = p.symbols["main"]
    block = main.regions[0].blocks[0]
    ops = {op_name(op).split(".")[-1]: op.operation for op in block.operations}
    return module, p, main, block, ops


def test_the_sweep_says_what_each_value_is_computed_from():
    module, p, main, block, ops = _pass_and_values(MODULE)
    with module.context, ir.Location.unknown():
        p._sweep(main, [], UNREACHED_OPS, [])
        x, w, g, pred = block.arguments
        bit = {a: p._sources(a) for a in (x, w, g, pred)}
        assert len(set(bit.values())) == 4 and all(b and not b & (b - 1) for b in bit.values())
        y, gb, h = (ops[n].results[0] for n in ("dot_general", "broadcast_in_dim", "multiply"))
        c, r = ops["if"].results[0], ops["add"].results[0]
        assert p._from_root(y) and p._sources(y) == bit[x] | bit[w]
        assert not p._from_root(gb) and p._sources(gb) == bit[g]
        assert p._from_root(h) and p._sources(h) == bit[x] | bit[w] | bit[g]
        # the if reads %gb and %h inside its regions: computed from them, and from its predicate
        assert p._from_root(c) and p._sources(c) == bit[x] | bit[w] | bit[g] | bit[pred]
        assert p._from_root(r) and p._sources(r) == p._sources(c)
        assert not p._from_root(x) and not p._from_root(g)


def test_a_value_added_after_the_sweep_is_walked_to_the_same_lineage():
    module, p, main, block, ops = _pass_and_values(MODULE)
    with module.context, ir.Location.unknown():
        p._sweep(main, [], UNREACHED_OPS, [])
        g = block.arguments[2]
        gb = ops["broadcast_in_dim"].results[0]
        with ir.InsertionPoint(ops["add"]):         # written after the sweep: no lineage yet
            a = stablehlo.MulOp(gb, gb).result
            b = stablehlo.AddOp(a, ops["if"].results[0]).result
        assert a not in p.lineage and b not in p.lineage
        assert not p._from_root(a) and p._sources(a) == p._sources(g)
        c = ops["if"].results[0]
        assert p._from_root(b) and p._sources(b) == p._sources(g) | p._sources(c)
        fresh = _Pass(module)                        # a sweep of the program as it is now
        fresh._sweep(main, [], UNREACHED_OPS, [])
        for v in (a, b):
            assert fresh._from_root(v) == p._from_root(v)
        # (bits are numbered per pass: compare which arguments, by their own bits)
        args = list(block.arguments)
        for v in (a, b):
            assert [bool(p._sources(v) & p._sources(u)) for u in args] == \
                [bool(fresh._sources(v) & fresh._sources(u)) for u in args]


def test_inlining_a_call_keeps_the_lineage_of_the_rest_of_the_program(monkeypatch):
    """A site whose chain continues into a private function inlines it (a trial); the lineage
    of the values the inlining did not erase stays, so later sites do not walk the program
    again: the values walked lazily grow with the layers, not with their square."""
    @jax.jit
    def bn(y, m, v, g, b):                       # a private function per call site
        return (y - m) * jax.lax.rsqrt(v + 1e-5) * g + b

    def net(x, ps):
        for k, m, v, g, b in ps:
            y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jax.nn.relu(bn(y, m, v, g, b))
        return x

    rng = np.random.default_rng(0)
    settled = []
    real = match.postorder

    def counting(top, memo, inputs_of, settle):
        return real(top, memo, inputs_of, lambda n: (settled.append(n), settle(n)))
    monkeypatch.setattr(match, "postorder", counting)
    per_layer = {}
    for layers in (10, 40):
        ps = [tuple(jnp.asarray(a, jnp.float32) for a in (
            rng.normal(size=(3, 3, 4, 4)) * 0.1, rng.normal(size=4), rng.uniform(0.5, 2, 4),
            rng.normal(size=4), rng.normal(size=4))) for _ in range(layers)]
        x = jnp.asarray(rng.normal(size=(1, 6, 6, 4)), jnp.float32)
        text = jax.jit(lambda x: net(x, ps)).lower(x).as_text()
        assert text.count("call @") >= 2 * layers
        settled.clear()
        out, rep = hlofold.fold_stablehlo(text)
        assert rep.num_folded == layers, rep.counts()
        per_layer[layers] = len(settled) / layers
        np.testing.assert_allclose(module_callable(out)(x)[0], jax.jit(net)(x, ps),
                                   rtol=1e-5, atol=1e-5)
    assert per_layer[40] <= 1.5 * per_layer[10], per_layer
