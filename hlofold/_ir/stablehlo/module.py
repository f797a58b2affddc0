"""StableHLO modules as a whole: parse and check one, find its ``@main``, its private
functions and their calls, and erase what a rewrite left unused.

The per-value and per-op vocabulary (names, shapes, types, constants, in-graph arithmetic)
is :mod:`hlofold._ir.stablehlo.ir`.
"""
from __future__ import annotations

import contextlib
import gc
import threading

from hlofold import _compat as C
from .ir import StableHLOError, op_name, owner_op, parent_of
from .ops import OPS

ir, stablehlo, func_dialect = C.mlir()


PURE = OPS.names(lambda o: o.pure)       # erased where their results are unused


_gc_lock = threading.Lock()
_gc_state = {"depth": 0, "was_enabled": False}


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off while a pass makes its many short-lived
    objects (a wrapper per op and value it touches: a full collection would walk the whole
    heap, JAX's included, several times per fold); back on, as it was, when the last of
    the threads in such a pass leaves it. What becomes garbage meanwhile is collected after."""
    with _gc_lock:
        if _gc_state["depth"] == 0:
            _gc_state["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_state["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["depth"] -= 1
            if _gc_state["depth"] == 0 and _gc_state["was_enabled"]:
                gc.enable()


def erase_unused(ops) -> None:
    """Erase those of ``ops`` (and, in turn, of the ops computing their operands) that are
    side-effect free and whose results nobody uses: what a rewrite left behind, found from
    the ops it replaced, without a walk over the whole program. ``ops`` must all be live."""
    todo, queued = [], set()     # each op once in ``todo`` (several Python objects may
    #                              stand for one op: a second one would outlive the erase)

    def push(op):
        if op is not None and op not in queued:
            queued.add(op)
            todo.append(op)
    for op in ops:
        push(op.operation)
    while todo:
        op = todo.pop()
        queued.discard(op)       # re-queued if a reader erased later was its last
        if op.name in PURE and all(next(iter(r.uses), None) is None for r in op.results):
            producers = [owner_op(v) for v in op.operands]
            op.erase()
            for p in producers:
                push(p)


def call_sites(module) -> dict:
    """Every ``func.call`` of the module (nested regions included), by callee name."""
    out: dict = {}

    def calls_in(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if op_name(inner) == "func.call":
                        out.setdefault(ir.FlatSymbolRefAttr(inner.attributes["callee"]).value,
                                       []).append(inner)
                    calls_in(inner)
    for fop in module.body.operations:
        calls_in(fop)
    return out


# the attributes by which an op refers to a function: func.call's callee, a composite's
# decomposition, a custom_call's called computations
SYMBOL_ATTRS = ("callee", "decomposition", "called_computations")


def functions(module) -> dict:
    """The module's ``func.func`` ops by name."""
    return {ir.StringAttr(op.attributes["sym_name"]).value: op
            for op in module.body.operations if op_name(op) == "func.func"}


def is_private(fop) -> bool:
    """Whether ``fop`` is a private function with a body (one a call may be replaced by)."""
    return fop is not None and bool(fop.regions[0].blocks) and \
        "sym_visibility" in fop.attributes and \
        ir.StringAttr(fop.attributes["sym_visibility"]).value == "private"


def private_body(call):
    """The body block of the private function a ``func.call`` calls, or None (a public or
    external function, or a callee not found in the call's module)."""
    top = call
    while (p := parent_of(top)) is not None:
        top = p
    name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
    callee = next((op for op in top.regions[0].blocks[0].operations
                   if op_name(op) == "func.func" and
                   ir.StringAttr(op.attributes["sym_name"]).value == name), None)
    return callee.regions[0].blocks[0] if is_private(callee) else None


def entering_value(arg, calls):
    """The value a block argument always holds, where one can be named: for a loop-invariant
    argument of a ``stablehlo.while`` (the body returns it unchanged), the loop's operand;
    for an argument of a private function called once (``calls()``: name -> call ops, asked
    only then: finding them walks the module), the call's operand; for an argument of a
    ``shard_map`` body (``sdy.manual_computation``) of the operand's own type (replicated:
    every device holds all of it), the operand. None otherwise (a sharded one is a shard). As a nested jaxpr's inputs are known where the outer
    values are, so are these."""
    arg = ir.BlockArgument(arg)
    block, k = arg.owner, arg.arg_number
    holder = block.owner
    name = op_name(holder)
    if name == "stablehlo.while":
        body = holder.regions[1].blocks[0]
        ret = list(body.operations)[-1]
        if k < len(ret.operands) and ret.operands[k] == body.arguments[k]:
            return holder.operands[k]
        return None
    if name == "func.func":
        private = "sym_visibility" in holder.attributes and \
            ir.StringAttr(holder.attributes["sym_visibility"]).value == "private"
        if not private:
            return None
        sites = calls().get(ir.StringAttr(holder.attributes["sym_name"]).value, [])
        if len(sites) == 1:
            return sites[0].operands[k]
    if name == "sdy.manual_computation" and k < len(holder.operands) and \
            holder.operands[k].type == arg.type:
        return holder.operands[k]     # replicated into the manual body: the value itself
    return None


def drop_uncalled_private(module, only=None) -> None:
    """Erase the private functions nothing refers to — no ``func.call``, no
    ``stablehlo.composite``'s ``decomposition``, no ``custom_call``'s
    ``called_computations``, anywhere (nested regions included) in what is kept; with
    ``only``, just those of these names. Read as reachability from what stays, in one walk:
    a function called only from an erased one (a ``jit`` in a ``jit`` whose outer call was
    inlined) is erased too."""
    def refs_in(op, out: set) -> set:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    attrs = inner.attributes
                    for key in SYMBOL_ATTRS:
                        if key in attrs:
                            a = attrs[key]
                            refs = list(ir.ArrayAttr(a)) if isinstance(a, ir.ArrayAttr) else [a]
                            out.update(ir.FlatSymbolRefAttr(r).value for r in refs)
                    refs_in(inner, out)
        return out

    droppable, refs, todo = {}, {}, []
    for i, op in enumerate(module.body.operations):
        private = op_name(op) == "func.func" and "sym_visibility" in op.attributes and \
            ir.StringAttr(op.attributes["sym_visibility"]).value == "private"
        name = ir.StringAttr(op.attributes["sym_name"]).value if private else i
        if private and (only is None or name in only):
            droppable[name] = op
        else:
            todo.append(name)             # kept whatever refers to it: what it refers to too
        refs[name] = refs_in(op, set())
    reached = set(todo)
    while todo:
        for r in refs.get(todo.pop(), ()):
            if r not in reached:
                reached.add(r)
                todo.append(r)
    for name, op in droppable.items():
        if name not in reached:
            op.erase()


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
        check_stablehlo(module)
    return module


def main_function(module):
    """The module's ``@main`` ``func.func``."""
    for op in module.body.operations:
        if op_name(op) == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main" \
                and op.regions[0].blocks:
            return op
    raise StableHLOError("the module has no @main function")


def jax_const_arguments(main) -> list[int]:
    """The ``@main`` arguments marked ``jax.const``: constants JAX (0.12.1 and later,
    ``jax_use_simplified_jaxpr_constants``) passes as arguments of a ``Lowered``'s module —
    their values are not in the module."""
    if "arg_attrs" not in main.attributes:
        return []
    return [i for i, d in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"]))
            if "jax.const" in ir.DictAttr(d)]


def check_stablehlo(module):
    names, inner = set(), set()
    for fop in module.body.operations:
        names.add(op_name(fop).split(".")[0])       # func.func, sdy.mesh, ...
        if op_name(fop) == "func.func" and fop.regions[0].blocks:
            inner.update(op.operation.name for op in fop.regions[0].blocks[0].operations)
    names.update(n.split(".")[0] for n in inner)
    unknown = {n for n in names if n not in ("func", "stablehlo", "chlo", "sdy", "mhlo",
                                             "shardy", "builtin")}
    if not any(op_name(f) == "func.func" for f in module.body.operations):
        raise StableHLOError("the module has no func.func: not a StableHLO program")
    if unknown:
        raise StableHLOError(f"the module uses dialects hlofold does not handle: "
                             f"{sorted(unknown)}")


def walk(block):
    """Every op in ``block``, nested regions included, in program order."""
    for op in block.operations:
        yield op
        for region in op.regions:
            for b in region.blocks:
                yield from walk(b)
