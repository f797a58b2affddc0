"""Folding at the StableHLO level, for modules hlofold did not make.

TF, PyTorch/XLA, hand-written modules and plain ``jax.export`` artifacts carry BatchNorm as
``stablehlo.batch_norm_inference`` or as the decomposed arithmetic JAX and XLA emit
(``convolution → subtract/multiply/add/divide`` with ``broadcast_in_dim`` of per-channel
values, with ``convert`` casts). This pass walks every ``stablehlo.convolution`` (and
``stablehlo.dot_general`` and ``stablehlo.dot``), follows its result through such a chain — into private functions
that continue it — collapses the chain into ``y·s + t`` and rewrites it to
``convolution(x, K ⊙ s) + broadcast_in_dim(t)``:

* operands that are constants (possibly computed from constants) give a new constant kernel
  and no multiply at all;
* operands that are function arguments give a multiply on the kernel, never on activations.

The rules are the jaxpr folder's: every folded value has one consumer, operands vary along
the output-feature dimension only (decided axis by axis, never by size; for
``batch_norm_inference`` its ``feature_index`` must *be* that dimension), and ``s`` must be
finite. Everything else is reported with a reason. Built on jaxlib's MLIR bindings; no text
is parsed by hand.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import _compat as C
from ._algebra import collapse
from ._patterns import Refusal, unit_reshape_map, conv_layout, dot_layout, pass_axis
from ._report import (CANONICAL, FOLDED, NO_PATTERN, NOT_REACHED, REFUSED, FoldReport,
                      FoldSite)
from ._unreached import unreached_reason
from ._rules import precision_refusal, round_kernel, runtime_refusal, scale_refusal

ir, stablehlo, func_dialect = C.mlir()

_BINARY = {"stablehlo.add": "add", "stablehlo.subtract": "sub", "stablehlo.multiply": "mul",
           "stablehlo.divide": "div"}
DOTS = ("stablehlo.dot_general", "stablehlo.dot")
# shape ops and casts an unreached normalization is traced back through
_PASS_THROUGH = ("stablehlo.convert", "stablehlo.reshape", "stablehlo.transpose",
                 "stablehlo.broadcast_in_dim")
_ROOTS = ("stablehlo.convolution", *DOTS)
# ops a chain passes through (replayed on the folded root's result), by their kind in the
# shared rule ``pass_axis``
_SHAPE_KIND = {"stablehlo.convert": "convert", "stablehlo.reshape": "reshape",
               "stablehlo.transpose": "transpose", "stablehlo.broadcast_in_dim": "broadcast_in_dim"}


_PASS_KINDS = ("convert", "shape")


def _attr_dims(op, name) -> list[int] | None:
    return _dims(op.attributes[name]) if name in op.attributes else None


class StableHLOError(ValueError):
    """The input is not a StableHLO module hlofold can read."""


# --------------------------------------------------------------------------- helpers


def _shape(value) -> tuple[int, ...]:
    return tuple(ir.RankedTensorType(value.type).shape)


def _etype(value):
    return ir.RankedTensorType(value.type).element_type


def np_dtype(etype) -> np.dtype | None:
    s = str(etype)
    return {"f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
            "f16": np.dtype(np.float16), "bf16": np.dtype(C.bfloat16)}.get(s)


def _is_float(value) -> bool:
    return np_dtype(_etype(value)) is not None


def _owner_op(value):
    """The defining op of ``value``, or None for block arguments."""
    if isinstance(value, ir.BlockArgument):
        return None
    owner = value.owner
    return owner if isinstance(owner, ir.Operation) else owner.operation


def _name(op) -> str:
    return op.name if isinstance(op, ir.Operation) else op.operation.name


def _dims(attr) -> list[int]:
    return list(ir.DenseI64ArrayAttr(attr))


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


def dense_to_numpy(attr) -> np.ndarray | None:
    """Values of a dense elements attribute (None where the bindings cannot read them)."""
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
        arr = np.array(a)
        return arr.reshape(shape) if arr.dtype == dt else None
    return None   # bf16 non-splat: the bindings cannot read it (the fold stays in the graph,
    # guarded; bf16 has float32's range, so only a non-finite s can go wrong there)


def numpy_to_dense(arr: np.ndarray, etype):
    arr = np.ascontiguousarray(arr)
    if str(etype) == "bf16":
        return ir.DenseElementsAttr.get(arr.astype(C.bfloat16).view(np.uint16),
                                        type=ir.RankedTensorType.get(arr.shape, etype))
    if str(etype) == "f16":
        return ir.DenseElementsAttr.get(arr.astype(np.float16).view(np.uint16),
                                        type=ir.RankedTensorType.get(arr.shape, etype))
    return ir.DenseElementsAttr.get(arr.astype(np_dtype(etype)),
                                    type=ir.RankedTensorType.get(arr.shape, etype))


# --------------------------------------------------------------------------- analysis


@dataclasses.dataclass
class _Operand:
    value: Any                 # smallest per-channel source
    axis: int | None           # its channel axis (None: scalar-like)
    casts: tuple               # element types converted to, in order
    size: int


@dataclasses.dataclass
class _Step:
    op: Any
    kind: str                  # add/sub/rsub/mul/div/neg/bn/convert
    operand: _Operand | None = None
    bn: dict | None = None     # batch_norm_inference operands
    axis: int = 0              # the channel axis of its result


class _Evaluator:
    """Values of constant sub-expressions (float64 on the host), memoized."""

    _UNARY = {"stablehlo.negate": np.negative, "stablehlo.sqrt": np.sqrt,
              "stablehlo.rsqrt": lambda a: 1.0 / np.sqrt(a), "stablehlo.exponential": np.exp}
    _BIN = {"stablehlo.add": np.add, "stablehlo.subtract": np.subtract,
            "stablehlo.multiply": np.multiply, "stablehlo.divide": np.divide,
            "stablehlo.maximum": np.maximum, "stablehlo.minimum": np.minimum}

    def __init__(self):
        self.memo: dict[Any, np.ndarray | None] = {}

    def __call__(self, value) -> np.ndarray | None:
        key = value
        if key in self.memo:
            return self.memo[key]
        out = self._eval(value)
        self.memo[key] = out
        return out

    def _eval(self, value):
        op = _owner_op(value)
        if op is None or not _is_float(value):
            return None
        name = _name(op)
        dt = np_dtype(_etype(value))
        with np.errstate(all="ignore"):
            if name == "stablehlo.constant":
                return dense_to_numpy(op.attributes["value"])
            ins = [self(v) for v in op.operands]
            if any(x is None for x in ins):
                return None
            if name in self._UNARY:
                return self._UNARY[name](ins[0].astype(np.float64)).astype(dt)
            if name in self._BIN:
                return self._BIN[name](ins[0].astype(np.float64),
                                       ins[1].astype(np.float64)).astype(dt)
            if name == "stablehlo.convert":
                return ins[0].astype(dt)
            if name == "stablehlo.reshape":
                return ins[0].reshape(_shape(value))
            if name == "stablehlo.broadcast_in_dim":
                dims = _dims(op.attributes["broadcast_dimensions"])
                shape = _shape(value)
                src = ins[0]
                exp = [1] * len(shape)
                for i, d in enumerate(dims):
                    exp[d] = src.shape[i]
                return np.broadcast_to(src.reshape(exp), shape).astype(dt)
        return None


def _resolve(value, out_shape, axis) -> _Operand | str:
    """Trace ``value`` back to a source varying only along ``axis`` of ``out_shape``."""
    shape = _shape(value)
    if len(shape) not in (0, len(out_shape)):
        return f"operand of rank {len(shape)} against rank {len(out_shape)}"
    amap = {i: i for i in range(len(shape))}
    cur, casts, found, bad_axis = value, [], None, None
    for _ in range(64):
        cshape = _shape(cur)
        bad = [i for i, d in enumerate(cshape) if d != 1 and amap.get(i) != axis]
        op = _owner_op(cur)
        if not bad:
            src = next((i for i, d in enumerate(cshape) if d != 1 and amap.get(i) == axis), None)
            found = _Operand(cur, src, tuple(casts), cshape[src] if src is not None else 1)
            if op is None or _name(op) not in ("stablehlo.broadcast_in_dim",
                                               "stablehlo.reshape"):
                return found
        elif amap.get(bad[0]) is not None:
            bad_axis = amap.get(bad[0])
        if op is None:
            break
        name = _name(op)
        if name == "stablehlo.broadcast_in_dim":
            dims = _dims(op.attributes["broadcast_dimensions"])
            amap = {i: amap.get(d) for i, d in enumerate(dims)}
            cur = op.operands[0]
        elif name == "stablehlo.reshape":
            src = op.operands[0]
            m = unit_reshape_map(_shape(src), cshape)
            if m is None:
                break
            amap = {i: amap.get(m[i]) if i in m else None for i in range(len(_shape(src)))}
            cur = src
        elif name == "stablehlo.convert" and found is None and _is_float(op.operands[0]):
            casts.insert(0, _etype(cur))
            cur = op.operands[0]
        elif name == "stablehlo.dynamic_broadcast_in_dim":
            return ("operand is broadcast to a symbolic (dynamic) shape: symbolic-shape modules "
                    "are not folded at the StableHLO level; fold before exporting "
                    "(hlofold.export takes symbolic shapes)")
        else:
            break
    if found is not None:
        return found
    same = " (same size as the channels: matched by axis, not size)" if \
        bad_axis is not None and out_shape[bad_axis] == out_shape[axis] else ""
    where = f"dimension {bad_axis}" if bad_axis is not None else "a non-feature dimension"
    return (f"operand varies along {where}, not only along the output-feature dimension "
            f"{axis}{same}")


def _root_info(op):
    """(output feature dim, kernel operand index, kernel feature dim, layout text, input
    channels, feature groups) or a reason."""
    name = _name(op)
    lhs, rhs, out = _shape(op.operands[0]), _shape(op.operands[1]), _shape(op.results[0])
    if name == "stablehlo.convolution":
        dn = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
        layout = conv_layout(
            (dn.input_batch_dimension, dn.input_feature_dimension, *dn.input_spatial_dimensions),
            (dn.kernel_output_feature_dimension, dn.kernel_input_feature_dimension,
             *dn.kernel_spatial_dimensions),
            (dn.output_batch_dimension, dn.output_feature_dimension,
             *dn.output_spatial_dimensions))
        groups = (ir.IntegerAttr(op.attributes["feature_group_count"]).value
                  if "feature_group_count" in op.attributes else 1)
        return (dn.output_feature_dimension, 1, dn.kernel_output_feature_dimension, layout,
                int(lhs[dn.input_feature_dimension]), int(groups))
    lb, lc, rb, rc = _dot_dims(op)
    lfree = [d for d in range(len(lhs)) if d not in lb + lc]
    rfree = [d for d in range(len(rhs)) if d not in rb + rc]
    if len(rfree) != 1:
        return f"the rhs has {len(rfree)} free dimensions"
    return (len(lb) + len(lfree), 1, rfree[0], dot_layout(lhs, rhs, out),
            int(np.prod([lhs[d] for d in lc], dtype=np.int64)), 1)


def _dot_dims(op) -> tuple[list[int], list[int], list[int], list[int]]:
    """(lhs batch, lhs contracting, rhs batch, rhs contracting) dimensions of a
    ``stablehlo.dot_general``, or of a ``stablehlo.dot`` (a matrix/vector product: the lhs's
    last dimension contracts with the rhs's first)."""
    if _name(op) == "stablehlo.dot":
        return [], [len(_shape(op.operands[0])) - 1], [], [0]
    dn = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    return (list(dn.lhs_batching_dimensions), list(dn.lhs_contracting_dimensions),
            list(dn.rhs_batching_dimensions), list(dn.rhs_contracting_dimensions))


def _lhs_root_info(op):
    """The weight as the lhs of a dot (its one free dimension is the output feature), tried
    when the rhs reading folds nothing; None for convolutions."""
    if _name(op) not in DOTS:
        return None
    lb, lc, rb, rc = _dot_dims(op)
    lhs, rhs = _shape(op.operands[0]), _shape(op.operands[1])
    lfree = [d for d in range(len(lhs)) if d not in lb + lc]
    if len(lfree) != 1 or not _is_float(op.operands[0]):
        return None
    return (len(lb), 0, lfree[0], dot_layout(lhs, rhs, _shape(op.results[0]), True),
            int(np.prod([lhs[d] for d in lc], dtype=np.int64)), 1)


# --------------------------------------------------------------------------- the pass


# the reason an argument-weight site stays unfolded with in_graph=False
WEIGHTS_ARE_ARGUMENTS = (
    "the weights are module arguments, so K·s would be recomputed (and range-checked) on every "
    "call, costing more than the BatchNorm it removes; fold with the weight values "
    "(fold_stablehlo(..., params=), hlofold fold --params) or in the graph (in_graph=True, "
    "--in-graph)")


class _Pass:
    def __init__(self, module, in_graph: bool = True, guard: bool = True):
        self.in_graph = in_graph
        self.guard = guard
        self.module = module
        self.sites: list[FoldSite] = []
        self.eval = _Evaluator()
        self.activation: dict[Any, bool] = {}
        # ops a folded site replaced: erased after all sites, so that no op is freed while
        # the memos (keyed by the ops' addresses) are in use
        self.dead: list = []
        self.inlined: set[str] = set()     # private callees inlined into a caller
        self.trial: list = []              # calls inlined while walking the current site
        self.ct = None                     # in-graph arithmetic type of the current site
        self.symbols = {}
        for op in module.body.operations:
            if _name(op) == "func.func":
                self.symbols[ir.StringAttr(op.attributes["sym_name"]).value] = op

    def run(self) -> FoldReport:
        for fname, fop in list(self.symbols.items()):
            if not fop.regions[0].blocks:      # a declaration: no body to fold
                continue
            for op in _roots_in(fop):
                n = len(self.sites)
                self._site(op, fname)
                self._end_trial(any(r.status == FOLDED for r in self.sites[n:]))
        for op in self.dead:
            op.erase()
        self.dead.clear()
        self.activation.clear()
        self.eval.memo.clear()
        for fname, fop in list(self.symbols.items()):
            if fop.regions[0].blocks and fname not in self.inlined:
                self._account_unreached(fop, fname)
        return FoldReport(self.sites)

    def _account_unreached(self, fop, fname) -> None:
        """A NOT_REACHED record for each ``batch_norm_inference`` and each ``multiply`` of
        an activation by a per-channel vector of parameters that no root's chain took (the
        rule of :mod:`hlofold._unreached`, as on the jaxpr path)."""
        for op in list(fop.regions[0].blocks[0].operations):
            name = _name(op)
            if name == "stablehlo.batch_norm_inference":
                x = op.operands[0]
                size = _shape(x)[ir.IntegerAttr(op.attributes["feature_index"]).value]
            elif name == "stablehlo.multiply" and len(_shape(op.results[0])) >= 2:
                acts = [v for v in op.operands if self._from_root(v)]
                if len(acts) != 1:
                    continue
                x = acts[0]
                other = op.operands[1] if x == op.operands[0] else op.operands[0]
                shape = _shape(op.results[0])
                found = next((r for r in (_resolve(other, shape, a) for a in range(len(shape))
                                          if shape[a] != 1)
                              if not isinstance(r, str) and r.size > 1), None)
                if found is None or self._from_root(found.value):
                    continue
                size = found.size
            else:
                continue
            after = self._before_chain(x)
            if after is None or not self._from_root(x):
                continue                 # a root's record accounts for it
            uses = list(op.results[0].uses)
            then = ("output" if not uses or _name(uses[0].owner) == "func.return" else
                    _name(uses[0].owner).split(".")[-1])
            file, line, lname = _location(op)
            self.sites.append(FoldSite(
                pattern="unreached_affine", primitive=name, status=NOT_REACHED,
                scope=f"@{fname}", file=file, line=line, name_stack=lname,
                dtype=str(_etype(op.results[0])), out_channels=int(size),
                reason=unreached_reason(after, then)))

    def _before_chain(self, value) -> str | None:
        """The op before the per-channel arithmetic and shape ops leading to ``value``
        ("input" at a function argument); None when that is a root."""
        for _ in range(10_000):
            op = _owner_op(value)
            if op is None:
                return "input"
            name = _name(op)
            if name in _ROOTS:
                return None
            acts = [v for v in op.operands if self._from_root(v)]
            if len(acts) == 1 and (name in _BINARY or name in _PASS_THROUGH):
                value = acts[0]
                continue
            return name.split(".")[-1]
        return "input"     # pragma: no cover

    def _record(self, op, fname, status, info=None, **kw) -> FoldSite:
        file, line, name = _location(op)
        shape = _shape(op.results[0])
        info = info or _root_info(op)
        rec = FoldSite(pattern="stablehlo_" + ("conv" if "conv" in _name(op) else "dot") +
                       "_affine", primitive=_name(op), status=status, scope=f"@{fname}",
                       file=file, line=line, name_stack=name,
                       dtype=str(_etype(op.results[0])), **kw)
        if not isinstance(info, str):
            rec.layout, rec.in_channels, rec.groups = info[3], info[4], info[5]
            rec.out_channels = int(shape[info[0]])
        self.sites.append(rec)
        return rec

    # -- chain walk

    def _inline_call(self, call, arg_index) -> str | None:
        """Inline a private callee into the caller when the chain continues in it; else say
        why the chain ends at the call."""
        callee_name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
        callee = self.symbols.get(callee_name)
        if callee is None or not callee.regions[0].blocks or \
                "sym_visibility" not in callee.attributes or \
                ir.StringAttr(callee.attributes["sym_visibility"]).value != "private":
            return f"chain continues into @{callee_name}, which is not a private function"
        body = callee.regions[0].blocks[0]
        arg = body.arguments[arg_index]
        uses = list(arg.uses)
        if len(uses) != 1 or _name(uses[0].owner) not in (*_BINARY, "stablehlo.negate",
                                                          "stablehlo.convert",
                                                          "stablehlo.batch_norm_inference"):
            first = _name(uses[0].owner) if uses else "nothing"
            return f"chain ends at call @{callee_name} (its argument feeds {first})"
        mapping = {}
        for a, v in zip(body.arguments, call.operands):
            mapping[a] = v
        ret, cloned = None, []
        with ir.InsertionPoint(call):
            for op in body.operations:
                if _name(op) == "func.return":
                    ret = op
                    break
                new = op.clone()
                cloned.append(new)
                _remap_operands(new, mapping)
                for old_r, new_r in zip(op.results, new.results):
                    mapping[old_r] = new_r
        # a trial: the call stays (its uses moved to the inlined ops) until the site is
        # decided; refused, the call gets its uses back and the inlined ops go (the module
        # is changed only for a chain that folds)
        results = [next((dst for src, dst in mapping.items() if src == v), v)
                   for v in ret.operands]
        for r, v in zip(call.results, results):
            r.replace_all_uses_with(v)
        self.trial.append((call, callee_name, cloned, results))
        return None

    def _end_trial(self, folded: bool) -> None:
        """Keep (``folded``) or undo the private calls a site's walk inlined."""
        if not self.trial:
            return
        for call, callee_name, cloned, results in reversed(self.trial):
            if folded:
                call.erase()
                self.inlined.add(callee_name)
                continue
            for r, v in zip(call.results, results):
                v.replace_all_uses_with(r)
            for op in reversed(cloned):
                op.erase()
        self.trial.clear()
        self.activation.clear()    # keyed by op addresses: drop them after erasing
        self.eval.memo.clear()

    def _walk(self, root, axis):
        v = root.results[0]
        steps, committed, stop, refusal = [], 0, None, False
        while True:
            pending = {c for c, *_ in self.trial}      # inlined: their uses moved
            uses = [u for u in v.uses if u.owner not in pending]
            if len(uses) != 1:
                if len(uses) > 1:
                    stop = f"a value in the chain has {len(uses)} consumers"
                    refusal = True
                else:
                    stop = "value is unused"
                break
            user, pos = uses[0].owner, uses[0].operand_number
            name = _name(user)
            if name == "func.return":
                stop = "value is returned"
                break
            if name == "stablehlo.return" and _name(user.parent) in ("stablehlo.case",
                                                                      "stablehlo.if"):
                stop = (f"the root is inside a {_name(user.parent)} branch (a multi-platform "
                        "export lowers each convolution per platform); not followed out of "
                        "the branch — export for one platform, or fold before exporting "
                        "(hlofold.export)")
                break
            if name == "func.call":
                why = self._inline_call(user, pos)
                if why is None:
                    continue
                stop = why
                break
            if name in _BINARY:
                kind = {"add": "add", "mul": "mul"}.get(_BINARY[name])
                if _BINARY[name] == "sub":
                    kind = "sub" if pos == 0 else "rsub"
                elif _BINARY[name] == "div":
                    kind = "div" if pos == 0 else None
                if kind is None:
                    stop, refusal = "divide with the conv value as divisor is not affine", True
                    break
                op = _resolve(user.operands[1 - pos], _shape(v), axis)
                if isinstance(op, str):
                    stop, refusal = f"{name}: {op}", True
                    break
                if _owner_op(op.value) is not None and self._from_root(op.value):
                    stop, refusal = f"{name}: operand is computed from an activation", True
                    break
                steps.append(_Step(user, kind, op, axis=axis))
                committed = len(steps)
            elif name == "stablehlo.negate":
                steps.append(_Step(user, "neg", axis=axis))
                committed = len(steps)
            elif name in _SHAPE_KIND:
                nxt = pass_axis(_SHAPE_KIND[name], _shape(v), _shape(user.results[0]), axis,
                                floats=_is_float(v) and _is_float(user.results[0]),
                                perm=_attr_dims(user, "permutation"),
                                bdims=_attr_dims(user, "broadcast_dimensions"))
                if isinstance(nxt, Refusal):
                    stop = f"{name}: {nxt.reason}"
                    break
                steps.append(_Step(user, "convert" if _SHAPE_KIND[name] == "convert"
                                   else "shape", axis=nxt))
                axis = nxt
            elif name == "stablehlo.batch_norm_inference" and pos == 0:
                fi = ir.IntegerAttr(user.attributes["feature_index"]).value
                if fi != axis:
                    stop = (f"batch_norm_inference feature_index {fi} is not the output-feature "
                            f"dimension {axis}" + (" (same size: matched by dimension, not "
                                                   "size)" if _shape(v)[fi] == _shape(v)[axis]
                                                   else ""))
                    refusal = True
                    break
                eps = ir.FloatAttr(user.attributes["epsilon"]).value
                bn = {k: user.operands[i] for i, k in enumerate(
                    ["x", "scale", "offset", "mean", "variance"])}
                bn["epsilon"] = eps
                steps.append(_Step(user, "bn", bn=bn, axis=axis))
                committed = len(steps)
            else:
                stop = f"chain ends at {name}"
                break
            v = user.results[0]
        return steps[:committed], stop, refusal

    def _from_root(self, value) -> bool:
        """Whether ``value`` is computed from a conv/dot result (an activation), also through
        ops whose regions read one (a site's run-time guard). Memoized per op (no op is
        erased while the memo is in use: see ``dead``): one walk over the program in all,
        not one per operand."""
        top = _owner_op(value)
        if top is None:
            return False
        memo = self.activation
        stack = [top]
        while stack:
            op = stack[-1]
            if op in memo:
                stack.pop()
                continue
            if _name(op) in _ROOTS:
                memo[op] = True
                stack.pop()
                continue
            producers = [p for p in (_owner_op(v) for v in reads(op)) if p is not None]
            missing = [p for p in producers if p not in memo]
            if missing:
                stack.extend(missing)
                continue
            memo[op] = any(memo[p] for p in producers)
            stack.pop()
        return memo[top]

    # -- folding

    def _site(self, root, fname):
        first = _root_info(root)
        cands = [c for c in (first, _lhs_root_info(root)) if c is not None and
                 not isinstance(c, str)]
        if not cands:
            self._record(root, fname, REFUSED, reason=first)
            return
        if not _is_float(root.results[0]):
            self._record(root, fname, REFUSED, reason="not a float root")
            return
        chosen = None
        for info in cands:              # the first reading of the root that folds
            if info is not first and self.eval(root.operands[info[1]]) is None:
                continue                # a non-constant lhs may as well be the activations
            walked = self._walk(root, info[0])
            real = [s for s in walked[0] if s.kind not in _PASS_KINDS]
            k = root.operands[info[1]]
            folds = bool(real) and not (len(real) == 1 and real[0].kind in ("add", "sub")) \
                and not (_owner_op(k) is not None and self._from_root(k))
            if chosen is None or folds:
                chosen = (info, walked)
            if folds:
                break
        info, (steps, stop, refusal) = chosen
        out_axis, kidx, kaxis = info[:3]
        absorbed = [_name(s.op).split(".")[-1] for s in steps]
        real = [s for s in steps if s.kind not in _PASS_KINDS]
        if not real:
            self._record(root, fname, info=info, status=REFUSED if refusal else NO_PATTERN,
                         reason=stop)
            return
        if len(real) == 1 and real[0].kind in ("add", "sub"):
            self._record(root, fname, info=info, status=CANONICAL, absorbed=absorbed,
                         reason="already conv + per-channel bias")
            return
        kernel = root.operands[kidx]
        if _owner_op(kernel) is not None and self._from_root(kernel):
            self._record(root, fname, info=info, status=REFUSED, absorbed=absorbed,
                         reason="the kernel is computed from an activation")
            return
        C_out = _shape(root.results[0])[out_axis]

        known = self._np_chain(real, C_out)      # (kinds, float64 operands) or None
        rec = self._record(root, fname, info=info, status=FOLDED, absorbed=absorbed,
                           note=f"chain stopped: {stop}" if stop else None)
        kd = np_dtype(_etype(kernel))
        # in-graph arithmetic: float32, or float64 when the program computes in float64
        wide = any(str(_etype(v)) == "f64"
                   for v in (kernel, root.results[0], steps[-1].op.results[0]))
        self.ct = ir.F64Type.get() if wide else ir.F32Type.get()
        why = precision_refusal(kd, [np_dtype(_etype(root.results[0]))] + [
            np_dtype(_etype(st.op.results[0])) for st in steps]) if kd is not None else None
        if why is None and not (known and self.eval(kernel) is not None):
            # the rescale would run in the graph, on every call
            why = runtime_refusal(kd) if self.in_graph else WEIGHTS_ARE_ARGUMENTS
        if why:
            rec.status, rec.reason = REFUSED, why
            return
        end_op = steps[-1].op
        end_value = end_op.results[0]
        k_np = self.eval(kernel)
        kdt = _etype(kernel)
        out_t = end_value.type
        with ir.Location.unknown(), ir.InsertionPoint(end_op):
            if known:
                with np.errstate(all="ignore"):
                    s_vec, t_vec = (np.broadcast_to(v, (C_out,)) for v in collapse(
                        *known, C_out))
                why = scale_refusal(s_vec)
                if why:
                    rec.status, rec.reason = REFUSED, why
                    return
                s_val, t_val = s_vec, t_vec
            else:
                s_val, t_val = collapse(*self._ir_chain(real, C_out), C_out,
                                         xp=_IrArith(C_out, self.ct))
            if known and k_np is not None:
                kp_cast, why = round_kernel(k_np, _along(s_vec, kaxis, k_np.ndim), kd, kaxis)
                if why:
                    rec.status, rec.reason = REFUSED, why
                    return
                new_k = stablehlo.ConstantOp(numpy_to_dense(kp_cast, kdt)).result
                rec.rescale = "constant"
            else:
                s_ir = self._const_or(s_val, C_out)
                s_b = stablehlo.BroadcastInDimOp(
                    ir.RankedTensorType.get(_shape(kernel), self.ct), s_ir,
                    ir.DenseI64ArrayAttr.get([kaxis])).result
                k32 = self._convert(kernel, self.ct)
                new_k = self._convert(stablehlo.MulOp(k32, s_b).result, kdt)
                rec.rescale = "in-graph"
            t_of = lambda: self._convert(self._const_or(t_val, C_out), _etype(end_value))
            guard = not known and self.guard   # s is known only at run time: check it there
            rec.guarded = guard
            if not known and not self.guard:     # the caller checks these (hlofold._split)
                new_k = self._mark_prepared(new_k)
                t_ir = self._mark_prepared(t_of())
                t_of = lambda: t_ir
            if not guard:
                new_out = self._folded_ops(root, steps, kidx, new_k, t_of, out_t, out_axis)
            else:
                t_ir = t_of()
                t_of = lambda: t_ir
                # run-time guard: a non-finite folded kernel or bias (σ² = 0 with ε = 0, an
                # inf γ) runs the site's original ops instead
                pred = stablehlo.AndOp(all_finite(new_k), all_finite(t_ir)).result
                if_op = stablehlo.IfOp([out_t], pred)
                if_op.operation.attributes[GUARD_ATTR] = ir.UnitAttr.get()
                with ir.InsertionPoint(if_op.true_branch.blocks.append()):
                    stablehlo.ReturnOp([self._folded_ops(root, steps, kidx, new_k, t_of,
                                                         out_t, out_axis)])
                with ir.InsertionPoint(if_op.false_branch.blocks.append()):
                    mapping, last = {}, None
                    for op in [root] + [st.op for st in steps]:
                        new = op.clone()
                        _remap_operands(new, mapping)
                        mapping[op.results[0]] = last = new.results[0]
                    stablehlo.ReturnOp([last])
                new_out = if_op.results[0]
        end_value.replace_all_uses_with(new_out)
        self.dead.extend([s.op for s in reversed(steps)] + [root])

    def _folded_ops(self, root, steps, kidx, new_k, t_of, out_t, out_axis):
        """``root(x, new_k)``, the chain's casts replayed, plus ``broadcast(t_of())``."""
        operands = list(root.operands)
        operands[kidx] = new_k
        attrs = {n: root.attributes[n] for n in root.attributes}
        y = ir.Operation.create(_name(root), results=[root.results[0].type],
                                operands=operands, attributes=attrs,
                                loc=root.location).results[0]
        for s in steps:        # replay the casts and shape ops of the chain on the new result
            if s.kind == "convert":
                y = self._convert(y, _etype(s.op.results[0]))
            elif s.kind == "shape":
                new = s.op.clone()
                new.operands[0] = y
                y = new.results[0]
        t_b = stablehlo.BroadcastInDimOp(out_t, t_of(),
                                         ir.DenseI64ArrayAttr.get([steps[-1].axis])).result
        return stablehlo.AddOp(y, t_b).result

    def _mark_prepared(self, value):
        """``value`` through an op marked :data:`PREPARED_ATTR` (a folded kernel or bias
        computed in the graph, unguarded: whoever runs it checks that it is finite)."""
        op = stablehlo.ConvertOp(value.type, value)
        op.operation.attributes[PREPARED_ATTR] = ir.UnitAttr.get()
        return op.result

    def _vec(self, value, c):
        x = self.eval(value)
        return None if x is None else np.broadcast_to(np.asarray(x, np.float64).reshape(-1)
                                                      if np.size(x) > 1 else
                                                      np.asarray(x, np.float64).reshape(()),
                                                      (c,)).astype(np.float64)

    def _operand_np(self, op: _Operand):
        x = self.eval(op.value)
        if x is None:
            return None
        for et in op.casts:
            x = x.astype(np_dtype(et))
        return np.asarray(x, np.float64).reshape(-1) if op.axis is not None else \
            np.asarray(x, np.float64).reshape(())

    # -- IR builders (inside an insertion point)

    def _convert(self, value, etype):
        if str(_etype(value)) == str(etype):
            return value
        return stablehlo.ConvertOp(ir.RankedTensorType.get(_shape(value), etype), value).result

    def _const_or(self, val, c):
        if isinstance(val, np.ndarray):
            arr = np.broadcast_to(np.asarray(val, np.float64), (c,))
            return stablehlo.ConstantOp(numpy_to_dense(arr, self.ct)).result
        return val

    def _vector_ir(self, op: _Operand, c):
        """The operand as a tensor<c x f32> in the graph."""
        v = op.value
        for et in op.casts:
            v = self._convert(v, et)
        v = self._convert(v, self.ct)
        flat = stablehlo.ReshapeOp(ir.RankedTensorType.get([op.size], self.ct),
                                   v).result if _shape(v) != (op.size,) else v
        if op.size == c:
            return flat
        return stablehlo.BroadcastInDimOp(ir.RankedTensorType.get([c], self.ct),
                                          stablehlo.ReshapeOp(ir.RankedTensorType.get(
                                              [], self.ct), flat).result,
                                          ir.DenseI64ArrayAttr.get([])).result

    def _np_chain(self, steps, c):
        """The chain as (kinds, float64 operands), ``batch_norm_inference`` spelled out as
        sub μ, mul γ/√(σ²+ε), add β; None when an operand is not known at transform time."""
        kinds, vals = [], []
        for st in steps:
            if st.kind == "bn":
                v = {k: self._vec(st.bn[k], c) for k in ("scale", "offset", "mean", "variance")}
                if any(x is None for x in v.values()):
                    return None
                with np.errstate(all="ignore"):
                    sc = v["scale"] / np.sqrt(v["variance"] + st.bn["epsilon"])
                kinds += ["sub", "mul", "add"]
                vals += [v["mean"], sc, v["offset"]]
                continue
            x = None if st.operand is None else self._operand_np(st.operand)
            if st.operand is not None and x is None:
                return None
            kinds.append(st.kind)
            vals.append(x)
        return kinds, vals

    def _ir_chain(self, steps, c):
        """The same chain with operands as tensor<c x f32> values in the graph."""
        f32 = self.ct
        kinds, vals = [], []
        for st in steps:
            if st.kind == "bn":
                v = {k: self._convert(st.bn[k], f32) for k in
                     ("scale", "offset", "mean", "variance")}
                eps = stablehlo.ConstantOp(numpy_to_dense(
                    np.full(c, st.bn["epsilon"], np.float64), f32)).result
                sc = stablehlo.MulOp(v["scale"], stablehlo.RsqrtOp(
                    stablehlo.AddOp(v["variance"], eps).result).result).result
                kinds += ["sub", "mul", "add"]
                vals += [v["mean"], sc, v["offset"]]
                continue
            kinds.append(st.kind)
            vals.append(None if st.operand is None else self._vector_ir(st.operand, c))
        return kinds, vals


class _IrArith:
    """The arithmetic ``collapse`` needs, as StableHLO ops on tensor<c x f32> (constants
    for host values); used inside an insertion point."""

    def __init__(self, c: int, ct):
        self.c, self.ct = c, ct

    def asarray(self, x):
        if isinstance(x, (np.ndarray, float, int)):
            arr = np.broadcast_to(np.asarray(x, np.float64), (self.c,))
            return stablehlo.ConstantOp(numpy_to_dense(arr, self.ct)).result
        return x

    def add(self, a, b):
        return stablehlo.AddOp(a, b).result

    def sub(self, a, b):
        return stablehlo.SubtractOp(a, b).result

    def mul(self, a, b):
        return stablehlo.MulOp(a, b).result

    def div(self, a, b):
        return stablehlo.DivOp(a, b).result

    def neg(self, a):
        return stablehlo.NegOp(a).result


GUARD_ATTR = "hlofold.guard"     # marks a site's run-time guard: already folded
PREPARED_ATTR = "hlofold.prepared"   # marks an unguarded folded kernel or bias (guard=False)


def all_finite(value):
    """A ``tensor<i1>``: every element of ``value`` is finite (insert where you are)."""
    scalar = ir.RankedTensorType.get([], ir.IntegerType.get_signless(1))
    fin = stablehlo.IsFiniteOp(value).result
    init = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
        scalar, ir.IntegerAttr.get(ir.IntegerType.get_signless(1), 1))).result
    red = stablehlo.ReduceOp([scalar], [fin], [init],
                             ir.DenseI64ArrayAttr.get(list(range(len(_shape(value))))))
    body = red.body.blocks.append(scalar, scalar)
    with ir.InsertionPoint(body):
        stablehlo.ReturnOp([stablehlo.AndOp(body.arguments[0], body.arguments[1]).result])
    return red.results[0]


