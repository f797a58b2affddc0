"""StableHLO through jaxlib's MLIR bindings: the IR adapter's vocabulary.

Op names the pass knows (roots, per-channel arithmetic, ops a chain passes through), value
and attribute accessors, dense constants to and from NumPy, and walks over an op's readers,
roots and regions. What a fold writes (op builders, hlofold's markers, the in-graph
arithmetic, the guards' finiteness test) is :mod:`hlofold._ir.stablehlo.build`; modules as a
whole (parse, ``@main``, private functions, unused ops) are :mod:`hlofold._ir.stablehlo.module`.
"""
from __future__ import annotations

import numpy as np

import jax.numpy as jnp

from hlofold import _compat as C
from . import blobs
from .facts import op_fact
from .ops import OPS

ir, stablehlo, func_dialect = C.mlir()

# the binary affine steps, by their kind (the registry's facts, :mod:`.ops`)
BINARY = OPS.kinds("affine", {k: k for k in ("add", "sub", "mul", "div")})
DOTS = OPS.names(lambda o: o.layer == "dot")
ROOTS = OPS.names(lambda o: o.layer is not None)
# ops a chain passes through (replayed on the folded root's result), by their kind in the
# shared rule ``pass_axis``
SHAPE_KIND = OPS.kinds("shape", {"cast": "convert", "reshape": "reshape",
                                 "constraint": "sharding_constraint",
                                 "transpose": "transpose", "broadcast": "broadcast_in_dim"})


PASS_KINDS = ("convert", "shape")


def attr_dims(op, name) -> list[int] | None:
    return int_dims(op.attributes[name]) if name in op.attributes else None


class StableHLOError(ValueError):
    """The input is not a StableHLO module hlofold can read."""


# --------------------------------------------------------------------------- helpers


def shape_of(value) -> tuple[int, ...]:
    t = value.type       # the bindings hand back the concrete type: cast only when they did not
    return tuple((t if type(t) is ir.RankedTensorType else ir.RankedTensorType(t)).shape)


def elem_type(value):
    t = value.type
    return (t if type(t) is ir.RankedTensorType else ir.RankedTensorType(t)).element_type


_NP_DTYPES = {"f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
              "f16": np.dtype(np.float16), "bf16": np.dtype(C.bfloat16)}
_FP8 = {"f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2", "f8E4M3FNUZ": "float8_e4m3fnuz",
        "f8E5M2FNUZ": "float8_e5m2fnuz", "f8E4M3B11FNUZ": "float8_e4m3b11fnuz"}
# the same, by the Python class the bindings give an element type (a type is printed, which
# is slow, only when its class is not one of these)
# (empty where this JAX moved the bindings: hlofold._compat switched the path off)
_HAVE_BINDINGS = C.disabled("stablehlo") is None
_BY_CLASS = {ir.F32Type: _NP_DTYPES["f32"], ir.F64Type: _NP_DTYPES["f64"],
             ir.F16Type: _NP_DTYPES["f16"], ir.BF16Type: _NP_DTYPES["bf16"],
             ir.IntegerType: None, ir.ComplexType: None} if _HAVE_BINDINGS else {}
_FP8_BY_CLASS = {getattr(ir, f"Float8{s[2:]}Type"): np.dtype(getattr(jnp, name))
                 for s, name in _FP8.items()
                 if _HAVE_BINDINGS and hasattr(ir, f"Float8{s[2:]}Type")}
_UNSET = object()


_TYPE_NAMES = {ir.F32Type: "f32", ir.F64Type: "f64", ir.F16Type: "f16",
               ir.BF16Type: "bf16"} if _HAVE_BINDINGS else {}


def type_name(etype) -> str:
    """``str(etype)``, without printing the type for the float types hlofold folds."""
    return _TYPE_NAMES.get(type(etype)) or str(etype)


def np_dtype(etype) -> np.dtype | None:
    """The NumPy dtype of an element type hlofold folds (f32, f64, f16, bf16), else None."""
    dt = _BY_CLASS.get(type(etype), _UNSET)
    return _NP_DTYPES.get(str(etype)) if dt is _UNSET else dt


def float_dtype(etype) -> np.dtype | None:
    """The NumPy dtype of any float element type, fp8 included (None: not a float). Kernels
    and chain steps of these types are weighed by the precision rule; only the types of
    :func:`np_dtype` are folded."""
    cls = type(etype)
    dt = _BY_CLASS.get(cls, _UNSET)
    if dt is not _UNSET:
        return dt
    if cls in _FP8_BY_CLASS:
        return _FP8_BY_CLASS[cls]
    s = str(etype)
    dt = _NP_DTYPES.get(s)
    name = None if dt is not None else _FP8.get(s)
    return np.dtype(getattr(jnp, name)) if name else dt


