"""Modules lowered for several platforms: a ``stablehlo.case`` whose branches are the same.

``jax.export.export(f, platforms=["cpu", "cuda", ...])`` makes one module for several
platforms: ``@main`` takes the platform's index first (``jax.global_constant =
"_platform_index"``), and every op with a platform-specific lowering rule — every
convolution among them — is lowered once per platform, as the branches of a
``stablehlo.case`` on that index. Where the rules agree, the branches are the same ops, so
the case computes its branch whatever the index: the pass sees a convolution's result
through an opaque ``case`` and would fold nothing. :func:`inline_uniform_cases` replaces each
such case by its branch (exactly the same computation on every platform); cases whose
branches differ stay as they are, and what they hold is not folded.
"""
from __future__ import annotations

from collections import deque

from hlofold import _compat as C
from .ir import op_name

ir, _, _ = C.mlir()

CASE = "stablehlo.case"


def inline_uniform_cases(module) -> int:
    """Inline, in place, every ``case`` of ``module`` whose branches are the same ops (the
    cases nested in them too); returns how many."""
    count = 0
    for op in module.body.operations:
        if op_name(op) == "func.func":
            for region in op.regions:
                for block in region.blocks:
                    count += _block(block)
    return count


def _block(block) -> int:
    count = 0
    todo = deque(block.operations)
    while todo:
        op = todo.popleft()
        if op_name(op) == CASE and len(op.regions) > 1 and all(
                _same_region(op.regions[0], r) for r in op.regions[1:]):
            todo.extendleft(reversed(_inline(op)))     # the moved ops are looked at in turn
            count += 1
            continue
        for region in op.regions:
            for inner in region.blocks:
                count += _block(inner)
    return count


def _inline(case) -> list:
    """Move the first branch's ops before ``case``, use its returned values for the case's
    results, erase the case; returns the moved ops."""
    block = case.regions[0].blocks[0]
    ops = list(block.operations)
    body, ret = ops[:-1], ops[-1]
    for inner in body:
        inner.move_before(case)
    for res, val in zip(case.results, ret.operands):
        res.replace_all_uses_with(val)
    case.erase()
    return body


def _same_region(a, b, seen: dict | None = None) -> bool:
    """Whether regions ``a`` and ``b`` are the same ops on the same outer values (inner
    values matched by position), attributes and types alike."""
    seen = {} if seen is None else seen
    if len(a.blocks) != len(b.blocks):
        return False
    for ba, bb in zip(a.blocks, b.blocks):
        if len(ba.arguments) != len(bb.arguments) or any(
                str(x.type) != str(y.type) for x, y in zip(ba.arguments, bb.arguments)):
            return False
        seen.update(zip(ba.arguments, bb.arguments))
        oa, ob = list(ba.operations), list(bb.operations)
        if len(oa) != len(ob):
            return False
        for x, y in zip(oa, ob):
            if not _same_op(x, y, seen):
                return False
            seen.update(zip(x.results, y.results))
    return True


def _same_op(x, y, seen: dict) -> bool:
    if op_name(x) != op_name(y) or len(x.operands) != len(y.operands) or \
            len(x.results) != len(y.results) or len(x.regions) != len(y.regions):
        return False
    for u, v in zip(x.operands, y.operands):
        if not (seen[u] == v if u in seen else u == v):
            return False
    if any(str(r.type) != str(s.type) for r, s in zip(x.results, y.results)):
        return False
    ax, ay = x.attributes, y.attributes
    if len(ax) != len(ay):
        return False
    named = {ax[i].name: str(ax[i].attr) for i in range(len(ax))}
    if any(named.get(ay[i].name) != str(ay[i].attr) for i in range(len(ay))):
        return False
    return all(_same_region(r, s, seen) for r, s in zip(x.regions, y.regions))
