"""Cross-layer equalization and smoothing of a StableHLO function's constants:
``fold_stablehlo(..., params=, equalize=True)`` and ``smooth=[inputs...]``.

Run after the fold (BatchNorms are in the kernels and biases, a norm's γ in the layers it
feeds) and before the weights are hoisted into arguments: the pairs are read by
:mod:`hlofold._quant.stablehlo.pairs`, the scales computed by the core
(:mod:`hlofold._quant.core.equalize`: the same sweeps, the same SmoothQuant scales as
``fold_params``), and each changed constant written anew, rounded once to its type.
Smoothing measures what each pair's second layers read on the calibration inputs (a copy of
the function, its weights hoisted, those values returned too, run by JAX); where a norm's
output feeds the layers (γ already moved into them by the fold), it puts ``·(1/s)`` there — a
multiply, as the norm's γ was. The function computes the same outputs (the caller checks).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hlofold import _compat as C
from hlofold._base.reasons import Reason
from hlofold._ir.stablehlo.artifacts import module_callable
from hlofold._quant.core.equalize import EqualizedPair, NotEqualized, equalize, exact_in, record
from hlofold._quant.core.smooth import Observed, smooth
from hlofold._ir.stablehlo.build import broadcast
from hlofold._ir.stablehlo.ir import (StableHLOError, dense_to_numpy, elem_type, float_dtype,
                                      numpy_to_dense, op_name, owner_op, shape_of)
from .residual import find_streams
from hlofold._ir.stablehlo.module import main_function
from .pairs import (LOOP_LAYERS, NESTED_LAYERS, ROOTS, Refused, find_pairs, layer, loop_layers,
                    norm_sites, where)

ir, stablehlo, func_dialect = C.mlir()


def _name(w, names: dict) -> str:
    got = names.get(w.const)
    if got is None:
        role = "kernel" if w.reader is not None and op_name(w.reader) in ROOTS else "bias"
        named = w.reader is not None and layer(w.reader) != op_name(w.reader)
        got = f"the folded {role} of " + (layer(w.reader) if named else where(w.reader)) \
            if w.reader is not None else "a constant"
    return got


def _readable(found, refused, weights):
    """The pairs whose weights are floating point and readable, and their values."""
    values, ok = {}, []
    for f in found:
        got = {k: dense_to_numpy(weights[k].const.attributes["value"], copy=False)
               for k in f.pair.keys() if k in weights}      # (views: read pair by pair)
        if any(v is None or float_dtype(elem_type(weights[k].const.results[0])) is None
               for k, v in got.items()):
            refused.append(Refused(f.pair.first, f.at, Reason(
                "pair-not-float", "a weight that is not floating point (or not readable)")))
            continue
        values.update(got)
        ok.append(f)
    return values, ok


def _write(weights: dict, new: dict, values: dict) -> None:
    """Each changed constant written anew, rounded once to its type."""
    for k, v in new.items():
        _write_one(weights, k, v.astype(values[k].dtype))


def _write_one(weights: dict, k: str, v: np.ndarray) -> np.ndarray:
    """Constant ``k`` replaced by one of ``v`` (its dtype already); ``v`` back."""
    if k in weights:
        old = weights[k].const
        with ir.InsertionPoint(old):
            c = stablehlo.ConstantOp(numpy_to_dense(v, elem_type(old.results[0])))
        old.results[0].replace_all_uses_with(c.result)
        old.erase()
        weights[k].const = c.operation       # (a later pair writes it again)
    return v


def _pow2(found, weights: dict, values: dict) -> bool:
    """Whether a weight is of a low-precision float, or is widened from one, or a norm site
    multiplies such activations: then every scale is a power of two (exact in any float
    type: the module computes what it computed, bit for bit)."""
    for f in found:
        if f.low:              # (a value between the layers; a norm site's activations)
            return True
        for k in f.pair.keys():
            w = weights.get(k)
            if (w is not None and w.converted) or exact_in(np.asarray(values[k]).dtype):
                return True
    return False


def _records(ok, done, called, kind):
    return [record(d, called[f.pair.first], [called[s.key] for s in f.pair.seconds],
                   [called[b] for b, _ in f.pair.biases], f.location, kind,
                   [called[w] for w, _ in f.pair.writers])
            for f, d in zip(ok, done)]


def _left_starts(refused, weights, names) -> list[NotEqualized]:
    return [NotEqualized(_name(weights[r.key], names) if r.key else "a layer's kernel",
                         where(r.at), r.reason) for r in refused]


def _left(func, refused, weights, names) -> list[NotEqualized]:
    """The starts refused, and the layers of each loop (not read here), with the reasons."""
    return _left_starts(refused, weights, names) + [
        NotEqualized("the layers of a loop", where(op),
                     Reason("pair-loop", LOOP_LAYERS.format(n=n)))
        if op_name(op) == "stablehlo.while" else
        NotEqualized(f"the layers of a {op_name(op)}", where(op),
                     Reason("pair-loop", NESTED_LAYERS.format(n=n, what=op_name(op))))
        for op, n in loop_layers(func)]


def equalize_function(func, names: dict | None = None, loops: bool = True
                      ) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """Equalize the pairs of ``func`` in place; ``names``: constant op -> what the user calls
    it (``"arg3"``: a bound argument). Returns what was equalized and what was not, why
    (``loops``: the layers of its loops among the latter)."""
    ok, done, called, left = equalized_pairs(func, names or {}, loops)
    return _records(ok, done, called, "equalized"), left


def equalized_pairs(func, names: dict, loops: bool = True) -> tuple[list, list, dict, list]:
    """:func:`equalize_function`'s work: ``(the pairs equalized, what was done to each
    (:class:`~hlofold._quant.core.equalize.Done`), what the weights are called, what was left)``
    — a scanned stack's layers (:mod:`.loop_pairs`) merged per pair from these."""
    found, refused, weights = find_pairs(func)
    found = found + find_streams(func, found, refused, weights)
    values, ok = _readable(found, refused, weights)
    left = _left(func, refused, weights, names) if loops else _left_starts(refused, weights,
                                                                            names)
    for f in ok:
        f.location = where(f.at)
    if not ok:
        return [], [], {}, left
    called = {k: _name(w, names) for k, w in weights.items()}    # (before a write)
    new, done = equalize(values, [f.pair for f in ok], _pow2(ok, weights, values))
    _write(weights, new, values)
    return ok, done, called, left


