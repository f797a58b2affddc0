"""``fold_stablehlo``: a StableHLO artifact folded, and made ready for quantization.

It reads any artifact (:mod:`hlofold._ir.stablehlo.artifacts`), runs the fold pass
(:mod:`hlofold._fold.stablehlo.fold`), with ``params=`` on the weights bound as constants
(:func:`bind_and_fold`), with ``split=`` into prepare and apply modules
(:mod:`hlofold._fold.stablehlo.split`), then the rewrites asked for
(:mod:`hlofold._quant.stablehlo.driver`), and writes back the same kind of artifact.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np

from hlofold import _compat as C
from hlofold._base.report import FoldReport
from hlofold._fold.stablehlo.checked import check_rewrite, checked
from hlofold._fold.stablehlo.fold import fold_module, fold_module_text
from hlofold._fold.stablehlo.split import split_module
from hlofold._ir.stablehlo import blobs
from hlofold._ir.stablehlo.artifacts import (EXPORT, Artifact, as_given, module_callable,
                                             read_artifact, writable_target, write_artifact)
from hlofold._ir.stablehlo.ir import StableHLOError, numpy_to_dense
from hlofold._ir.stablehlo.module import main_function, parse_module
from hlofold._ir.stablehlo.shardings import argument_shardings, by_type, set_argument_shardings
from hlofold._ir.stablehlo.weights import (argument_index, as_module_aval, bound_values, check_value,
                                           export_arguments, export_calibration, hoist,
                                           set_arguments)
from hlofold._quant.core.smooth import check_alpha, check_calibration
from hlofold._quant.core.rewrites import calibrations, from_options
from hlofold._quant.stablehlo.driver import quantization_ready

ir, stablehlo, _ = C.mlir()

# fold_stablehlo's default for sites whose weights are module arguments
IN_GRAPH_DEFAULT = False


def fold_stablehlo(data, *, params=None, split=None, in_graph: bool = IN_GRAPH_DEFAULT,
                   merge: bool = True, equalize: bool = False, smooth=None,
                   alpha: float | str = 0.5):
    """Fold a StableHLO artifact; returns ``(artifact of the same kind, FoldReport)``.

    Text in, text out; MLIR bytecode in, bytecode out; a StableHLO portable artifact in, a
    portable artifact for the same target version out; a serialized ``jax.export`` file in,
    a serialized file out (an ``Exported`` in, an ``Exported`` out) that
    ``jax.export.deserialize(...).call(...)`` runs. The input is never modified.

    ``params``: values of ``@main`` arguments that are weights (``{"arg3": array, ...}``;
    keys ``3``, ``"3"``, ``"arg3"``), for modules that take their weights as arguments
    (TensorFlow's, PyTorch/XLA's, ``jax.export`` of a function of its parameters). They are
    folded once, on the host, and the result is ``(apply artifact, FoldReport, prepared)``:
    the apply artifact takes the remaining arguments in their order, then the arrays of
    ``prepared`` (folded kernels and biases) — per call it does no more than the original.
    For a ``jax.export`` artifact ``prepared`` are ``jax.Array`` s on the default device,
    ready to pass per call; for text and bytecode they are NumPy arrays (to save, or to hand
    to another runtime): put them on the device once (``jax.device_put``), since a NumPy
    argument is copied to the device on every call.

    ``split``: the ``@main`` arguments that change on every call (``["arg0"]``); the others
    are weights, whose values are not needed. The result is ``(apply artifact, FoldReport,
    prepare artifact)``, both of the input's kind (text, bytecode or portable artifact): run
    ``prepare`` once per set of weights — it takes the weights in their order and returns
    the arrays ``apply`` takes after the per-call arguments, then ``ok`` (a boolean scalar,
    false when a folded kernel or bias is not finite: then run the original module). See
    :mod:`hlofold._fold.stablehlo.split`.

    Without ``params`` or ``split``, a site whose weights are arguments is folded in the
    graph, guarded at run time, only with ``in_graph=True``: that recomputes ``K ⊙ s`` on
    every call. ``merge=False`` keeps sums of parallel branches (each branch's BN folds).

    ``equalize=True`` (with ``params=``, or a module whose weights are constants): after the
    fold, cross-layer equalization of each pair of layers joined by ReLU, bias, pooling or
    padding (``hlofold._quant.stablehlo.pairs``) — the same rule and sweeps as
    ``fold_params(..., equalize=True)``; the outputs are the same in float, the kernels'
    channel ranges equal (for per-tensor quantization). ``report.equalized`` /
    ``report.not_equalized`` say which pairs, and why the other layers were left.
    ``smooth=[inputs, ...]`` (``alpha``): SmoothQuant's scales from the activations these
    calibration inputs give (each the per-call inputs: an array, or a list of them in order),
    moved into the weights: a norm's output gets ``·(1/s)`` (its γ is in the layers after the
    fold), a layer before a gated product its output channels; the layers reading them
    their input rows (``report.smoothed`` / ``report.not_smoothed``);
    ``alpha="search:w4a8"`` chooses each pair's α for that quantization from the
    calibration rows.

    On a JAX whose MLIR bindings changed what this pass reads (``hlofold._compat``), the
    artifact comes back as given (without ``params``/``split``; with them a
    ``CompatError`` says which change), its report naming the change.
    """
    if params is not None and split is not None:
        raise ValueError("params= (fold for these weight values) and split= (a prepare "
                         "module for any weight values) exclude each other")
    if (equalize or smooth is not None) and split is not None:
        raise ValueError(f"{'equalize' if equalize else 'smooth'}= needs the weights' values: "
                         "give them with params=, not split=")
    if smooth is not None:
        alpha = check_alpha(alpha, "hlofold.fold_stablehlo")
        smooth = [list(c) if isinstance(c, (list, tuple)) else [c]
                  for c in check_calibration(smooth, "hlofold.fold_stablehlo")]
    rewrites = from_options(equalize=equalize, smooth=smooth, alpha=alpha)
    off = C.disabled("stablehlo")
    if off is None:
        art = read_artifact(data)          # bad input is the caller's: raised as it is
        try:
            result = _fold(art, data, params, split, in_graph, merge, rewrites)
        except StableHLOError:
            raise
        except Exception as e:
            off = C.as_compat(e, "stablehlo")
            if off is None:
                raise
        else:     # (a fold that differs from the module given raises with params=/split=)
            if art.target is not None and writable_target(art.target) != art.target:
                result[1].compat.append(
                    f"written for StableHLO {writable_target(art.target)}: the artifact "
                    f"targets {art.target}, which these bindings do not write")
            if result[1].equalized or result[1].smoothed:
                check_rewrite(data, result, params)     # (on any JAX, as fold_params does)
            return checked(data, result, params, split) if C.untested() else result
    if params is not None or split is not None:
        raise off       # their results take other arguments than the module given
    return as_given(data), FoldReport([], running=f"the module as given ({off})",
                                        compat=[str(off)])


def _fold(art: Artifact, data, params, split, in_graph, merge=True, rewrites=()):
    if params is not None:
        return _fold_with_params(art, data, params, merge, rewrites)
    if split is not None:
        if art.kind == EXPORT:
            raise StableHLOError("split= makes two modules; a jax.export artifact is one "
                                 "function: fold it with params=, or use hlofold.fold(...)"
                                 ".split() on the JAX function")
        prepare, apply, report = split_module(art.module, split, merge)
        return write_artifact(apply, art), report, write_artifact(prepare, art)
    module, report = fold_module_text(art.module, in_graph, merge)
    if art.kind == EXPORT:
        rewrites = calibrations(rewrites, lambda c: export_calibration(art.exported, {}, c))
    with module.context, ir.Location.unknown():
        changed = quantization_ready(module, report, {}, rewrites, hoist)
    if not report.num_folded and not changed:   # the artifact exactly as given
        return as_given(data), report
    with module.context:
        if art.kind != EXPORT:
            return write_artifact(module, art), report
        new = dataclasses.replace(art.exported,
                                  mlir_module_serialized=C.module_to_portable_artifact(module))
    if isinstance(data, jax.export.Exported):
        return new, report
    return bytes(new.serialize()), report


def _fold_with_params(art: Artifact, data, params, merge=True, rewrites=()):
    if art.kind != EXPORT:
        module, report, prepared, _ = bind_and_fold(art.module, params, merge, rewrites)
        with module.context:
            return write_artifact(module, art), report, prepared
    exp = art.exported
    by_arg, lead = export_arguments(exp, params)
    rewrites = calibrations(rewrites, lambda c: export_calibration(
        exp, {argument_index(k) for k in params}, c))
    module, report, prepared, kept = bind_and_fold(art.module, by_arg, merge, rewrites)
    with module.context:
        n_module = len(main_function(module).regions[0].blocks[0].arguments)
        assert len(kept) + len(prepared) == n_module and kept[:lead] == list(range(lead))
        bound = sorted(argument_index(k) for k in params)
        rest = [i for i in range(len(exp.in_avals)) if i not in bound]
        taken = [exp.module_kept_var_idx[m - lead] for m in kept[lead:]]
        used = [rest.index(i) for i in taken] + [len(rest) + j for j in range(len(prepared))]
        new = C.exported_with_inputs(exp, rest, prepared, C.module_to_portable_artifact(module),
                                     new_from=[_origin(exp, bound, v) for v in prepared],
                                     used=used)
    prepared = [jax.device_put(v) for v in prepared]
    if isinstance(data, jax.export.Exported):
        return new, report, prepared
    return bytes(new.serialize()), report, prepared


def _origin(exp, bound: list[int], value) -> int | None:
    """The bound input whose sharding a prepared ``value`` takes: one of its shape and dtype,
    where all such inputs that split over a mesh axis are sharded alike — a replicated one
    yields to them, as the compiler's propagation does (β replicated beside γ, μ, σ² on
    "model" gives "model"; the module's own attributes: ``shardings.agreed``)."""
    shardings = C.exported_input_shardings(exp)
    avals = {i: as_module_aval(exp.in_avals[i]) for i in bound}
    same = [i for i in bound if tuple(avals[i].shape) == tuple(np.shape(value))
            and np.dtype(avals[i].dtype) == np.asarray(value).dtype]
    split = [i for i in same if shardings[i] is not None and not _replicated(shardings[i])]
    pool = split or same
    if not pool or shardings[pool[0]] is None or len({str(shardings[i]) for i in pool}) != 1:
        return None
    return pool[0]


