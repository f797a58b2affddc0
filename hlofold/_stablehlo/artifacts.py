"""StableHLO artifacts: MLIR text, MLIR bytecode, StableHLO portable artifacts (VHLO
bytecode), serialized ``jax.export`` files.

``fold_stablehlo`` takes any of them (or an in-memory ``jax.export.Exported``), runs the
StableHLO pass, and gives back the same kind of artifact. ``module_callable`` turns a
StableHLO module into a function JAX can run on any backend, for verification.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from .. import _compat as C
from .._core.smoothquant import check_alpha
from .._core.report import FoldReport
from .ir import StableHLOError, element_dtype
from .module import main_function
from .fold import fold_module_text
from .split import split_module
from .checked import checked
from .equalize import quantization_ready
from .weights import (argument_index, bind_and_fold, export_arguments,
                      export_calibration, hoist)

ir, stablehlo, _ = C.mlir()

TEXT, BYTECODE, EXPORT = "mlir-text", "mlir-bytecode", "jax-export"
PORTABLE = "stablehlo-portable"   # VHLO bytecode: stablehlo.serialize_portable_artifact
# fold_stablehlo's default for sites whose weights are module arguments
IN_GRAPH_DEFAULT = False
_MLIR_MAGIC = b"ML\xefR"


@dataclasses.dataclass
class Artifact:
    kind: str
    module: Any                   # str (text) or bytes (bytecode) of the StableHLO module
    exported: Any = None          # the jax.export.Exported, for EXPORT
    target: str | None = None     # the StableHLO version a PORTABLE artifact targets


def read_artifact(data) -> Artifact:
    """Recognize ``data`` (bytes, str, Exported, or a path) and return its module."""
    if isinstance(data, os.PathLike):
        data = _read_file(os.fspath(data))
    if isinstance(data, jax.export.Exported):
        return Artifact(EXPORT, data.mlir_module(), data)
    if isinstance(data, str):
        if "\n" not in data and os.path.isfile(data):   # a path (its name may say "module")
            return read_artifact(_read_file(data))
        if "func.func" in data or "module" in data:
            return Artifact(TEXT, data)
        raise StableHLOError("text that is not an MLIR module (no module or func.func)")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected StableHLO text, bytes, a path or a jax.export.Exported, "
                        f"got {type(data).__name__}")
    data = bytes(data)
    if not data.strip():
        raise StableHLOError("empty input")
    if data.startswith(_MLIR_MAGIC):
        target = _portable_target(data)
        if target is None:
            return Artifact(BYTECODE, data)
        return Artifact(PORTABLE, _from_portable(data), target=target)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and ("func.func" in text or "module" in text):
        return Artifact(TEXT, text)
    try:
        exp = jax.export.deserialize(bytearray(data))
        return Artifact(EXPORT, exp.mlir_module(), exp)
    except Exception:
        pass
    raise StableHLOError("unknown artifact: not MLIR text, MLIR bytecode or a serialized "
                         "jax.export file")


def _portable_target(data: bytes) -> str | None:
    """The target version of a StableHLO portable artifact (``"1.9.3"``), None for other
    MLIR bytecode. The bytecode's producer string, after the magic and a one-byte version,
    is ``StableHLO_v<target>``."""
    head = data[5:64]
    if not head.startswith(b"StableHLO_v"):
        return None
    return head[len(b"StableHLO_v"):].split(b"\0", 1)[0].decode("ascii", "replace")


def _from_portable(data: bytes) -> bytes:
    """The StableHLO (MLIR bytecode) of a portable artifact."""
    ctx = C.mlir_context()
    with ctx:
        try:
            module = stablehlo.deserialize_portable_artifact(ctx, data)
        except Exception as e:
            detail = " ".join(l.strip() for l in str(e).splitlines()[:3])
            raise StableHLOError(f"unreadable StableHLO portable artifact: {detail}") from None
        return _module_bytes(module, True)


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise StableHLOError(f"cannot read {path}: {e.strerror}") from None


def _module_bytes(module, as_bytecode: bool, portable: str | None = None):
    """Text, MLIR bytecode, or (``portable``: a target version) a portable artifact."""
    if portable is not None:
        return bytes(stablehlo.serialize_portable_artifact(module, portable))
    if not as_bytecode:       # (verified already: fold_module checks what it wrote; the
        # same text printed as bytes and decoded once: ~20 % faster than a str from the
        # bindings for a module of 1 MB)
        return module.operation.get_asm(binary=True, assume_verified=True).decode()
    import io
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    return buf.getvalue()


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
    :mod:`hlofold._stablehlo.split`.

    Without ``params`` or ``split``, a site whose weights are arguments is folded in the
    graph, guarded at run time, only with ``in_graph=True``: that recomputes ``K ⊙ s`` on
    every call. ``merge=False`` keeps sums of parallel branches (each branch's BN folds).

    ``equalize=True`` (with ``params=``, or a module whose weights are constants): after the
    fold, cross-layer equalization of each pair of layers joined by ReLU, bias, pooling or
    padding (``hlofold._stablehlo.pairs``) — the same rule and sweeps as
    ``fold_params(..., equalize=True)``; the outputs are the same in float, the kernels'
    channel ranges equal (for per-tensor quantization). ``report.equalized`` /
    ``report.not_equalized`` say which pairs, and why the other layers were left.
    ``smooth=[inputs, ...]`` (``alpha``): SmoothQuant's scales from the activations these
    calibration inputs give (each the per-call inputs: an array, or a list of them in order),
    moved into the weights: a norm's output gets ``·(1/s)`` (its γ is in the layers after the
    fold), a layer before a gated product its output channels; the layers reading them
    their input rows (records of kind ``"smoothed"``); ``alpha="search:w4a8"`` chooses
    each pair's α for that quantization from the calibration rows.

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
        smooth = [list(c) if isinstance(c, (list, tuple)) else [c] for c in smooth]
        if not smooth:
            raise ValueError("smooth= needs at least one calibration input")
    off = C.disabled("stablehlo")
    if off is None:
        art = read_artifact(data)          # bad input is the caller's: raised as it is
        try:
            result = _fold(art, data, params, split, in_graph, merge, equalize,
                           (smooth, alpha))
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
            return checked(data, result, params, split) if C.untested() else result
    if params is not None or split is not None:
        raise off       # their results take other arguments than the module given
    return as_given(data), FoldReport([], running=f"the module as given ({off})",
                                        compat=[str(off)])


def as_given(data):
    """``data`` as the kind fold_stablehlo returns for it, read without the bindings (a path:
    the file's text, or its bytes)."""
    if isinstance(data, os.PathLike) or (isinstance(data, str) and "\n" not in data
                                         and os.path.isfile(data)):
        raw = _read_file(os.fspath(data))
        if raw.startswith(_MLIR_MAGIC):
            return raw
        try:
            text = raw.decode("utf-8")
            return text if ("func.func" in text or "module" in text) else raw
        except UnicodeDecodeError:
            return raw
    return bytes(data) if isinstance(data, (bytearray, memoryview)) else data


def _fold(art: Artifact, data, params, split, in_graph, merge=True, equalize=False,
          smoothing=(None, 0.5)):
    if params is not None:
        return _fold_with_params(art, data, params, merge, equalize, smoothing)
    if split is not None:
        if art.kind == EXPORT:
            raise StableHLOError("split= makes two modules; a jax.export artifact is one "
                                 "function: fold it with params=, or use hlofold.fold(...)"
                                 ".split() on the JAX function")
        prepare, apply, report = split_module(art.module, split, merge)
        return _write(apply, art), report, _write(prepare, art)
    module, report = fold_module_text(art.module, in_graph, merge)
    calib = smoothing[0] if smoothing[0] is None or art.kind != EXPORT else \
        export_calibration(art.exported, {}, smoothing[0])
    with module.context, ir.Location.unknown():
        quantization_ready(module, report, {}, equalize, calib, smoothing[1], hoist)
    if not report.num_folded and not report.equalized:   # the artifact exactly as given
        return as_given(data), report
    with module.context:
        if art.kind != EXPORT:
            return _write(module, art), report
        new = dataclasses.replace(art.exported,
                                  mlir_module_serialized=C.module_to_portable_artifact(module))
    if isinstance(data, jax.export.Exported):
        return new, report
    return bytes(new.serialize()), report


def _fold_with_params(art: Artifact, data, params, merge=True, equalize=False,
                      smoothing=(None, 0.5)):
    if art.kind != EXPORT:
        module, report, prepared, _ = bind_and_fold(art.module, params, merge, equalize,
                                                    *smoothing)
        with module.context:
            return _write(module, art), report, prepared
    exp = art.exported
    by_arg, lead = export_arguments(exp, params)
    calib = None if smoothing[0] is None else export_calibration(
        exp, {argument_index(k) for k in params}, smoothing[0])
    module, report, prepared, kept = bind_and_fold(art.module, by_arg, merge, equalize,
                                                   calib, smoothing[1])
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
    where all such inputs are sharded alike (see ``shardings``)."""
    shardings = C.exported_input_shardings(exp)
    same = [i for i in bound if tuple(exp.in_avals[i].shape) == tuple(np.shape(value))
            and np.dtype(exp.in_avals[i].dtype) == np.asarray(value).dtype]
    if not same or shardings[same[0]] is None or len({str(shardings[i]) for i in same}) != 1:
        return None
    return same[0]


def _write(module, art: Artifact):
    """``module`` as an artifact of ``art``'s kind (not EXPORT): a portable artifact for
    its own target version, or — where that is newer than these bindings write (an
    artifact from a newer StableHLO, read because it uses nothing newer) — for the newest
    they write."""
    return _module_bytes(module, art.kind != TEXT, writable_target(art.target))


def writable_target(target: str | None) -> str | None:
    """``target`` where these bindings write it, else the nearest version they do."""
    if target is None:
        return None
    try:
        newest, oldest = stablehlo.get_current_version(), stablehlo.get_minimum_version()
        v = C.version_tuple(target)
        if v > C.version_tuple(newest):
            return newest
        return oldest if v < C.version_tuple(oldest) else target
    except Exception:           # noqa: BLE001 — bindings without the query: as given
        return target


def report_stablehlo(data, in_graph: bool = IN_GRAPH_DEFAULT, merge: bool = True) -> FoldReport:
    """What ``fold_stablehlo`` would fold, and why not the rest (nothing is written)."""
    return fold_stablehlo(data, in_graph=in_graph, merge=merge)[1]


# --------------------------------------------------------------------------- running


def _main_signature(text_or_bytes):
    """(input avals, output avals) of the module's public @main."""
    ctx = C.mlir_context()
    with ctx:
        module = ir.Module.parse(text_or_bytes)
        main = None
        for op in module.body.operations:
            if op.operation.name == "func.func" and \
                    ir.StringAttr(op.attributes["sym_name"]).value == "main":
                main = op
        if main is None:
            raise StableHLOError("the module has no @main function")
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)

        def aval(t):
            rt = ir.RankedTensorType(t)
            dt = element_dtype(rt.element_type)
            if dt is None:
                raise StableHLOError(f"unsupported element type {rt.element_type}")
            return jax.ShapeDtypeStruct(tuple(rt.shape), dt)
        return [aval(t) for t in ftype.inputs], [aval(t) for t in ftype.results]


