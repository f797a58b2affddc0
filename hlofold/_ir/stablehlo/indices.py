"""Integer scalars of a StableHLO module computed on the host: what ``dynamic_slice`` start
indices, loop counters and loop bounds are.

:func:`index_value` evaluates a scalar integer (or predicate) from constants and values given
for some block arguments (one layer of a scanned stack: its counters): the arithmetic JAX
emits for an index (``x[i]`` wraps a negative index with compare/add/select; ``i % L`` is a
call of a private ``remainder`` function), and the final value of a counter of a counted
``stablehlo.while`` (an unrolled scan runs its last layers after the loop, at the counter the
loop ends with). :func:`step_of` is a counter's constant step.
"""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from .ir import is_float, op_name, owner_op, shape_of
from .build import int_constant
from .module import entering_value, private_body, walk

ir, stablehlo, func_dialect = C.mlir()


def _truncated(a: int, b: int) -> int | None:
    """Integer division rounded toward zero (StableHLO's ``divide`` on integers)."""
    return None if b == 0 else (abs(a) // abs(b)) * (1 if (a < 0) == (b < 0) else -1)


_INT_BIN = {"stablehlo.add": lambda a, b: a + b, "stablehlo.subtract": lambda a, b: a - b,
            "stablehlo.multiply": lambda a, b: a * b, "stablehlo.maximum": max,
            "stablehlo.minimum": min, "stablehlo.divide": _truncated,
            # the remainder takes the dividend's sign (JAX's ``%`` adds a select after it)
            "stablehlo.remainder": lambda a, b: None if b == 0 else a - b * _truncated(a, b),
            "stablehlo.and": lambda a, b: a & b, "stablehlo.or": lambda a, b: a | b}
_COMPARE = {"LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
            "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b}


def index_value(value, bound: dict, depth: int = 0, calls=None) -> int | None:
    """The value of a scalar integer (or predicate) computed from constants and ``bound``
    block arguments (a loop counter of one layer): what ``dynamic_slice`` starts are
    (JAX's ``x[i]`` wraps a negative index with compare/add/select). None otherwise."""
    if value in bound:
        return int(np.asarray(bound[value]))
    op = owner_op(value)
    if depth > 32 or shape_of(value) != ():
        return None
    if op is None:        # a private function's argument (called once): the call's operand
        outer = entering_value(value, calls) if calls is not None else None
        return None if outer is None else index_value(outer, bound, depth + 1, calls)
    name = op_name(op)
    if name == "stablehlo.while":
        return _loop_result(op, value, bound, depth)
    if name == "stablehlo.constant":
        a = ir.DenseElementsAttr(op.attributes["value"])
        if not str(ir.RankedTensorType(a.type).element_type).lstrip("u").startswith("i"):
            return None
        return int(ir.IntegerAttr(a.get_splat_value()).value) if a.is_splat else \
            int(np.asarray(ir.DenseIntElementsAttr(a)).reshape(-1)[0])
    if name == "func.call":          # a private function of the index (JAX's ``remainder``,
        body = private_body(op)      # a scan body's counter among the weights it takes)
        if body is None:
            return None
        k = next(i for i, r in enumerate(op.results) if r == value)
        inner = {a: got for a, v in zip(body.arguments, op.operands) if shape_of(v) == ()
                 and (got := index_value(v, bound, depth + 1, calls)) is not None}
        return index_value(list(body.operations)[-1].operands[k], inner, depth + 1, calls)
    args = [index_value(v, bound, depth + 1, calls) for v in op.operands]
    if any(a is None for a in args):
        return None
    if name in _INT_BIN:
        return _INT_BIN[name](*args)
    if name == "stablehlo.negate":
        return -args[0]
    if name == "stablehlo.convert" and not is_float(value):
        return args[0]
    if name == "stablehlo.select":
        return args[1] if args[0] else args[2]
    if name == "stablehlo.clamp":
        return min(max(args[1], args[0]), args[2])
    if name == "stablehlo.compare":
        d = str(op.attributes["comparison_direction"]).split()[-1].rstrip(">")
        f = _COMPARE.get(d)
        return None if f is None else int(f(*args))
    return None


def step_of(value, arg, bound: dict) -> int | None:
    """The constant ``c`` where ``value`` is always ``arg + c``: computed from ``arg`` and
    constants alone (through private functions too: ``fori_loop``'s body returns ``i + 1``,
    an unrolled scan's ``(i + 1) + 1``), the same ``c`` for several values of ``arg``."""
    steps = set()
    for x in (0, 1, 7):
        v = index_value(value, {**bound, arg: x})
        if v is None:
            return None
        steps.add(v - x)
    return steps.pop() if len(steps) == 1 else None


def trip_count(w, bound: dict) -> tuple[int, int, int] | None:
    """``(iterations, the counter's argument number, its start)`` of a ``stablehlo.while``
    whose condition is ``counter < constant``, the counter from a constant start by a
    positive constant step; None otherwise."""
    body, cond = w.regions[1].blocks[0], w.regions[0].blocks[0]
    test = owner_op(list(cond.operations)[-1].operands[0])
    if test is None or op_name(test) != "stablehlo.compare" or \
            str(test.attributes["comparison_direction"]).split()[-1].rstrip(">") != "LT":
        return None
    j = next((k for k, a in enumerate(cond.arguments) if a == test.operands[0]), None)
    end = index_value(test.operands[1], bound)
    if j is None or end is None:
        return None
    start = index_value(w.operands[j], bound)
    step = None if start is None else \
        step_of(list(body.operations)[-1].operands[j], body.arguments[j], bound)
    if not step or step < 0:
        return None
    return max(0, -(-(end - start) // step)), j, start


def _loop_result(w, value, bound: dict, depth: int) -> int | None:
    """A counter's value after a counted ``stablehlo.while`` (``value``: one of its results):
    its start plus the iterations times its step."""
    k = next(i for i, r in enumerate(w.results) if r == value)
    trips = trip_count(w, bound)
    if trips is None:
        return None
    body = w.regions[1].blocks[0]
    start = index_value(w.operands[k], bound, depth + 1)
    step = None if start is None else \
        step_of(list(body.operations)[-1].operands[k], body.arguments[k], bound)
    return None if step is None else start + trips[0] * step


def constant_counters(module) -> int:
    """Each use of a counted ``stablehlo.while``'s final counter (an unrolled scan's last
    layers read their rows there) replaced by a constant of its value, made at the top of
    its function: the same program, whose index is then known wherever it is read. Returns
    how many were replaced."""
    n = 0
    for fop in module.body.operations:
        if op_name(fop) != "func.func" or not fop.regions[0].blocks:
            continue
        entry = fop.regions[0].blocks[0]
        for w in [o for o in walk(entry) if op_name(o) == "stablehlo.while"]:
            for r in w.results:
                if shape_of(r) != () or is_float(r) or next(iter(r.uses), None) is None:
                    continue
                v = index_value(r, {})
                if v is not None:
                    with ir.InsertionPoint.at_block_begin(entry), ir.Location.unknown():
                        c = int_constant(r.type, v)
                    r.replace_all_uses_with(c)
                    n += 1
    return n
