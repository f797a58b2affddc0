"""``_compat.ops_named``: the bindings' C++ walk, and the Python walk it falls back to, find
the same ops in the same (program) order, nested regions included."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hlofold import _compat as C
from hlofold._ir.stablehlo.module import parse_module, walk


def _module():
    def f(x, w):
        h = x @ w
        h = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), h)      # a dot in a loop body
        return jax.jit(lambda h: h @ w)(h) + h @ w.T
    return parse_module(jax.jit(f).lower(jnp.ones((2, 4)), jnp.ones((4, 4))).as_text())


def test_both_walks_find_the_same_ops_in_order(monkeypatch):
    m = _module()
    with m.context:
        want = [o for fn in m.body.operations for r in fn.regions for b in r.blocks
                for o in walk(b) if o.operation.name == "stablehlo.dot_general"]
        got = C.ops_named(m, "stablehlo.dot_general")
        assert len(want) == 4 and [str(o) for o in got] == [str(o) for o in want]
        ir = C.mlir()[0]
        monkeypatch.delattr(ir, "WalkResult")                           # (older bindings)
        slow = C.ops_named(m, "stablehlo.dot_general")
        assert [str(o) for o in slow] == [str(o) for o in want]
