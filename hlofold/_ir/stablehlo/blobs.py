"""Large constants a fold makes, held by reference instead of copied into MLIR.

``DenseElementsAttr.get`` copies and hashes every buffer into the MLIR context, where it
stays until the context dies; folding a 0.5 B model with ``params=`` made 4.5 GiB of them (the
weights bound, each layer's folded kernels, the restacked stacks) and read them back, most
of the fold's time. Inside :func:`scope`, :func:`make` gives a large float constant as a
``dense_resource`` attribute over the NumPy array (no copy, no hash) and keeps the array in a
table that :func:`value` reads; when the outermost scope ends, every such attribute still in
the module becomes a plain dense one (:func:`materialize`), so what leaves a fold is what it
always was. A jaxlib without resource attributes gets plain dense ones (``ENABLED``).

The table lives in a ``contextvars.ContextVar``: folds in several threads each have their own.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import numpy as np

from hlofold import _compat as C

ir, _, _ = C.mlir()

_RESOURCE = getattr(ir, "DenseResourceElementsAttr", None)
ENABLED = _RESOURCE is not None and hasattr(_RESOURCE, "get_from_buffer")
MIN_ELEMENTS = 4096          # smaller constants stay plain (cheap, and XLA folds them)
_TABLE: contextvars.ContextVar = contextvars.ContextVar("hlofold_blobs", default=None)
_NAMES = itertools.count()
_KINDS = (np.dtype(np.float32), np.dtype(np.float64))   # (bf16/f16 go as their bits: plain)


class _Table:
    def __init__(self):
        self.arrays: dict = {}       # attribute -> read-only view of its array
        self.owned: dict = {}        # attribute -> the array, where it is this fold's own
        self.given: list = []        # the caller's arrays (views): never handed back


@contextlib.contextmanager
def scope(module=None):
    """Large constants made inside are held by reference; leaving the outermost scope turns
    those left in ``module`` into plain dense attributes."""
    if _TABLE.get() is not None or not ENABLED:
        yield
        return
    token = _TABLE.set(_Table())
    try:
        yield
    finally:                 # (after an error too: no module keeps a resource of this table)
        try:
            if module is not None:
                materialize(module)
        finally:
            _TABLE.reset(token)


def make(arr: np.ndarray, tensor_type, given: bool = False):
    """Inside a scope, a resource attribute over a large float32/float64 ``arr``
    (C-contiguous, not one value everywhere); None otherwise (the caller makes a dense one).
    ``given``: the caller's array (a weight bound), read in place, never written or handed
    back. Else an array the fold made: held as it is, and where it owns its memory made
    read-only (a later write would raise, never change a constant)."""
    t = _TABLE.get()
    if t is None or arr.size < MIN_ELEMENTS or arr.dtype not in _KINDS or \
            not arr.flags.c_contiguous or _splat(arr):
        return None
    view = arr.view()
    view.flags.writeable = False
    if given:
        t.given.append(view)
    elif arr.base is None and arr.flags.writeable and \
            not any(np.may_share_memory(arr, g) for g in t.given):
        arr.flags.writeable = False
    attr = _RESOURCE.get_from_buffer(memoryview(view), f"hlofold_{next(_NAMES)}", tensor_type)
    t.arrays[attr] = view
    if not given:
        t.owned[attr] = arr
    return attr


def _splat(arr: np.ndarray) -> bool:
    """One value everywhere, bit for bit (MLIR stores it as a splat: one element)."""
    bits = arr.reshape(-1).view(np.uint32 if arr.itemsize == 4 else np.uint64)
    if bits[0] != bits[-1] or bits[0] != bits[len(bits) // 2]:
        return False
    return bool((bits == bits[0]).all())


def value(attr) -> np.ndarray | None:
    """The values behind a resource attribute :func:`make` gave (read-only), else None."""
    t = _TABLE.get()
    return None if t is None else t.arrays.get(attr)


def take(attr) -> np.ndarray | None:
    """The values behind a resource attribute, to hand to the user: the fold's own array
    where it is one (writeable again, no copy), else a copy (never the caller's memory);
    None for other attributes."""
    t = _TABLE.get()
    if t is None or attr not in t.arrays:
        return None
    own = t.owned.pop(attr, None)
    if own is None or any(np.may_share_memory(own, g) for g in t.given):
        return np.array(t.arrays[attr])
    try:
        own.flags.writeable = True   # the user's now (the table keeps a read-only view)
    except ValueError:               # a view of a read-only buffer
        return np.array(own)
    return own


def plain_dense(arr: np.ndarray, etype):
    """A dense elements attribute of ``arr`` (C-contiguous, ``etype``'s NumPy dtype)."""
    if str(etype) in ("bf16", "f16"):    # the bindings take their bits
        arr = arr.view(np.uint16)
    elif str(etype).startswith("f8"):    # fp8: the bits too
        arr = arr.view(np.uint8)
    return ir.DenseElementsAttr.get(arr, type=ir.RankedTensorType.get(arr.shape, etype))


def materialize(module) -> None:
    """Every constant of ``module`` whose value is one of this scope's resource attributes
    gets the plain dense attribute of the same values."""
    t = _TABLE.get()
    if t is None or not t.arrays:
        return
    with module.context, ir.Location.unknown():
        _materialize(module, t.arrays)


def complex_result(op) -> bool:
    """Whether ``op``'s one result holds complex elements (a constant's ``value`` then cannot
    be read through the bindings; no constant held here is complex)."""
    return len(op.results) == 1 and "complex<" in str(op.results[0].type)


def _materialize(module, arrays: dict) -> None:
    todo = [module.body]
    while todo:
        block = todo.pop()
        for op in block.operations:
            if "value" in op.attributes and not complex_result(op):
                arr = arrays.get(op.attributes["value"])
                if arr is not None:
                    op.attributes["value"] = plain_dense(
                        arr, ir.RankedTensorType(op.results[0].type).element_type)
            todo += [b for region in op.regions for b in region.blocks]
