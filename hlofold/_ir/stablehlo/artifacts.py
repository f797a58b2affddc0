"""StableHLO artifacts: MLIR text, MLIR bytecode, StableHLO portable artifacts (VHLO
bytecode), serialized ``jax.export`` files.

``read_artifact`` recognizes any of them (or an in-memory ``jax.export.Exported``),
``write_artifact`` writes a module back as the same kind; ``module_callable`` turns a
StableHLO module into a function JAX can run on any backend (``hlofold.callable``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from hlofold import _compat as C
from .ir import StableHLOError, element_dtype

ir, stablehlo, _ = C.mlir()

TEXT, BYTECODE, EXPORT = "mlir-text", "mlir-bytecode", "jax-export"
PORTABLE = "stablehlo-portable"   # VHLO bytecode: stablehlo.serialize_portable_artifact
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


def write_artifact(module, art: Artifact):
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