def reads(op) -> list:
    """The values ``op`` reads: its operands and, inside its regions, values from above."""
    out = list(op.operands)
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                out.extend(reads(inner))
    return out


def _roots_in(op) -> list:
    """The roots in ``op``'s regions, nested regions included (a multi-platform export puts
    its program in the branches of a ``stablehlo.case``), hlofold's own guards excepted."""
    out = []
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                inner = inner.operation if not isinstance(inner, ir.Operation) else inner
                if _name(inner) in _ROOTS:
                    out.append(inner)
                elif GUARD_ATTR not in inner.attributes:
                    out.extend(_roots_in(inner))
    return out


def _remap_operands(op, mapping):
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
                _remap_operands(inner, mapping)


def _along(vec, axis, ndim):
    shape = [1] * ndim
    shape[axis] = -1
    return np.asarray(vec).reshape(shape)


def _dce(module, inlined=frozenset()):
    """Erase side-effect-free ops whose results nobody uses (left behind by the rewrite), and
    the ``inlined`` private functions no longer called anywhere."""
    pure = {"stablehlo.constant", "stablehlo.broadcast_in_dim", "stablehlo.reshape",
            "stablehlo.convert", "stablehlo.add", "stablehlo.subtract", "stablehlo.multiply",
            "stablehlo.divide", "stablehlo.negate", "stablehlo.rsqrt", "stablehlo.sqrt"}
    changed = True
    while changed:
        changed = False
        for fop in module.body.operations:
            if _name(fop) != "func.func" or not fop.regions[0].blocks:
                continue
            for op in reversed(list(fop.regions[0].blocks[0].operations)):
                if _name(op) in pure and all(len(list(r.uses)) == 0 for r in op.results):
                    op.erase()
                    changed = True
    drop_uncalled_private(module, only=inlined)  # their calls were inlined away


