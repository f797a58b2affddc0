"""What an op means is declared once per IR (``hlofold._ir.jaxpr.ops``,
``hlofold._ir.stablehlo.ops``): the two registries agree on the ops both IRs have, their facts
are checked when written, and no module that reads an IR keeps a set of op names of its own
(the cores and the base speak the IR-agnostic kinds — ``"add"``, ``"mul"`` — and read no IR)."""
from __future__ import annotations

import ast
import pathlib

import pytest

import hlofold
from hlofold._base.ops import NONE, Op
from hlofold._ir.jaxpr import ops as J
from hlofold._ir.stablehlo import ops as S

PKG = pathlib.Path(hlofold.__file__).parent

# the same op on both IRs: jaxpr primitive -> StableHLO op
SAME = {
    "conv_general_dilated": "stablehlo.convolution", "dot_general": "stablehlo.dot_general",
    "add": "stablehlo.add", "sub": "stablehlo.subtract", "mul": "stablehlo.multiply",
    "div": "stablehlo.divide", "neg": "stablehlo.negate",
    "convert_element_type": "stablehlo.convert", "reshape": "stablehlo.reshape",
    "broadcast_in_dim": "stablehlo.broadcast_in_dim", "transpose": "stablehlo.transpose",
    "sharding_constraint": "sdy.sharding_constraint",
    "reduce_precision": "stablehlo.reduce_precision",
    "max": "stablehlo.maximum", "min": "stablehlo.minimum", "clamp": "stablehlo.clamp",
    "abs": "stablehlo.abs", "tanh": "stablehlo.tanh", "logistic": "stablehlo.logistic",
    "exp": "stablehlo.exponential", "erf": "chlo.erf", "rsqrt": "stablehlo.rsqrt",
    "sqrt": "stablehlo.sqrt", "square": "chlo.square", "pow": "stablehlo.power",
    "cbrt": "stablehlo.cbrt", "log": "stablehlo.log", "log1p": "stablehlo.log_plus_one",
    "expm1": "stablehlo.exponential_minus_one", "sign": "stablehlo.sign",
    "sin": "stablehlo.sine", "cos": "stablehlo.cosine", "while": "stablehlo.while",
    "custom_call": "stablehlo.custom_call", "sort": "stablehlo.sort",
    "dynamic_slice": "stablehlo.dynamic_slice", "slice": "stablehlo.slice",
}
# facts that differ by IR only in how the IR spells the op, not in what it means
IR_SPECIFIC = ("pure",)     # which ops hlofold's own StableHLO clean-up may erase


@pytest.mark.parametrize("prim", sorted(SAME))
def test_the_two_registries_agree_on_the_ops_both_irs_have(prim):
    a, b = J.of(prim), S.of(SAME[prim])
    assert a is not NONE and b is not NONE, prim
    diff = {f.name: (getattr(a, f.name), getattr(b, f.name))
            for f in Op.__dataclass_fields__.values()
            if f.name not in IR_SPECIFIC and getattr(a, f.name) != getattr(b, f.name)}
    assert not diff, f"{prim} / {SAME[prim]}: {diff}"


def test_the_settled_disagreements():
    """Each a place where two walks' lists had disagreed (issue 66, item 2)."""
    # reduce_precision: an identity to one pair walk, a stop to the other -> a rounding
    for facts in (J.of("reduce_precision"), S.of("stablehlo.reduce_precision")):
        assert facts.rounding == "always" and facts.shape is None and facts.elementwise
    # batch_norm_inference: an affine step to the forward walk and the merge reader, not to
    # the calls a fold crosses -> an affine step to every walk
    assert S.of("stablehlo.batch_norm_inference").affine == "bn"
    from hlofold._fold.stablehlo import calls, forward, merge
    assert {"stablehlo.batch_norm_inference"} <= calls._AFFINE & forward._AFFINE & \
        merge._AFFINE
    # |s·x| = s·|x|: abs was called "not positively homogeneous" in the pair walks' reasons
    assert J.of("abs").homogeneous is True and S.of("stablehlo.abs").homogeneous is True
    # erf ended a jaxpr merge as a nonlinearity, but not a StableHLO one
    assert J.of("erf").activation and S.of("chlo.erf").activation
    # the forward walks' "elementwise": tanh/logistic on one path only
    from hlofold._fold.jaxpr import forward as jforward
    assert "tanh" in jforward._ELEMENTWISE and "stablehlo.tanh" in forward._ELEMENTWISE


def test_facts_are_checked_when_written():
    with pytest.raises(ValueError, match="unknown op fact"):
        Op(affine="scale")
    with pytest.raises(ValueError, match="not several"):
        Op(layer="conv", affine="mul")
    assert J.of("no_such_primitive") is NONE and S.of("stablehlo.no_such_op") is NONE


def _op_names() -> set[str]:
    return set(J.OPS) | set(S.OPS)


KINDS = {"add", "sub", "mul", "div", "neg", "bn", "rsub", "convert", "reshape", "transpose",
         "broadcast_in_dim", "sharding_constraint", "squeeze", "elementwise"}
REGISTRIES = {PKG / "_ir" / "jaxpr" / "ops.py", PKG / "_ir" / "stablehlo" / "ops.py"}
IR_FREE = ("_base", "_fold/core", "_quant/core", "_compat")   # (no IR read; the kinds)


def op_sets(path: pathlib.Path) -> list[str]:
    """Module-level names bound to a literal set, tuple, list or frozenset of op names (or
    a dict from op names to strings): an op list a walk keeps of its own. A name of the
    IR-agnostic kinds alone (``("add", "sub")``) is a kind set, not an op list; a dict of
    rules (op name -> function) is a walk's rule table, as JAX keeps them."""
    names, out = _op_names(), []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or \
                (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)):
            continue
        value = node.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "frozenset" \
                and value.args:
            value = value.args[0]
        if isinstance(value, (ast.Set, ast.Tuple, ast.List)):
            elts = value.elts
        elif isinstance(value, ast.Dict) and all(isinstance(v, ast.Constant) and
                                                 isinstance(v.value, str) for v in value.values):
            elts = value.keys
        else:
            continue
        strs = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        ops = [s for s in strs if s in names]
        if len(ops) >= 2 and set(ops) - KINDS:
            out.append(f"line {node.lineno}: {ops}")
    return out


@pytest.mark.parametrize("path", [p for p in sorted(PKG.rglob("*.py")) if p not in REGISTRIES
                                  and not str(p.relative_to(PKG)).startswith(IR_FREE)],
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_walk_keeps_an_op_list_of_its_own(path):
    found = op_sets(path)
    assert not found, f"{path.relative_to(PKG)} keeps op names outside the registries: {found}"


def test_the_op_list_check_finds_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('A = frozenset({"rsqrt", "sqrt"})\nB = ("add", "sub")\n'
                 'C = {"stablehlo.add": "add", "stablehlo.multiply": "mul"}\n'
                 'D = {"tanh": lambda x: x, "exp": lambda x: x}\n')
    assert op_sets(f) == ["line 1: ['rsqrt', 'sqrt']",
                          "line 3: ['stablehlo.add', 'stablehlo.multiply']"]
