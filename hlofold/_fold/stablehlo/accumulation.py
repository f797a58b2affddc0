"""``(L, D)`` of a StableHLO module for the tolerance model (:mod:`hlofold._base.tolerance`):
the longest accumulation of its convolutions and dots, and the most of them on one path
(private functions counted where they are called, regions where they are)."""
from __future__ import annotations

import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo.indices import trip_count
from hlofold._base.tolerance import narrowest
from hlofold._ir.stablehlo.ir import ROOTS, elem_type, float_dtype
from .patterns import dot_dims


def module_accumulation(module) -> tuple[int, int]:
    """``(L, D)`` of a parsed module, from its ``main`` function."""
    funcs = {str(f.attributes["sym_name"]).strip('"'): f
             for f in module.body.operations if "sym_name" in f.attributes}
    main = funcs.get("main") or next(iter(funcs.values()))
    return _region_accumulation(main.regions[0], funcs, {})


def _region_accumulation(region, funcs, memo) -> tuple[int, int]:
    longest, deepest, depth = 1, 0, {}
    for block in region.blocks:
        for op in block.operations:
            name = op.operation.name
            d = max((depth.get(v, 0) for v in op.operands), default=0)
            acc, inner = 1, []
            if name in ROOTS:
                acc = _one_root(op)
            elif name == "func.call":
                callee = str(op.attributes["callee"]).lstrip("@")
                if callee in funcs:
                    if callee not in memo:
                        memo[callee] = (1, 0)        # recursion guard
                        memo[callee] = _region_accumulation(funcs[callee].regions[0],
                                                            funcs, memo)
                    inner.append(memo[callee])
            inner += [_region_accumulation(r, funcs, memo) for r in op.operation.regions]
            longest = max([longest, acc] + [a for a, _ in inner])
            d += (name in ROOTS) + max((k for _, k in inner), default=0) * _trips(op)
            for r in op.results:
                depth[r] = d
            deepest = max(deepest, d)
    return longest, deepest


def module_computes_in(module) -> np.dtype | None:
    """The narrowest float type a convolution or dot of ``module`` (any function, any region)
    reads or writes: the precision the module computes in (``_base.tolerance``'s
    ``compute``)."""
    found = []

    def walk(op):
        if op.operation.name in ROOTS:
            found.extend(float_dtype(elem_type(v)) for v in (*list(op.operands)[:2],
                                                             *op.results))
        for region in op.operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner)
    for f in module.body.operations:
        walk(f)
    return narrowest(found)


def module_output_profiles(module) -> list[tuple[int, int, np.dtype | None]]:
    """``(L, D, compute)`` of each result of ``@main``, from the convolutions and dots that
    result is computed from alone (regions and private calls counted whole where they run)."""
    funcs = {str(f.attributes["sym_name"]).strip('"'): f
             for f in module.body.operations if "sym_name" in f.attributes}
    main = funcs.get("main") or next(iter(funcs.values()))
    memo: dict = {}
    state: dict = {}
    none = (1, 0, None)
    block = main.regions[0].blocks[0]
    ret = None
    for op in block.operations:
        name = op.operation.name
        if name == "func.return":
            ret = op
            continue
        ins = [state.get(v, none) for v in op.operands]
        acc = max((s[0] for s in ins), default=1)
        d = max((s[1] for s in ins), default=0)
        found = [s[2] for s in ins]
        if name in ROOTS:
            acc, d = max(acc, _one_root(op)), d + 1
            found += [float_dtype(elem_type(v)) for v in (*list(op.operands)[:2], *op.results)]
        elif name == "func.call" or len(op.operation.regions):
            a, k = _region_accumulation_of_op(op, funcs, memo)
            acc, d = max(acc, a), d + k
            found.append(_computes_in_op(op, funcs))
        for r in op.results:
            state[r] = (acc, d, narrowest(found))
    return [state.get(v, none) for v in (ret.operands if ret is not None else [])]


def _region_accumulation_of_op(op, funcs, memo) -> tuple[int, int]:
    """``(L, D)`` of what one op of ``@main`` runs in its regions or its callee (whole)."""
    holder = op.operation
    name = holder.name
    if name == "func.call":
        callee = str(op.attributes["callee"]).lstrip("@")
        if callee not in funcs:
            return 1, 0
        if callee not in memo:
            memo[callee] = (1, 0)
            memo[callee] = _region_accumulation(funcs[callee].regions[0], funcs, memo)
        return memo[callee]
    got = [_region_accumulation(r, funcs, memo) for r in holder.regions]
    return max((a for a, _ in got), default=1), max((k for _, k in got),
                                                    default=0) * _trips(op)


def _trips(op) -> int:
    """How many times ``op`` runs its regions one after another: a counted loop's trip
    count (its layers are as deep as the same layers unrolled), else once."""
    if op.operation.name != "stablehlo.while":
        return 1
    got = trip_count(op, {})
    return max(1, got[0]) if got else 1


def _one_root(op) -> int:
    """The accumulation length of one convolution or dot."""
    ir, stablehlo = C.mlir()[0], C.mlir()[1]
    if op.operation.name == "stablehlo.convolution":
        k = ir.RankedTensorType(op.operands[1].type).shape
        dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
        return int(np.prod(k)) // max(1, k[dn.kernel_output_feature_dimension])
    lhs = ir.RankedTensorType(op.operands[0].type).shape
    return int(np.prod([lhs[i] for i in dot_dims(op)[1]]))


def _computes_in_op(op, funcs) -> np.dtype | None:
    """The narrowest float type a root inside ``op``'s regions or callee computes in."""
    found, seen = [], set()

    def walk(o):
        if o.operation.name in ROOTS:
            found.extend(float_dtype(elem_type(v)) for v in (*list(o.operands)[:2],
                                                             *o.results))
        if o.operation.name == "func.call":
            callee = str(o.attributes["callee"]).lstrip("@")
            if callee in funcs and callee not in seen:
                seen.add(callee)
                walk(funcs[callee])
        for region in o.operation.regions:
            for b in region.blocks:
                for inner in b.operations:
                    walk(inner)
    walk(op)
    return narrowest(found)