def drop_uncalled_private(module, only=None) -> None:
    """Erase the private functions no ``func.call`` anywhere (nested regions included)
    calls; with ``only``, just those of these names."""
    called = set()

    def calls_in(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if _name(inner) == "func.call":
                        called.add(ir.FlatSymbolRefAttr(inner.attributes["callee"]).value)
                    calls_in(inner)
    for fop in module.body.operations:
        calls_in(fop)
    for fop in list(module.body.operations):
        if _name(fop) != "func.func" or "sym_visibility" not in fop.attributes or \
                ir.StringAttr(fop.attributes["sym_visibility"]).value != "private":
            continue
        name = ir.StringAttr(fop.attributes["sym_name"]).value
        if name not in called and (only is None or name in only):
            fop.erase()


def parse_module(text_or_bytes):
    """Parse a StableHLO module (text or bytecode) into hlofold's MLIR context, checked."""
    ctx = C.mlir_context()
    with ctx, ir.Location.unknown():
        try:
            module = ir.Module.parse(text_or_bytes)
        except Exception as e:   # MLIRError: keep the diagnostic, drop the traceback
            what = "truncated or corrupt MLIR bytecode" if isinstance(
                text_or_bytes, (bytes, bytearray)) else "not a readable MLIR module"
            detail = " ".join(l.strip() for l in str(e).splitlines()[:3])
            raise StableHLOError(f"{what}: {detail}") from None
        _check_stablehlo(module)
    return module


def fold_module(module, in_graph: bool = True, guard: bool = True) -> FoldReport:
    """Fold ``module`` in place (call inside its context); returns the report.
    ``in_graph``: fold sites whose weights are arguments with the rescale in the graph,
    guarded (else refuse them with :data:`WEIGHTS_ARE_ARGUMENTS`); ``guard=False``: without
    the run-time guard, the folded kernels and biases marked :data:`PREPARED_ATTR` for the
    caller to check (see :mod:`hlofold._split`)."""
    folder = _Pass(module, in_graph, guard)
    report = folder.run()
    if report.num_folded:         # nothing folded: the module stays exactly as it was
        _dce(module, folder.inlined)
    if not module.operation.verify():
        raise AssertionError("hlofold produced an invalid module")   # pragma: no cover
    return report


def fold_module_text(text_or_bytes, in_graph: bool = True) -> tuple[Any, FoldReport]:
    """Parse, fold and return ``(module, report)`` (module in hlofold's MLIR context)."""
    module = parse_module(text_or_bytes)
    with module.context, ir.Location.unknown():
        report = fold_module(module, in_graph)
    return module, report


def main_function(module):
    """The module's ``@main`` ``func.func``."""
    for op in module.body.operations:
        if _name(op) == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main" \
                and op.regions[0].blocks:
            return op
    raise StableHLOError("the module has no @main function")


def _check_stablehlo(module):
    names = set()
    for fop in module.body.operations:
        names.add(_name(fop))
        if _name(fop) == "func.func" and fop.regions[0].blocks:
            for op in fop.regions[0].blocks[0].operations:
                names.add(_name(op).split(".")[0])
    unknown = {n for n in names if n not in ("func", "stablehlo", "chlo", "func.func",
                                             "sdy", "mhlo", "shardy", "builtin")}
    if not any(_name(f) == "func.func" for f in module.body.operations):
        raise StableHLOError("the module has no func.func: not a StableHLO program")
    if unknown:
        raise StableHLOError(f"the module uses dialects hlofold does not handle: "
                             f"{sorted(unknown)}")