def module_callable(data, platform: str = "cpu", in_shardings=None, out_shardings=None):
    """A function running the StableHLO module ``data`` (any artifact kind) through JAX.

    For a ``jax.export`` artifact this is its own ``call``; for a bare module, an export of
    the module's signature whose body is replaced by the module. A sharded module (Shardy's
    ``sdy.sharding``) runs sharded when given the shardings of its inputs and outputs (as
    for ``jax.jit``: ``NamedSharding`` s of one mesh, flat lists).
    """
    art = read_artifact(data)
    if art.kind == EXPORT:
        exp = art.exported

        def call_flat(*leaves):   # the flat inputs of ``input_specs``
            a, kw = jax.tree_util.tree_unflatten(exp.in_tree, leaves)
            return exp.call(*a, **kw)
        return call_flat
    ins, outs = _main_signature(art.module)

    def zeros(*_):
        return tuple(jax.numpy.zeros(o.shape, o.dtype) for o in outs)
    sharded = {} if in_shardings is None else dict(
        in_shardings=tuple(in_shardings), out_shardings=tuple(out_shardings))
    shell = jax.export.export(jax.jit(zeros, **sharded), platforms=[platform])(*ins)
    ctx = C.mlir_context()
    with ctx:
        module = ir.Module.parse(art.module)
        payload = C.module_to_portable_artifact(module)
    exp = dataclasses.replace(shell, fun_name="stablehlo_module", mlir_module_serialized=payload,
                              module_kept_var_idx=tuple(range(len(ins))))
    return exp.call


def input_specs(data) -> list[jax.ShapeDtypeStruct]:
    """The input shapes and dtypes of an artifact."""
    art = read_artifact(data)
    if art.kind == EXPORT:
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in art.exported.in_avals]
    return _main_signature(art.module)[0]
