"""Unit tests of the matching layer: the chain rules shared by both adapters
(``_base.chain_rules``), the root patterns (``_fold.core.patterns``) and their StableHLO side
(``_fold.stablehlo.patterns``), each rule on its own, with the same cases on both IRs where a rule
exists on both."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from hlofold._base.chain_rules import ChannelOperand, Refusal, pass_axis, unit_reshape_map
from hlofold._fold.jaxpr.steps import AffineStep, affine_step, pass_step, resolve_operand
from hlofold._ir.stablehlo.ir import op_name
from hlofold._ir.stablehlo.module import parse_module
from hlofold._fold.stablehlo.patterns import Operand, dot_dims, lhs_root_info, resolve, root_info
from hlofold._fold.core.patterns import conv_layout, dot_layout
from hlofold._fold.jaxpr.patterns import CONV_AFFINE, DOT_AFFINE

OUT = (2, 5, 5, 6)           # NHWC conv output, channels on axis 3


def _jaxpr(f, *shapes):
    closed = jax.make_jaxpr(f)(*[jnp.zeros(s, jnp.float32) for s in shapes])
    producer = {o: e for e in closed.jaxpr.eqns for o in e.outvars}
    return closed.jaxpr, producer.get


def _hlo_ops(f, *shapes):
    text = jax.jit(f).lower(*[jnp.zeros(s, jnp.float32) for s in shapes]).as_text()
    module = parse_module(text)
    ops = []
    for fop in module.body.operations:
        for block in fop.regions[0].blocks:
            ops.extend(block.operations)
    return module, ops


def _last(ops, name):
    return [o for o in ops if op_name(o) == name][-1]


# --------------------------------------------------------------------------- pass_axis


@pytest.mark.parametrize("kind, src, out, axis, kw, expected", [
    ("convert", (2, 6), (2, 6), 1, {}, 1),
    ("convert", (2, 6), (2, 6), 1, {"floats": False}, "non-float"),
    ("reshape", (2, 5, 5, 6), (2, 25, 6), 3, {}, 2),          # spatial axes merge
    ("reshape", (2, 5, 5, 6), (2, 150), 3, {}, "merges or splits"),
    ("reshape", (2, 1, 6), (2, 6), 2, {}, 1),
    ("reshape", (2, 6, 1), (2, 1, 6), 1, {}, 2),
    ("squeeze", (2, 1, 6), (2, 6), 2, {"dims": [1]}, 1),
    ("transpose", (2, 5, 5, 6), (2, 6, 5, 5), 3, {"perm": (0, 3, 1, 2)}, 1),
    ("transpose", (2, 5, 1, 6), (1, 6, 5, 2), 2, {"perm": (2, 3, 1, 0)}, 0),
    ("broadcast_in_dim", (2, 6), (2, 1, 6), 1, {"bdims": (0, 2)}, 2),
    ("broadcast_in_dim", (2, 6), (2, 3, 6), 1, {"bdims": (0, 2)}, "replicates"),
    ("reshape", (2, 1), (1, 2), 1, {}, "size 1"),
    ("sharding_constraint", (2, 6), (2, 6), 1, {}, 1),
    ("cumsum", (2, 6), (2, 6), 1, {}, "chain ends at cumsum"),
])
def test_pass_axis(kind, src, out, axis, kw, expected):
    got = pass_axis(kind, src, out, axis, **kw)
    if isinstance(expected, int):
        assert got == expected
    else:
        assert isinstance(got, Refusal) and expected in got.reason, got


def test_unit_reshape_map():
    assert unit_reshape_map((1, 6, 1), (6,)) == {1: 0}
    assert unit_reshape_map((2, 6), (2, 1, 6)) == {0: 0, 1: 2}
    assert unit_reshape_map((2, 6), (12,)) is None


def test_pass_step_on_jaxpr_equations():
    jaxpr, _ = _jaxpr(lambda y: jnp.transpose(y, (0, 3, 1, 2)).astype(jnp.float16)
                      .reshape(2, 6, 25).astype(jnp.int32), OUT)
    tr, cv, rs, ci = jaxpr.eqns
    assert pass_step(tr, 3) == 1
    assert pass_step(cv, 1) == 1
    assert pass_step(rs, 1) == 1
    assert "not between float types" in pass_step(ci, 1).reason


# --------------------------------------------------------------------------- operands


OPERAND_CASES = {
    # name: (function of (y, v), v shape, channel axis, expected source shape | refusal text)
    "vector": (lambda y, v: y * v, (6,), (6,)),
    "4-d broadcast": (lambda y, v: y * v.reshape(1, 1, 1, 6), (6,), (6,)),
    "scalar": (lambda y, v: y * v[0], (1,), ()),
    "spatial": (lambda y, v: y * v.reshape(1, 5, 1, 1), (5,), "varies along"),
    "full": (lambda y, v: y * v, OUT, "varies along"),
    "same size, other axis": (lambda y, v: y[:, :, :, :5] * v.reshape(1, 1, 5, 1), (5,),
                              "same size as the channels"),
}


@pytest.mark.parametrize("name", list(OPERAND_CASES))
def test_resolve_operand_on_both_irs(name):
    f, vshape, expected = OPERAND_CASES[name]
    jaxpr, producer = _jaxpr(f, OUT, vshape)
    mul = [e for e in jaxpr.eqns if e.primitive.name == "mul"][-1]
    out_shape = tuple(mul.outvars[0].aval.shape)
    got = resolve_operand(mul.invars[1], out_shape, 3, producer)   # y is operand 0
    _, ops = _hlo_ops(f, OUT, vshape)
    hgot = resolve(_last(ops, "stablehlo.multiply").operands[1], out_shape, 3)
    if isinstance(expected, tuple):
        assert isinstance(got, ChannelOperand), got
        assert got.size == int(np.prod(expected, dtype=int)) and got.casts == ()
        assert isinstance(hgot, Operand), hgot
        assert hgot.size == got.size and hgot.casts == ()
    else:
        assert isinstance(got, Refusal) and expected in got.reason, got
        assert isinstance(hgot, Refusal) and hgot == got     # one rule: the same words


def test_resolve_operand_records_float_casts_on_both_irs():
    """A cast between the smallest source and the full-size operand is recorded (and
    replayed on the source); a source already as small as it gets is taken as it is."""
    f = lambda y, v: y * jnp.broadcast_to(v.astype(jnp.bfloat16), OUT).astype(jnp.float32)
    jaxpr, producer = _jaxpr(f, OUT, (6,))
    got = resolve_operand(jaxpr.eqns[-1].invars[1], OUT, 3, producer)
    assert got.source is jaxpr.eqns[0].outvars[0]          # the bf16 vector
    assert [np.dtype(d) for d in got.casts] == [np.dtype(np.float32)]
    _, ops = _hlo_ops(f, OUT, (6,))
    hgot = resolve(_last(ops, "stablehlo.multiply").operands[1], OUT, 3)
    assert [str(t) for t in hgot.casts] == ["f32"] and hgot.size == 6
    # already minimal: no walk back through the casts
    f2 = lambda y, v: y * v.astype(jnp.bfloat16).astype(jnp.float32)
    jaxpr, producer = _jaxpr(f2, OUT, (6,))
    got = resolve_operand(jaxpr.eqns[-1].invars[1], OUT, 3, producer)
    assert got.source is jaxpr.eqns[1].outvars[0] and got.casts == ()


# --------------------------------------------------------------------------- affine steps


@pytest.mark.parametrize("f, pos, kind", [
    (lambda y, v: y + v, 0, "add"), (lambda y, v: v + y, 1, "add"),
    (lambda y, v: y - v, 0, "sub"), (lambda y, v: v - y, 1, "rsub"),
    (lambda y, v: y * v, 0, "mul"), (lambda y, v: y / v, 0, "div"),
    (lambda y, v: -y, 0, "neg"),
])
def test_affine_step_kinds(f, pos, kind):
    jaxpr, producer = _jaxpr(f, OUT, (6,))
    step = affine_step(jaxpr.eqns[-1], pos, 3, producer)
    assert isinstance(step, AffineStep) and step.kind == kind


def test_affine_step_refusals():
    jaxpr, producer = _jaxpr(lambda y, v: v / y, OUT, (6,))
    assert "divisor" in affine_step(jaxpr.eqns[-1], 1, 3, producer).reason
    jaxpr, producer = _jaxpr(lambda y, v: y[0] + v, OUT, (2, 5, 5, 6))
    assert "larger shape" in affine_step(jaxpr.eqns[-1], 0, 2, producer).reason


# --------------------------------------------------------------------------- roots


def _conv(x, k, groups=1, dn=("NHWC", "HWIO", "NHWC")):
    return lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=dn,
                                    feature_group_count=groups)


@pytest.mark.parametrize("dn, xs, ks, axis, kaxis", [
    (("NHWC", "HWIO", "NHWC"), (2, 7, 7, 4), (3, 3, 4, 6), 3, 3),
    (("NCHW", "OIHW", "NCHW"), (2, 4, 7, 7), (6, 4, 3, 3), 1, 0),
])
def test_conv_root_on_both_irs(dn, xs, ks, axis, kaxis):
    f = lambda x, k: _conv(x, k, dn=dn)
    jaxpr, _ = _jaxpr(f, xs, ks)
    info = CONV_AFFINE.inspect_root(jaxpr.eqns[-1])
    assert (info.channel_axis, info.kernel_index, info.kernel_axis) == (axis, 1, kaxis)
    assert (info.in_channels, info.out_channels, info.groups) == (4, 6, 1)
    _, ops = _hlo_ops(f, xs, ks)
    hinfo = root_info(_last(ops, "stablehlo.convolution"))
    assert hinfo == info           # (one root type on both IRs: RootInfo)


def test_grouped_conv_root():
    jaxpr, _ = _jaxpr(lambda x, k: _conv(x, k, groups=2), (2, 7, 7, 4), (3, 3, 2, 6))
    info = CONV_AFFINE.inspect_root(jaxpr.eqns[-1])
    assert info.groups == 2 and info.in_channels == 4


def test_dot_root_on_both_irs():
    f = lambda x, w: x @ w
    jaxpr, _ = _jaxpr(f, (3, 8), (8, 5))
    info = DOT_AFFINE.inspect_root(jaxpr.eqns[-1])
    assert (info.channel_axis, info.kernel_index, info.kernel_axis) == (1, 1, 1)
    assert info.in_channels == 8 and info.out_channels == 5
    _, ops = _hlo_ops(f, (3, 8), (8, 5))
    op = _last(ops, "stablehlo.dot_general")
    assert dot_dims(op) == ((), (1,), (), (0,))
    assert root_info(op) == info
    lhs = lhs_root_info(op)            # the weight read as the lhs: its free dim is rows
    assert (lhs.channel_axis, lhs.kernel_index, lhs.kernel_axis) == (0, 0, 0)


def test_dot_root_refuses_integer_dots():
    jaxpr = jax.make_jaxpr(lambda x, w: lax.dot_general(x, w, (((1,), (0,)), ((), ()))))(
        jnp.zeros((3, 8), jnp.int8), jnp.zeros((8, 5), jnp.int8)).jaxpr
    assert "integer dot" in DOT_AFFINE.inspect_root(jaxpr.eqns[-1]).reason


def test_layout_names():
    assert conv_layout((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)) == "NHWC,HWIO->NHWC"
    assert conv_layout((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)) == "NCHW,OIHW->NCHW"
    assert dot_layout((3, 8), (8, 5), (3, 5)) == "dot(3, 8)x(8, 5)->(3, 5)"


def test_pattern_docstrings_name_the_pattern():
    for p in (CONV_AFFINE, DOT_AFFINE):
        assert "Pattern:" in type(p).__doc__


def test_matching_layer_reads_jax_through_compat_only():
    import inspect

    import hlofold._base.chain_rules as R
    import hlofold._fold.stablehlo.patterns as H
    import hlofold._fold.core.patterns as P
    for mod in (R, P, H):
        assert "jax._src" not in inspect.getsource(mod)


# --------------------------------------------------------------------------- the chain walk


class _ToyIR:
    """A minimal ``_fold.core.chain.ChainIR``: ops are names in a list, each reads the one before it;
    ``extra`` adds readers, ``rules`` says what each op does."""

    program = "toy program"

    def __init__(self, ops, rules, extra=(), activations=(), outputs=()):
        self.ops, self.rules = ops, rules
        self.extra, self.activations, self.outputs = dict(extra), set(activations), set(outputs)

    def uses(self, v):
        i = self.ops.index(v)
        users = [(self.ops[i + 1], 0)] if i + 1 < len(self.ops) else []
        users += [(u, 0) for u in self.extra.get(v, ())]
        return users, int(v in self.outputs)

    def name(self, op):
        return op

    def result(self, op):
        return op

    def describe(self, v):
        return f"<{v}>"

    def step(self, op, pos, v, axis):
        return self.rules(op, axis)

    def from_root(self, v):
        return v in self.activations

    def joins_activation(self, op, pos, v):
        return op.startswith("residual")

    def explain_axis(self, axis):
        return f"role{axis}"


def _toy_rules(op, axis):
    from hlofold._fold.core.chain import Absorb, Pass
    kind = op.split("#")[0]
    if kind in ("mul", "add"):
        return Absorb((kind, op), f"param_of_{op}")
    if kind == "gate":
        return Absorb((kind, op), "act")
    if kind == "transpose":
        return Pass(("transpose", op), axis + 1)
    if kind in ("bad", "residual"):
        return Refusal("bad operand", 0)
    return f"chain ends at {kind}"


def test_walk_cuts_the_chain_after_its_last_affine_op():
    from hlofold._fold.core.chain import walk
    ir = _ToyIR(["root", "mul#1", "transpose#1", "add#1", "transpose#2", "max#1"], _toy_rules)
    w = walk(ir, "root", 3)
    assert [s[1] for s in w.steps] == ["mul#1", "transpose#1", "add#1"]   # trailing pass cut
    assert w.axis == 4 and w.stop == "chain ends at max" and not w.refusal


def test_walk_refuses_a_second_reader_and_names_both():
    from hlofold._fold.core.chain import walk
    ir = _ToyIR(["root", "mul#1", "add#1"], _toy_rules, extra={"mul#1": ["tanh#9"]})
    w = walk(ir, "root", 3)
    assert w.steps == [("mul", "mul#1")] and w.refusal
    assert w.stop == ("value <mul#1> in the chain has 2 consumers (add#1, tanh#9); folding "
                      "would change them")


def test_walk_stops_at_an_output_unused_value_and_activation_operands():
    from hlofold._fold.core.chain import FROM_ACTIVATION, UNUSED, walk
    out = walk(_ToyIR(["root", "mul#1", "add#1"], _toy_rules, outputs={"mul#1"}), "root", 0)
    assert out.stop == "value <mul#1> in the chain has 2 consumers (add#1, output); folding " \
        "would change them"
    ret = walk(_ToyIR(["root", "mul#1"], _toy_rules, outputs={"mul#1"}), "root", 0)
    assert ret.stop == "value is an output of the toy program" and not ret.refusal
    assert len(ret.steps) == 1
    assert walk(_ToyIR(["root"], _toy_rules), "root", 0).stop == UNUSED
    gate = walk(_ToyIR(["root", "gate#1"], _toy_rules, activations={"act"}), "root", 0)
    assert not gate.refusal and gate.stop == f"gate#1: {FROM_ACTIVATION}" and gate.steps == []


def test_walk_ends_without_refusing_where_the_chain_meets_another_activation():
    """A residual add (an operand that is not per channel, from the activations) ends the
    chain: nothing per-channel was there, so it is no refusal (issue 39 item 4)."""
    from hlofold._fold.core.chain import JOINS_ACTIVATION, walk
    res = walk(_ToyIR(["root", "residual#1"], _toy_rules), "root", 0)
    assert not res.refusal and res.stop == f"residual#1: {JOINS_ACTIVATION}" and not res.steps
    after = walk(_ToyIR(["root", "mul#1", "residual#1"], _toy_rules), "root", 0)
    assert after.steps == [("mul", "mul#1")] and not after.refusal
    bad = walk(_ToyIR(["root", "bad#1"], _toy_rules), "root", 0)     # a weight: refused
    assert bad.refusal


def test_walk_explains_an_axis_of_the_root_output_only():
    from hlofold._fold.core.chain import walk
    at_root = walk(_ToyIR(["root", "bad#1"], _toy_rules), "root", 3)
    assert at_root.refusal and at_root.stop == "bad operand; axis 0 is role0"
    later = walk(_ToyIR(["root", "mul#1", "bad#1"], _toy_rules), "root", 3)
    assert later.stop == "bad operand" and later.steps == [("mul", "mul#1")]


def test_chain_kind():
    from hlofold._fold.core.chain import chain_kind
    assert chain_kind([]) == "none"
    assert chain_kind(["add"]) == chain_kind(["sub"]) == "canonical"
    assert chain_kind(["mul"]) == chain_kind(["add", "add"]) == chain_kind(["bn"]) == "fold"


def test_postorder_is_iterative_and_memoized():
    from hlofold._fold.core.chain import postorder
    n = 50_000                        # deeper than Python's recursion limit
    memo, calls = {}, []

    def settle(i):
        calls.append(i)
        memo[i] = 0 if i == 0 else memo[i - 1] + 1
    assert postorder(n, memo, lambda i: [i - 1] if i else [], settle) == n
    assert postorder(n - 7, memo, lambda i: [i - 1] if i else [], settle) == n - 7
    assert len(calls) == n + 1


# ------------------------------------------------------------------ reasons and their kinds


def test_a_reason_keeps_its_kind_through_copies_and_extensions():
    import copy
    import json
    import pickle

    from hlofold._base.reasons import KINDS, Reason, reason_kind
    r = Reason("consumers", "the conv output has 2 consumers")
    assert r == "the conv output has 2 consumers" and reason_kind(r) == "consumers"
    for c in (copy.deepcopy(r), pickle.loads(pickle.dumps(r)), r.then("; more"),
              r.after("mul: ")):
        assert reason_kind(c) == "consumers"
    assert json.loads(json.dumps({"reason": r})) == {"reason": str(r)}
    assert reason_kind("plain words") == "other" and reason_kind(None) is None
    assert reason_kind(r + "!") == "other"        # str operations give plain strings
    with pytest.raises(ValueError, match="unknown reason kind"):
        Reason("no-such-kind", "x")
    assert "other" not in KINDS


def test_every_rule_writes_its_kind():
    """The rules of ``_fold.core.rules`` and the shared sentences carry their kinds."""
    import numpy as np

    from hlofold._fold.core import chain as _chain, rules as _rules
    from hlofold._base.reasons import reason_kind
    f16 = np.dtype(np.float16)
    got = {
        "scale": _rules.scale_refusal(np.array([1.0, np.inf])),
        "precision": _rules.precision_refusal(f16, [np.float32]),
        "overflow": _rules.round_kernel(np.full((2, 2), 6e4), np.array([10.0, 1.0]), f16,
                                        1)[1],
        "underflow": _rules.round_kernel(np.full((2, 2), 1.0), np.array([1e-9, 1.0]), f16,
                                         1)[1],
        "runtime": _rules.runtime_refusal(f16),
        "bias map": _rules.bias_map_refusal(10, 5, None),
    }
    assert {k: reason_kind(v) for k, v in got.items()} == {
        "scale": "not-finite", "precision": "precision", "overflow": "overflow",
        "underflow": "underflow", "runtime": "unchecked-range", "bias map": "bias-map"}
    assert [reason_kind(r) for r in (_chain.FROM_ACTIVATION, _chain.KERNEL_FROM_ACTIVATION,
                                     _chain.CANONICAL_BIAS, _chain.UNUSED)] == [
        "operand-from-activation", "kernel-from-activation", "canonical", "chain-end"]


# --------------------------------------------------------------------------- walk_forward

import collections  # noqa: E402

from hlofold._fold.core.forward_walk import AMBIGUOUS, LONE_SHIFT, ForwardChain, walk_forward
from hlofold._base.reasons import Reason  # noqa: E402

_Step = collections.namedtuple("_Step", "kind operand")
_FULL, _TOKEN, _CHANNEL = (2, 4), (2, 1), (4,)     # features on axis 1


class _ToyForward:
    """A toy IR for ``walk_forward``: an op is named by its result; ``ops[v] = (kind,
    operands)``; values named ``g*``/``b*`` are per-channel (shape (4,); their source, an
    input, is the name primed), ``r*`` per-token factors (shape (2, 1)), anything else
    full-shaped."""

    def __init__(self, ops, readers=None, activations=(), known=()):
        self.ops, self.n = ops, readers or {}
        self.acts, self.known_ = set(activations), set(known)
        self.invariant_memo: dict = {}

    def producer(self, v):
        return v if v in self.ops else None

    def takeable(self, op):
        return self.ops[op][0] in ("mul", "add", "sub", "div", "neg")

    def kind(self, op):
        return self.ops[op][0]

    def pass_axis(self, op, axis):
        return None                 # (no constraint or shape op in these programs)

    def operands(self, op):
        return self.ops[op][1]

    def result(self, op):
        return op

    def shape(self, v):
        return _CHANNEL if v[0] in "gb" else _TOKEN if v[0] == "r" else _FULL

    def broadcast_dims(self, op):
        return (0, 1)

    def affine(self, op, pos, axis):
        kind, ins = self.ops[op]
        if kind == "neg":
            return _Step("neg", None), None
        got = self.channel(ins[1 - pos], _FULL, axis)
        return None if got is None else (_Step(kind, got[0]), got[1])

    def channel(self, v, shape, axis):          # (operand, its source: an input, v')
        return (v, v + "'") if self.shape(v) == _CHANNEL else None

    def step(self, op, kind, operand, axis):
        return _Step(kind, operand)

    def known(self, v):
        return v in self.known_

    def is_activation(self, source, chain_value):
        return source in self.acts

    def consumers_refusal(self, v, top, axis):
        n = self.n.get(v, 1)
        return None if n == 1 or v == top else Reason("consumers", f"{n} consumers")

    def n_consumers(self, v):
        return self.n.get(v, 1)


def _walked(ops, top="top", **kw) -> ForwardChain:
    got = walk_forward(_ToyForward(ops, **kw), top, 1)
    assert isinstance(got, ForwardChain), got
    return got


def test_walk_forward_takes_per_channel_steps_in_program_order():
    got = _walked({"top": ("add", ["h", "b1"]), "h": ("mul", ["x", "g1"]),
                   "x": ("other", [])})
    assert [(s.kind, s.operand) for s in got.steps] == [("mul", "g1"), ("add", "b1")]
    assert got.source == "x" and got.tokens == [] and got.taken == ["top", "h"]


def test_walk_forward_keeps_a_per_token_factor_and_absorbs_the_scale_after_it():
    """RMSNorm ``(x·r)·γ``: r stays (the root reads x·r), γ is absorbed."""
    got = _walked({"top": ("mul", ["h", "g1"]), "h": ("mul", ["x", "r1"])})
    assert [s.operand for s in got.steps] == ["g1"]
    assert got.tokens == [("mul", "r1")] and got.source == "x"


def test_walk_forward_splits_a_product_of_a_token_factor_and_a_scale():
    """Flax/Haiku ``x·(r ⊗ γ)``: the product is split, r kept, γ absorbed; the product's
    op is taken."""
    got = _walked({"top": ("add", ["h", "b1"]), "h": ("mul", ["x", "p"]),
                   "p": ("mul", ["r1", "g1"])})
    assert [(s.kind, s.operand) for s in got.steps] == [("mul", "g1"), ("add", "b1")]
    assert got.tokens == [("mul", "r1")] and set(got.taken) == {"top", "h", "p"}


def test_walk_forward_reads_keras_distributed_shift():
    """Keras ``x·P + (u·P + β)`` = ``(x + u)·P + β``: the per-token +u and ·r are kept, in
    program order."""
    got = _walked({"top": ("add", ["xp", "shift"]), "xp": ("mul", ["x", "p"]),
                   "shift": ("add", ["up", "b1"]), "up": ("mul", ["r2", "p"]),
                   "p": ("mul", ["r1", "g1"])})
    assert [(s.kind, s.operand) for s in got.steps] == [("mul", "g1"), ("add", "b1")]
    assert got.tokens == [("add", "r2"), ("mul", "r1")] and got.source == "x"


def test_walk_forward_stops_at_a_shift_before_a_token_factor():
    """``(x + β₀)·r·γ``: β₀·r is not a per-feature shift; the add stays in the graph."""
    got = _walked({"top": ("mul", ["h", "g1"]), "h": ("mul", ["y", "r1"]),
                   "y": ("add", ["x", "b0"])})
    assert [s.operand for s in got.steps] == ["g1"] and got.source == "y"


def test_walk_forward_refusals():
    lone = walk_forward(_ToyForward({"top": ("add", ["xp", "up"]), "xp": ("mul", ["x", "q"]),
                                     "up": ("mul", ["r2", "q"])}), "top", 1)
    assert lone is LONE_SHIFT                # the product it distributes over is not taken
    two = _walked({"top": ("mul", ["h", "g1"]), "h": ("mul", ["x", "g2"])},
                  readers={"h": 2})
    assert two.stop.kind == "consumers" and [s.operand for s in two.steps] == ["g1"]
    both = _walked({"top": ("mul", ["ga", "gb"]), "ga": ("mul", ["x", "g1"]),
                    "gb": ("mul", ["x", "g2"]), "g1": ("other", []), "g2": ("other", [])})
    assert both.stop is AMBIGUOUS and both.steps == []
    gate = _walked({"top": ("mul", ["x", "g1"])}, activations={"g1'"})
    assert gate.steps == [] and gate.stop is None          # an activation: not a parameter


@pytest.mark.parametrize("cone", [None, ["reshape"], ["reshape", "add"]])
@pytest.mark.parametrize("from_root", [False, True])
@pytest.mark.parametrize("other", [None, ["dot_general"]])
def test_weight_like_asks_its_cones_only_when_they_decide(cone, from_root, other):
    """The weight rule's answer over its cases, computing neither cone for an operand from
    a root (attention's K and V: most of a decoder's refused dots) nor the other operand's
    when the first cone already says no."""
    from hlofold._fold.core.rules import WEIGHT_LAYOUT, weight_like
    asked = []
    got = weight_like(lambda: asked.append("w") or cone, from_root,
                      lambda: asked.append("other") or other)
    assert got == (not from_root and cone is not None and
                   all(k in WEIGHT_LAYOUT for k in cone) and other is None)
    assert asked == ([] if from_root else ["w"] if cone is None or "add" in cone
                     else ["w", "other"])