_INTS = {"i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
         "ui8": np.uint8, "ui16": np.uint16, "ui32": np.uint32, "ui64": np.uint64,
         "complex<f32>": np.complex64, "complex<f64>": np.complex128}


def element_dtype(etype) -> np.dtype | None:
    """The NumPy dtype of any element type a module's arguments and results can have:
    floats (fp8 included), signed and unsigned integers, booleans, complex (None: another,
    such as a token)."""
    dt = float_dtype(etype)
    if dt is not None:
        return dt
    t = _INTS.get(str(etype))
    return None if t is None else np.dtype(t)


def is_float(value) -> bool:
    return np_dtype(elem_type(value)) is not None


def owner_op(value):
    """The defining op of ``value``, or None for block arguments."""
    if isinstance(value, ir.BlockArgument):
        return None
    return value.owner.operation


def op_name(op) -> str:
    return op.operation.name


def int_dims(attr) -> list[int]:
    d = ir.DenseI64ArrayAttr(attr)
    return [d[i] for i in range(len(d))]      # (indexing: 5x faster than iterating)


def location(op) -> tuple[str | None, int | None, str]:
    return op_fact("location", op.operation, _location)


def _location(op) -> tuple[str | None, int | None, str]:
    """``(file, line, name)`` of an op's location: the first file:line in it and the first
    name (TF's ``fused["conv1_conv/Conv2D", "ops.py":1221:0]``, JAX's
    ``"jit(f)/conv_general_dilated"("model.py":42:7)``, torch_xla's names), read through
    :func:`hlofold._compat.location_view`; missing parts are None / ""."""
    file = line = None
    names: list[str] = []
    todo = [op.location]
    while todo:
        kind, loc = C.location_view(todo.pop(0))
        if kind == "file" and file is None:
            name = str(loc.filename)
            file, line = ("<input>" if name in ("-", "") else name), int(loc.start_line)
        elif kind == "name":
            names.append(str(loc.name_str))
            todo.insert(0, loc.child_loc)
        elif kind == "fused":
            todo[:0] = list(loc.locations)
        elif kind == "callsite":
            todo[:0] = [loc.callee, loc.caller]
    return file, line, (names[0] if names else "")


def dense_to_numpy(attr, copy: bool = True) -> np.ndarray | None:
    """Values of a dense elements attribute (None where the bindings cannot read them).
    ``copy=False``: a read-only view of the attribute's storage where the bindings give one
    (it keeps the MLIR context alive: for reading inside a fold, never for values returned
    to the user)."""
    held = blobs.take(attr) if copy else blobs.value(attr)
    if held is not None:
        return held
    a = ir.DenseElementsAttr(attr)
    t = ir.RankedTensorType(a.type)
    dt = np_dtype(t.element_type)
    if dt is None:
        return None
    shape = tuple(t.shape)
    if a.is_splat:
        v = a.get_splat_value()
        try:
            return np.full(shape, ir.FloatAttr(v).value, dtype=np.float64).astype(dt)
        except Exception:
            return None
    if dt in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)):
        arr = np.array(a) if copy else np.asarray(a)
        return arr.reshape(shape) if arr.dtype == dt else None
    if dt == np.dtype(C.bfloat16):
        return _bf16_values(a, shape)
    return None


def _bf16_values(attr, shape, dtype=None) -> np.ndarray | None:
    """A bf16 (or ``dtype``: an fp8 type) elements attribute's values: the bindings give no
    buffer for these, so they are read from the attribute's own printed form (MLIR prints
    every such value exactly: as a hex blob of the raw little-endian bits, or as decimals
    with hex bits for non-finite values). None if the form is not one of these."""
    dt = np.dtype(dtype or C.bfloat16)
    bits_t = {1: np.uint8, 2: np.uint16}[dt.itemsize]
    text = str(attr)
    body = text[text.index("<") + 1:text.rindex("> :")].strip()
    try:
        if body.startswith('"0x'):
            bits = np.frombuffer(bytes.fromhex(body[3:body.index('"', 3)]), bits_t)
        else:
            toks = body.replace("[", " ").replace("]", " ").replace(",", " ").split()
            bits = np.array([int(t, 16) if t.startswith("0x") else
                             np.array(float(t), np.float32).astype(dt).view(bits_t)
                             for t in toks], bits_t)
        return np.broadcast_to(bits.view(dt), shape).copy() if bits.size == 1 else \
            bits.view(dt).reshape(shape).copy()
    except (ValueError, TypeError, KeyError):
        return None