def _replicated(sharding) -> bool:
    """Whether an export's input sharding (named, or HLO) splits over no mesh axis."""
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        return all(p is None or p == () for p in spec)
    rep = getattr(sharding, "is_replicated", None)
    return bool(rep()) if callable(rep) else False


def report_stablehlo(data, in_graph: bool = IN_GRAPH_DEFAULT, merge: bool = True) -> FoldReport:
    """What ``fold_stablehlo`` would fold, and why not the rest (nothing is written)."""
    return fold_stablehlo(data, in_graph=in_graph, merge=merge)[1]



def bind_and_fold(text_or_bytes, params: Mapping[Any, Any], merge: bool = True,
                  rewrites: tuple = ()) -> tuple[Any, FoldReport, list, list[int]]:
    """``(apply module, report, prepared values, kept)``: ``params`` (module argument →
    value) bound and folded, then ``rewrites`` (:mod:`hlofold._quant.core.rewrites`; a
    :class:`Smooth`'s calibration inputs lists of the remaining arguments), the folded constants
    hoisted into trailing arguments. ``kept``: the original argument numbers the apply
    module still takes first, in order."""
    values = bound_values(params)
    module = parse_module(text_or_bytes)
    # the weights bound, and the constants the fold makes, held by reference (not copied
    # into MLIR) until hoisted; what stays in the module becomes dense when this ends
    with module.context, ir.Location.unknown(), blobs.scope(module):
        main = main_function(module)
        block = main.regions[0].blocks[0]
        n = len(block.arguments)
        for i, v in values.items():
            check_value(i, v, block.arguments[i].type if i < n else None, n)
        shardings = argument_shardings(main)
        removed = [(block.arguments[i].type, shardings[i]) for i in sorted(values)]
        names = {}
        with ir.InsertionPoint.at_block_begin(block):
            for i, v in sorted(values.items()):
                arg = block.arguments[i]
                const = stablehlo.ConstantOp(numpy_to_dense(
                    v, ir.RankedTensorType(arg.type).element_type, given=True))
                names[const.operation] = f"arg{i}"
                arg.replace_all_uses_with(const.result)
        kept = [i for i in range(n) if i not in values]
        set_arguments(main, kept)
        # (a site whose weights are not all known now is left as it is: in the graph its
        # rescale would run on every call, slower than the module given)
        report = fold_module(module, in_graph=False, merge=merge)
        quantization_ready(module, report, names, rewrites, hoist)
        prepared = hoist(main)
        hoisted = list(block.arguments)[len(kept):]     # the prepared weights: as their origin
        set_argument_shardings(main, {len(kept) + j: sh
                                      for j, sh in by_type(hoisted, removed).items()})
        if not module.operation.verify():
            raise AssertionError("hlofold produced an invalid module")   # pragma: no cover
    return module, report, prepared, kept


PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def run_artifact(artifact, platform: str | None = None, *, in_shardings=None,
                 out_shardings=None):
    """A function that runs a StableHLO artifact through JAX: ``hlofold.callable``.

    ``artifact``: anything ``fold_stablehlo`` takes or returns — MLIR text, MLIR bytecode, a
    StableHLO portable artifact, a serialized ``jax.export`` file, an ``Exported``, or the
    path of a file holding one. The function takes ``@main``'s inputs as arrays, flat and in
    order (for a ``jax.export`` artifact: the exported function's flat inputs; for an apply
    module from ``params=``: the remaining inputs, then the prepared arrays) and returns its
    results. ``platform``: what a bare module is compiled for (``"cpu"``, ``"cuda"``,
    ``"rocm"``, ``"tpu"``; default: the platform JAX runs on here); a ``jax.export``
    artifact runs on the platforms it was exported for. A sharded module (Shardy) runs
    sharded when given the ``NamedSharding`` s of its inputs and outputs, flat, as for
    ``jax.jit``.

    Bad input raises ``hlofold.StableHLOError`` (or ``TypeError`` for a value that is no
    artifact) naming the problem; nothing given is modified.
    """
    if platform is None:
        platform = jax.export.default_export_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}: expected one of {', '.join(PLATFORMS)}")
    if (in_shardings is None) != (out_shardings is None):
        raise ValueError("in_shardings= and out_shardings= go together")
    return module_callable(artifact, platform, in_shardings, out_shardings)
