"""Generated layer stacks for the differential test of every entry point
(``tests/parity/test_stack_generated.py``): a hypothesis strategy (:func:`stack_specs`) and
the program a spec describes (:func:`build`).

A stack of ``L`` layers runs one body per layer over parameters stacked on a leading axis,
read in one of the forms large models use:

* ``xs``: ``lax.scan(body, x, params)``, each iteration reading its slice (``nn.scan``);
* ``counter``: ``lax.scan`` carrying a counter ``i`` from ``start`` by ``step``, the body
  reading ``params[k][i % L]`` (MaxText's ``dynamic_index`` form);
* ``fori``: ``lax.fori_loop(start, start + L, ...)`` reading ``params[k][(i - start) %
  L]`` — or ``params[k][i % L]`` (rows in another order).

The scans run forward or reversed, unrolled by 1, 2 or whole; the body is conv → BatchNorm
→ ReLU (``plain``), that inside a ``lax.cond`` on the activations with another chain in the
other branch (``cond``), or a RepVGG block — 3×3 conv+BN, 1×1 conv+BN and the input summed
(``branches``); the BatchNorm's γ is stacked or one vector shared by every layer.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax


@dataclasses.dataclass(frozen=True)
class StackSpec:
    form: str            # "xs", "counter", "fori"
    layers: int
    reverse: bool = False
    unroll: int = 1      # 1, 2, or 0: whole (``unroll=True``)
    start: int = 0       # the counter's first value
    step: int = 1        # its step (``counter``); ``fori`` steps by 1
    offset: bool = True  # ``fori``: read row ``i - start`` (else ``i``)
    body: str = "plain"  # "plain", "cond", "branches"
    shared_gamma: bool = False
    channels: int = 4
    seed: int = 0

    def folds(self) -> int:
        """Sites the jaxpr path folds (one record per site, every layer in it)."""
        return {"plain": 1, "cond": 2, "branches": 2}[self.body]

    def merges(self) -> int:
        return 1 if self.body == "branches" else 0


@st.composite
def stack_specs(draw):
    form = draw(st.sampled_from(["xs", "counter", "fori"]))
    layers = draw(st.integers(1, 4))
    return StackSpec(
        form=form, layers=layers,
        reverse=form != "fori" and draw(st.booleans()),
        unroll=draw(st.sampled_from([1, 1, 2, 0])) if form != "fori" else 1,
        start=draw(st.integers(0, 3)) if form != "xs" else 0,
        step=draw(st.sampled_from([1, 1, 2, -1])) if form == "counter" else 1,
        offset=draw(st.booleans()) if form == "fori" else True,
        body=draw(st.sampled_from(["plain", "plain", "cond", "branches"])),
        shared_gamma=draw(st.booleans()), channels=draw(st.sampled_from([3, 4])),
        seed=draw(st.integers(0, 2 ** 16)))


def _conv(h, k, pad="SAME"):
    return lax.conv_general_dilated(h, k, (1, 1), pad,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _bn(y, q, gamma):
    return (y - q["m"]) * lax.rsqrt(q["v"] + 1e-5) * gamma + q["b"]


def build(spec: StackSpec):
    """``(f, params, x)``: ``f(params, x)`` the stack ``spec`` describes."""
    rng = np.random.default_rng(spec.seed)
    L, C = spec.layers, spec.channels

    def arr(*shape, lo=None):
        a = rng.uniform(lo, 2, shape) if lo is not None else rng.standard_normal(shape)
        return jnp.asarray(a, jnp.float32)

    def bn():
        return {"m": arr(L, C), "v": arr(L, C, lo=.5), "b": arr(L, C) * .3}
    p = {"k": arr(L, 3, 3, C, C) * .3, "bn": bn()}
    if spec.body == "cond":
        p["bn2"] = bn()
    if spec.body == "branches":
        p["k1"], p["bn1"] = arr(L, 1, 1, C, C) * .3, bn()
    p["g"] = arr(C, lo=.5) if spec.shared_gamma else arr(L, C, lo=.5)

    def layer(h, q, gamma):
        y = _bn(_conv(h, q["k"]), q["bn"], gamma)
        if spec.body == "cond":
            y = lax.cond(jnp.mean(h) > 0, lambda y2: y2,
                         lambda y2: -2.0 * _bn(_conv(h, q["k"]), q["bn2"], gamma) + 1.0, y)
        if spec.body == "branches":
            y = y + _bn(_conv(h, q["k1"], "VALID"), q["bn1"], gamma) + h
        return jax.nn.relu(y)

    stacked = {k: v for k, v in p.items() if k != "g" or not spec.shared_gamma}

    def row(q, j):
        return jax.tree.map(lambda a: a[j], q)

    def gamma_of(p, q):
        return p["g"] if spec.shared_gamma else q["g"]

    def f(p, x):
        st_ = {k: v for k, v in p.items() if k in stacked}
        unroll = True if spec.unroll == 0 else spec.unroll
        if spec.form == "xs":
            return lax.scan(lambda h, q: (layer(h, q, gamma_of(p, q)), None), x, st_,
                            reverse=spec.reverse, unroll=unroll)[0]
        if spec.form == "counter":
            def body(c, _):
                i, h = c
                q = row(st_, i % L)
                return (i + spec.step, layer(h, q, gamma_of(p, q))), None
            return lax.scan(body, (jnp.int32(spec.start), x), None, length=L,
                            reverse=spec.reverse, unroll=unroll)[0][1]

        def fbody(i, h):
            q = row(st_, (i - spec.start) % L if spec.offset else i % L)
            return layer(h, q, gamma_of(p, q))
        return lax.fori_loop(spec.start, spec.start + L, fbody, x)

    x = arr(2, 5, 5, C)
    return f, p, x


# a fixed set for the README tier: every form, forward and reversed, every body
FIXED = [
    StackSpec("xs", 3), StackSpec("xs", 3, reverse=True, body="cond"),
    StackSpec("counter", 3, reverse=True), StackSpec("counter", 3, start=2, step=2),
    StackSpec("counter", 4, reverse=True, step=-1, start=1, unroll=2, body="branches"),
    StackSpec("fori", 3, start=1), StackSpec("fori", 3, start=1, offset=False, body="cond"),
    StackSpec("xs", 2, reverse=True, unroll=0, body="branches", shared_gamma=True),
]