@dataclasses.dataclass
class Sites:
    """What smoothing a function reads: its pairs and norm sites in program order (as
    ``fold_params`` takes them), the weights they name and their values, what the weights
    are called, and what was left (with the reasons)."""

    every: list
    sites: list
    weights: dict
    values: dict
    called: dict
    left: list


def smoothing_sites(func, names: dict, loops: bool = True) -> Sites:
    """The pairs of ``func`` to smooth (``loops``: the layers of its loops among those
    left)."""
    found, refused, weights = find_pairs(func)
    values, ok = _readable(found, refused, weights)
    sites = norm_sites(func, weights, {s.key for f in ok for s in f.pair.seconds})
    for f in sites:
        values.update({s.key: dense_to_numpy(weights[s.key].const.attributes["value"],
                                             copy=False) for s in f.pair.seconds})
        values[f.pair.first] = np.ones(shape_of(f.end)[f.end_axis], np.float32)
    left = _left(func, refused, weights, names) if loops else \
        _left_starts(refused, weights, names)
    order = {op: i for i, op in enumerate(func.regions[0].blocks[0].operations)}
    every = sorted(ok + sites, key=lambda f: order[f.at])   # (program order: as fold_params)
    for f in every:
        f.location = where(f.at)
    called = {k: _name(w, names) for k, w in weights.items()}      # (before a write)
    called.update({f.pair.first: f"the norm output at {f.location}" for f in sites})
    return Sites(every, sites, weights, values, called, left)


def apply_smoothing(s: Sites, seen: list[Observed], alpha: float) -> list:
    """SmoothQuant's scales from what the calibration saw (``seen``, one per pair of
    ``s.every``) written into the function: each pair's constants as it is done (no float64
    copy of the model held), a ``·(1/s)`` multiply where a norm's output is read. Returns
    what was done to each pair."""
    weights, values = s.weights, s.values
    new, done = smooth(values, [f.pair for f in s.every], seen, alpha,
                       store=lambda k, v: _write_one(weights, k, v.astype(values[k].dtype)),
                       pow2=_pow2(s.every, weights, values))
    for f in s.sites:                  # ·(1/s) where the norm's output is read
        v, producer = f.end, owner_op(f.end)
        readers = [u.owner for u in v.uses]
        with ir.InsertionPoint(producer):
            vec = stablehlo.ConstantOp(numpy_to_dense(new[f.pair.first], elem_type(v))).result
            scale = broadcast(v.type, vec, [f.end_axis])
            mul = stablehlo.MulOp(v, scale)
        mul.operation.move_after(producer)
        for r in readers:
            for i, o in enumerate(r.operands):
                if o == v:
                    r.operands[i] = mul.result
    return done