def constant_attr(op):
    """A ``stablehlo.constant``'s ``value`` attribute, or None where its elements are of a type
    these bindings give no Python class for (complex: reading the attribute raises). Such a
    constant takes no part in a fold, a rewrite or a hoist: it stays in the module as it is."""
    if blobs.complex_result(op):
        return None
    return op.attributes["value"]


def constant_values(attr) -> np.ndarray | None:
    """The values of a constant of any type the evaluator reads a weight from: the float
    types hlofold folds (:func:`dense_to_numpy`), fp8, and integers (a quantized kernel
    converted to float where it is read). None for others."""
    got = dense_to_numpy(attr, copy=False)
    if got is not None:
        return got
    a = ir.DenseElementsAttr(attr)
    t = ir.RankedTensorType(a.type)
    shape = tuple(t.shape)
    name = str(t.element_type)
    if name in _FP8:
        return _bf16_values(attr, shape, float_dtype(t.element_type))
    if name.lstrip("u").startswith("i") and name != "i1":
        dt = np.dtype(_INTS[name]) if name in _INTS else None
        if dt is None:
            return None
        if a.is_splat:
            return np.full(shape, ir.IntegerAttr(a.get_splat_value()).value, dt)
        return np.asarray(ir.DenseIntElementsAttr(a)).astype(dt).reshape(shape)
    return None


def numpy_to_dense(arr: np.ndarray, etype, given: bool = False):
    """A dense constant of ``arr``: inside a fold, a large one held by reference (``given``:
    the caller's array, see :func:`hlofold._ir.stablehlo.blobs.make`)."""
    name = str(etype)
    arr = np.asarray(arr, dtype=_NP_DTYPES.get(name) or element_dtype(etype) or np.float64)
    if not arr.flags.c_contiguous:     # (np.ascontiguousarray makes a 0-d array 1-d)
        arr = np.ascontiguousarray(arr)
    held = blobs.make(arr, ir.RankedTensorType.get(arr.shape, etype), given)
    return held if held is not None else blobs.plain_dense(arr, etype)


def parent_of(op):
    """The op whose region holds ``op`` (None at the top)."""
    p = op.parent
    return None if p is None else p.operation


def same_block(a, b) -> bool:
    """Whether ops ``a`` and ``b`` sit in the same region (their parent is one op)."""
    pa = parent_of(a)
    return pa is not None and pa == parent_of(b)


def reader_beside(owner, home):
    """The op in the region held by ``home`` (an op, see :func:`parent_of`) that reads a
    value ``owner`` reads: ``owner`` itself, or the op holding the region ``owner`` sits in
    (a ``case`` branch reading a value from above is a read by the ``case``, as a jaxpr's
    ``cond`` equation reads its operands); None when ``owner`` is not nested there."""
    while owner is not None:
        parent = parent_of(owner)
        if parent is None or parent == home:
            return owner if parent is not None else None
        if op_name(parent) == "func.func":
            return None
        owner = parent
    return None


def readers(value, skip=lambda op: False) -> list:
    """The ops reading ``value`` with the operand position, but those ``skip`` names; a read
    inside a region (a ``case`` branch reading a value from above) is a read by the op
    holding the region (:func:`reader_beside`), once, at position -1 — as a jaxpr's ``cond``
    equation reads its operand."""
    anchor = owner_op(value)
    home = None if anchor is None else parent_of(anchor)
    out, holders = [], set()
    for u in value.uses:
        owner, pos = u.owner, u.operand_number
        if skip(owner):
            continue
        if home is not None and parent_of(owner) != home:
            owner, pos = reader_beside(owner, home), -1
            if owner is None or owner.operation in holders or skip(owner):
                continue
            holders.add(owner.operation)
        out.append((owner, pos))
    return out


def reads(op) -> list:
    """The values ``op`` reads: its operands and, inside its regions, values from above."""
    out = list(op.operands)
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                out.extend(reads(inner))
    return out


def remap_operands(op, mapping):
    """Replace, in ``op`` and in every op nested in its regions (a cond/while body may read
    values from above), the operands that ``mapping`` renames."""
    for i, v in enumerate(op.operands):
        for src, dst in mapping.items():
            if v == src:
                op.operands[i] = dst
                break
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                remap_operands(inner, mapping)
