"""StableHLO modules whose weights are arguments: fold them for given weight values.

TensorFlow (``tf.function(jit_compile=True).experimental_get_compiler_ir(...)(stage=
"stablehlo")``), PyTorch/XLA and ``jax.export`` of a function taking its parameters emit
modules whose weights are ``@main`` arguments. Folded as they are, ``K ⊙ s`` would be
computed in the graph on every call. Given the weight values,
:func:`hlofold._front.artifacts.bind_and_fold` binds
those arguments to constants, folds at transform time (float64 on the host, with the rules
of any constant: a non-finite scale or an underflowing channel refuses its site), and passes
the folded constants back as arguments ("hoists" them, as :mod:`hlofold._front.prepare` does for
jaxprs). The apply module takes ``(*remaining original arguments, *prepared)`` and runs one
convolution and one add per folded site: no more work per call than the original module,
and no weights in its text.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from hlofold import _compat as C
from . import blobs
from hlofold._base.chain_rules import is_extended
from .ir import StableHLOError, constant_attr, dense_to_numpy, element_dtype

ir, stablehlo, _ = C.mlir()

# constants with fewer elements stay in the module (XLA folds them into the arithmetic)
MIN_HOISTED = 2


def argument_index(key) -> int:
    """``3``, ``"3"``, ``"arg3"`` or ``"%arg3"``: the module argument ``%arg3``."""
    s = str(key).lstrip("%")
    s = s[3:] if s.startswith("arg") else s
    if not s.isdigit():
        raise StableHLOError(f"{key!r} does not name a module argument (use arg0, arg1, ...)")
    return int(s)


def bound_values(params: Mapping[Any, Any]) -> dict[int, np.ndarray]:
    """``params`` by argument number; a :class:`StableHLOError` where two keys name one
    argument (``"arg0"`` and ``0``): which value was meant cannot be told."""
    values: dict[int, np.ndarray] = {}
    names: dict[int, Any] = {}
    for k, v in params.items():
        i = argument_index(k)
        if i in values:
            raise StableHLOError(f"params= names argument {i} twice ({names[i]!r} and {k!r})")
        if is_extended(v):
            v = jax.random.key_data(v)       # (a PRNG key: the module's argument is its bits)
        values[i], names[i] = np.asarray(v), k
    return values


def as_module_aval(aval):
    """An export input's shape and dtype as its module takes it: a PRNG key's as its bits
    (``jax.random.key_data``), any other as it is."""
    if is_extended(aval):
        return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return aval


def export_arguments(exp, params) -> tuple[dict, int]:
    """``params`` keyed by an ``Exported``'s flat inputs, as ``@main`` arguments: after the
    platform index a multi-platform module takes first, without the inputs the module
    does not use (nothing to bind). Returns ``(by module argument, leading arguments)``."""
    lead = 1 if len(exp.platforms) > 1 else 0
    kept = list(exp.module_kept_var_idx)
    if exp.ordered_effects:
        raise StableHLOError("this jax.export artifact has ordered effects (its module takes "
                             "tokens first): fold before exporting, with hlofold.export")
    out = {}
    for i, v in bound_values(params).items():
        if not 0 <= i < len(exp.in_avals):
            raise StableHLOError(f"arg{i}: the export takes {len(exp.in_avals)} inputs")
        a, v = as_module_aval(exp.in_avals[i]), np.asarray(v)
        if tuple(v.shape) != tuple(a.shape) or v.dtype != np.dtype(a.dtype):
            raise StableHLOError(f"arg{i}: {v.dtype}{list(v.shape)}, the export's input is "
                                 f"{np.dtype(a.dtype)}{list(a.shape)}")
        if i in kept:
            out[kept.index(i) + lead] = v
    return out, lead


def export_calibration(exp, bound: dict, calib: list) -> list:
    """Calibration inputs given as an export's per-call inputs (those not in ``bound``, in
    order), as its module's remaining arguments."""
    if len(exp.platforms) > 1:
        raise StableHLOError("smooth= runs the module to calibrate: export it for one "
                             "platform")
    rest = [i for i in range(len(exp.in_avals)) if i not in bound]
    used = [i for i in exp.module_kept_var_idx if i not in bound]
    for c in calib:
        if len(c) != len(rest):
            raise StableHLOError(f"a calibration input has {len(c)} arrays; the export takes "
                                 f"{len(rest)} per call")
    return [[c[rest.index(i)] for i in used] for c in calib]


def check_value(i: int, v: np.ndarray, arg_type, n: int) -> None:
    if arg_type is None:
        raise StableHLOError(f"arg{i}: the module's @main takes {n} arguments")
    t = ir.RankedTensorType(arg_type)
    if tuple(v.shape) != tuple(t.shape):
        raise StableHLOError(f"arg{i}: shape {tuple(v.shape)}, the module expects "
                             f"{tuple(t.shape)}")
    want = element_dtype(t.element_type)
    if want is None:
        raise StableHLOError(f"arg{i}: a {t.element_type} argument; only float (fp8 "
                             "included) and integer weights are bound")
    if np.dtype(v.dtype) != want:
        raise StableHLOError(f"arg{i}: dtype {v.dtype}, the module expects {t.element_type}")


def hoist(main, copy: bool = True) -> list:
    """Non-splat constants of ``main``'s body (not nested regions) with at least
    ``MIN_HOISTED`` elements become trailing arguments; returns their values (``copy=False``:
    read-only views, for a run inside the fold)."""
    block = main.regions[0].blocks[0]
    values, moved = [], []
    for op in list(block.operations):
        if op.operation.name != "stablehlo.constant":
            continue
        attr = constant_attr(op)
        if attr is None:
            continue                  # (complex: stays in the module)
        if blobs.value(attr) is None and ir.DenseElementsAttr(attr).is_splat:
            continue
        val = dense_to_numpy(attr, copy=copy)
        if val is None or val.size < MIN_HOISTED:
            continue                  # unreadable (bf16) or tiny: stays in the module
        moved.append(op)
        values.append(val)
    n = len(block.arguments)
    for op in moved:
        arg = block.add_argument(op.results[0].type, ir.Location.unknown())
        op.results[0].replace_all_uses_with(arg)
        op.erase()
    set_arguments(main, list(range(n)), appended=True)
    return values


def set_arguments(main, kept: list[int], appended: bool = False) -> None:
    """Make ``main``'s signature match its block: the arguments ``kept`` (old numbering)
    stay, unused others are erased; with ``appended``, arguments added to the block after
    them are taken into the function type with empty attributes."""
    block = main.regions[0].blocks[0]
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    old_attrs = (list(ir.ArrayAttr(main.attributes["arg_attrs"]))
                 if "arg_attrs" in main.attributes else None)
    if not appended:
        for i in reversed(range(len(block.arguments))):
            if i not in set(kept):
                if len(list(block.arguments[i].uses)):
                    raise AssertionError("a bound argument is still used")  # pragma: no cover
                block.erase_argument(i)
        attrs = [old_attrs[i] for i in kept] if old_attrs is not None else None
    else:
        extra = len(block.arguments) - len(kept)
        attrs = (old_attrs + [ir.DictAttr.get({})] * extra) if old_attrs is not None else None
    main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
        [a.type for a in block.arguments], list(ftype.results)))
    if attrs is not None:
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