def smooth_function(module, names: dict, calibration: list, alpha: float, hoist
                    ) -> tuple[list[EqualizedPair], list[NotEqualized]]:
    """SmoothQuant's scales ``s_j = max|X_j|^α / max|W_j|^(1−α)`` moved into the module's
    ``@main``: each pair's first layer divided (or, after a norm, a ``·(1/s)`` put there),
    its second layers' input rows multiplied. ``calibration``: argument lists of the
    function's remaining (not bound) arguments; ``hoist``: the weights' hoisting
    (``_ir.stablehlo.weights``), used on a copy to run it."""
    func = main_function(module)
    s = smoothing_sites(func, names)
    if not s.every:
        return [], s.left
    seen = [Observed.for_alpha(alpha) for _ in s.every]
    for got in watched_runs(module, func, [f.end for f in s.every], calibration, hoist):
        for f, x, o in zip(s.every, got, seen):
            o.add(x, f.end_axis)
    done = apply_smoothing(s, seen, alpha)
    return _records(s.every, done, s.called, "smoothed"), s.left


def returning_also(fop, values: list) -> None:
    """``fop`` returns ``values`` (of its body) after what it returns."""
    ret = list(fop.regions[0].blocks[0].operations)[-1]
    with ir.InsertionPoint(ret):
        func_dialect.ReturnOp(list(ret.operands) + list(values))
    ret.erase()
    ftype = ir.FunctionType(ir.TypeAttr(fop.attributes["function_type"]).value)
    fop.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
        list(ftype.inputs), list(ftype.results) + [v.type for v in values]))
    if "res_attrs" in fop.attributes:
        fop.attributes["res_attrs"] = ir.ArrayAttr.get(
            list(ir.ArrayAttr(fop.attributes["res_attrs"])) +
            [ir.DictAttr.get({})] * len(values))


def watching_copy(module, func, watch: list):
    """A copy of ``module`` whose ``func`` (found by name) also returns the values ``watch``
    (of ``func``'s top block: op results or its arguments): ``(copy, its func)``."""
    block = func.regions[0].blocks[0]
    index = {op: i for i, op in enumerate(block.operations)}
    at = [("arg", ir.BlockArgument(v).arg_number) if owner_op(v) is None else
          (index[owner_op(v)], ir.OpResult(v).result_number) for v in watch]
    name = ir.StringAttr(func.attributes["sym_name"]).value
    copy = module.operation.clone()
    cfunc = next(op for op in copy.regions[0].blocks[0].operations
                 if op_name(op) == "func.func" and
                 ir.StringAttr(op.attributes["sym_name"]).value == name)
    cblock = cfunc.regions[0].blocks[0]
    ops = list(cblock.operations)
    returning_also(cfunc, [cblock.arguments[j] if i == "arg" else ops[i].results[j]
                           for i, j in at])
    return copy, cfunc


def watched_runs(module, func, watch: list, calibration: list, hoist):
    """For each calibration input (the function's remaining arguments), the values
    ``watch`` take: a copy of the module returns them too, its weights hoisted (no large
    constant is printed), and JAX runs it."""
    copy, cfunc = watching_copy(module, func, watch)
    takes = [tuple(ir.RankedTensorType(a.type).shape)
             for a in cfunc.regions[0].blocks[0].arguments]
    prepared = hoist(cfunc, copy=False)
    run = module_callable(str(copy))
    for n, args in enumerate(calibration):
        given = [tuple(np.shape(a)) for a in args]
        if given != takes[:len(given)]:
            raise StableHLOError(
                f"smooth= input {n} has shapes {given}, the module's per-call inputs "
                f"{takes[:len(given)]}: a module's shapes are fixed (unlike fold_params, "
                f"which traces the model at each input's shapes); give calibration inputs "
                f"of its shapes")
        out = run(*args, *prepared)
        yield [np.asarray(x) for x in out[len(out) - len(watch):]]
