"""``(L, D)`` of a StableHLO module for the tolerance model (:mod:`hlofold._core.tolerance`):
the longest accumulation of its convolutions and dots, and the most of them on one path
(private functions counted where they are called, regions where they are)."""
from __future__ import annotations

import numpy as np

from .. import _compat as C
from .._core.tolerance import narrowest
from .ir import DOTS, ROOTS, elem_type, float_dtype
from .patterns import dot_dims


def module_accumulation(module) -> tuple[int, int]:
    """``(L, D)`` of a parsed module, from its ``main`` function."""
    funcs = {str(f.attributes["sym_name"]).strip('"'): f
             for f in module.body.operations if "sym_name" in f.attributes}
    main = funcs.get("main") or next(iter(funcs.values()))
    return _region_accumulation(main.regions[0], funcs, {})


def _region_accumulation(region, funcs, memo) -> tuple[int, int]:
    ir, stablehlo = C.mlir()[0], C.mlir()[1]
    longest, deepest, depth = 1, 0, {}
    for block in region.blocks:
        for op in block.operations:
            name = op.operation.name
            d = max((depth.get(v, 0) for v in op.operands), default=0)
            acc, inner = 1, []
            if name == "stablehlo.convolution":
                k = ir.RankedTensorType(op.operands[1].type).shape
                dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
                acc = int(np.prod(k)) // max(1, k[dn.kernel_output_feature_dimension])
            elif name in DOTS:
                lhs = ir.RankedTensorType(op.operands[0].type).shape
                acc = int(np.prod([lhs[i] for i in dot_dims(op)[1]]))
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
            d += (name in ROOTS) + max((k for _, k in inner), default=0)
            for r in op.results:
                depth[r] = d
            deepest = max(deepest, d)
    return longest, deepest


def module_profile(module) -> tuple[int, int, np.dtype | None]:
    """``(L, D, compute)`` of a parsed module: what :mod:`hlofold._core.tolerance` measures a
    fold by (:func:`module_accumulation`, :func:`module_computes_in`)."""
    return (*module_accumulation(module), module_computes_in(module))


def module_computes_in(module) -> np.dtype | None:
    """The narrowest float type a convolution or dot of ``module`` (any function, any region)
    reads or writes: the precision the module computes in (``_core.tolerance``'s
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
