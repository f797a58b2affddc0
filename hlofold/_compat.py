"""Every use of JAX internals in hlofold lives here.

hlofold reads and rebuilds jaxprs, which needs a few names that JAX keeps in ``jax.extend``
or ``jax._src``. Keeping them in one module means a JAX upgrade touches one file.
Tested against jax 0.10.x.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jex_core
from jax._src import core as _core
from jax._src import source_info_util as _siu
from jax._src.interpreters import partial_eval as _pe

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
DropVar = jex_core.DropVar
check_jaxpr = jex_core.check_jaxpr


def jaxpr_as_fun(closed: ClosedJaxpr) -> Callable:
    """``closed`` as a function of its inputs (:func:`eval_jaxpr`)."""
    def fun(*args):
        return eval_jaxpr(closed.jaxpr, closed.consts, *args)
    return fun


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (``shard_map``'s vma type; empty elsewhere)."""
    mat = getattr(jax.typeof(x), "mat", None) if is_tracer(x) else None
    return getattr(mat, "varying", None) or frozenset()


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluate (or, under a trace, re-stage) an open jaxpr, keeping source info; inside
    ``shard_map``, with ``pvary`` inserted where :func:`bind_eqn` says."""
    if not any(varying_axes(a) for a in args):
        return _core.eval_jaxpr(jaxpr, consts, *args)
    env: dict = {**dict(zip(jaxpr.constvars, consts)), **dict(zip(jaxpr.invars, args))}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]      # noqa: E731
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, bind_eqn(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]


def in_manual_context() -> bool:
    """Whether the current trace is inside ``shard_map`` (no device placement there)."""
    return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def _has_subjaxpr(eqn) -> bool:
    return any(isinstance(p, (ClosedJaxpr, Jaxpr)) or (
        isinstance(p, (tuple, list)) and any(isinstance(q, (ClosedJaxpr, Jaxpr)) for q in p))
        for p in eqn.params.values())


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Bind ``eqn``'s primitive on ``invals`` the way ``core.eval_jaxpr`` does.

    The equation's source location and name stack are re-entered so that a retraced
    equation keeps the user's file and line. Inside ``shard_map`` (inputs whose types vary
    over different manual mesh axes), ``pvary`` is inserted first. Always returns a list of
    outputs.
    """
    bind_params = eqn.primitive.get_bind_params(params if params is not None else eqn.params)
    if len(invals) > 1 and not _has_subjaxpr(eqn) and \
            len({varying_axes(x) for x in invals}) > 1:
        # inside shard_map, a folded kernel or bias (the same on every shard) meets a
        # varying activation: insert ``pvary`` as ``lax`` does when it traces
        invals = list(_core.auto_insert_reshard(*invals))
    with source_of(eqn), eqn.ctx.manager:
        ans = eqn.primitive.bind(*invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


# the name stack outside the outermost ``source_of``: nested ones (a folded site's equations
# under its root's) replace the equation's scopes instead of stacking them again
_OUTER_STACK: contextvars.ContextVar = contextvars.ContextVar("hlofold_outer_stack",
                                                              default=None)


@contextlib.contextmanager
def source_of(eqn: JaxprEqn):
    """Context in which newly staged equations carry ``eqn``'s source location and name
    scopes (once: re-entered for another equation, the scopes are replaced, not stacked)."""
    outer = _OUTER_STACK.get()
    if outer is None:
        outer = _siu.current_name_stack()
    token = _OUTER_STACK.set(outer)
    try:
        with _siu.user_context(eqn.source_info.traceback,
                               name_stack=outer + eqn.source_info.name_stack):
            yield
    finally:
        _OUTER_STACK.reset(token)


_LIBRARY_MARKERS = ("/jax/", "/jaxlib/", "/flax/", "/haiku/", "/equinox/", "/keras/",
                    "/hlofold/", "/optax/", "/contextlib.py", "/functools.py")


def user_location(eqn: JaxprEqn) -> tuple[str | None, int | None, str | None]:
    """(file, line, function) of the first frame of ``eqn`` outside JAX and the NN libraries.

    Falls back to JAX's own notion of the user frame (which may sit inside Flax/Haiku).
    """
    tb = eqn.source_info.traceback
    if tb is None:
        return None, None, None
    for fr in _siu.user_frames(tb):        # lazily: frames are converted one at a time
        name = fr.file_name.replace("\\", "/")
        if not any(m in name for m in _LIBRARY_MARKERS):
            return fr.file_name, fr.start_line, fr.function_name
    fr = _siu.user_frame(tb)
    if fr is None:
        return None, None, None
    return fr.file_name, fr.start_line, fr.function_name


def rebase_source(eqn: JaxprEqn, old: JaxprEqn, new: JaxprEqn):
    """``eqn``'s source info, staged under ``old``'s (``source_of(old)``), as if staged under
    ``new``'s: ``new``'s traceback, and ``old``'s name scopes replaced by ``new``'s."""
    info, base = eqn.source_info, old.source_info.name_stack
    stack = info.name_stack.stack
    for k in range(len(stack) - len(base.stack) + 1):   # after any enclosing scope
        if stack[k:k + len(base.stack)] == base.stack:
            stack = stack[:k] + new.source_info.name_stack.stack + stack[k + len(base.stack):]
            break
    tb = new.source_info.traceback if info.traceback is old.source_info.traceback \
        else info.traceback
    return _siu.SourceInfo(tb, type(info.name_stack)(stack))


def name_stack(eqn: JaxprEqn) -> str:
    return str(eqn.source_info.name_stack)


def hoist_consts(closed: ClosedJaxpr) -> tuple[Jaxpr, list[Any]]:
    """Turn a closed jaxpr's constants into leading inputs: (open jaxpr, const values)."""
    return _pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def partial_eval(closed: ClosedJaxpr, unknowns: Sequence[bool],
                 instantiate: Sequence[bool]):
    """Split ``closed`` into known and unknown parts (see ``pe.partial_eval_jaxpr_nounits``).

    Returns ``(known, unknown, out_unknowns, residual_avals)``: ``known`` maps the known
    inputs to (known outputs, residuals); ``unknown`` maps (residuals, unknown inputs) to the
    unknown outputs.
    """
    return _pe.partial_eval_jaxpr_nounits(closed, list(unknowns), list(instantiate))


def jit_info(fun: Callable) -> tuple[Callable, tuple[int, ...], tuple[str, ...],
                                     tuple[int, ...], tuple[str, ...]] | None:
    """For a ``jax.jit``-wrapped function: (wrapped python function, static_argnums,
    static_argnames, donate_argnums, donate_argnames). ``None`` for anything else."""
    info = getattr(fun, "_jit_info", None)
    inner = getattr(fun, "_fun", None)
    if info is None or inner is None:
        return None
    return (inner, tuple(info.static_argnums or ()), tuple(info.static_argnames or ()),
            tuple(getattr(info, "donate_argnums", None) or ()),
            tuple(getattr(info, "donate_argnames", None) or ()))


def is_tracer(x: Any) -> bool:
    return isinstance(x, _core.Tracer)


def trace(fun: Callable, avals: Sequence[Any]) -> ClosedJaxpr:
    """Stage ``fun(*args)`` (a flat list of outputs or one output) into a closed jaxpr.

    Like ``jax.make_jaxpr`` without its ``jit`` machinery, which dominates the cost of
    tracing the many small functions that splice folded sites into a program.
    """
    from jax._src import linear_util as lu

    def flat(*args):
        out = fun(*args)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    dbg = _core.DebugInfo("hlofold", getattr(fun, "__name__", "fold"), None, None)
    in_avals = [_traced_aval(a) for a in avals]
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(lu.wrap_init(flat, debug_info=dbg), in_avals)
    return ClosedJaxpr(jaxpr, consts)


def _traced_aval(a):
    """The ShapedArray a value is traced as: shape, dtype, weak type, and inside
    ``shard_map`` the manual axes it varies over."""
    if getattr(getattr(a, "mat", None), "varying", None):
        return a            # its type names the manual mesh too
    return _core.ShapedArray(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))


def stage_cond(pred: Any, branches: Sequence[Callable], operands: Sequence[Any]) -> Any:
    """``branches[int(pred)](*operands)`` as one ``cond`` equation of the current trace.

    What ``lax.cond`` stages, without its pytree and checking machinery (which costs more
    than the branches when a fold stages one guard per site): each branch is traced on
    the operands' types, its constants become leading operands shared by both branches.
    Each branch returns one array; a branch given as a ``ClosedJaxpr`` (of the operands'
    types) is used as it is.
    """
    from jax import lax
    avals = [aval_of(o) for o in operands]
    traced = [b if isinstance(b, ClosedJaxpr) else trace(b, avals) for b in branches]
    consts = [c for t in traced for c in t.consts]
    closed, k = [], 0
    for t in traced:
        jaxpr = _pe.convert_constvars_jaxpr(t.jaxpr)
        n = len(t.consts)
        ins = ([new_var(aval_of(c)) for c in consts[:k]] + jaxpr.invars[:n] +
               [new_var(aval_of(c)) for c in consts[k + n:]] + jaxpr.invars[n:])
        closed.append(ClosedJaxpr(jaxpr.replace(invars=ins), []))
        k += n
    index = lax.convert_element_type(pred, "int32")
    out = lax.cond_p.bind(index, *consts, *operands, branches=tuple(closed))
    return out[0]


def cond_eqn(index: Any, operands: Sequence[Any], branches: Sequence[ClosedJaxpr], out: Var,
             source_info: Any, scope: str) -> JaxprEqn:
    """``out = branches[index](*operands)``, a ``cond`` equation made without a trace: the
    branches are closed jaxprs of the operands' types, without constants; the equation
    carries ``source_info`` with the name scope ``scope`` added."""
    from jax import lax
    info = _siu.SourceInfo(source_info.traceback, source_info.name_stack.extend(scope))
    effects = _core.join_effects(*(b.effects for b in branches))
    return _core.new_jaxpr_eqn([index, *operands], [out], lax.cond_p,
                               {"branches": tuple(branches)}, effects, info)


def add_eqn(x: Any, y: Any, out: Var, source_info: Any) -> JaxprEqn:
    """``out = x + y`` (``y`` may have size-1 dimensions where ``x`` has more), made without
    a trace."""
    from jax import lax
    return _core.new_jaxpr_eqn([x, y], [out], lax.add_p, {}, _core.no_effects, source_info)


def jaxpr_of(invars: Sequence[Var], eqns: Sequence[JaxprEqn], outvars: Sequence[Any]
             ) -> ClosedJaxpr:
    """A closed jaxpr made of existing equations (no trace)."""
    effects = frozenset().union(*(e.effects for e in eqns))
    dbg = _core.DebugInfo("hlofold", "jaxpr_of", None, None)
    return ClosedJaxpr(Jaxpr([], list(invars), list(outvars), list(eqns), effects, dbg), [])


def new_var(aval) -> Var:
    return _core.Var(aval)


def aval_of(x):
    return jax.typeof(x)          # of a concrete or traced input


def shape_struct(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


# Higher-order primitives by name (names are stable; the objects move between modules).
JIT_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call"})


# ---------------------------------------------------------------------- StableHLO / MLIR

bfloat16 = jax.numpy.bfloat16


def mlir():
    """jaxlib's bundled MLIR Python bindings: ``(ir, stablehlo, func)``."""
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import func, stablehlo
    return ir, stablehlo, func


# ---- parameters of JAX's call and control-flow primitives (jax 0.10). One place to adapt
# when they change: JAX's main branch replaces scan's ``num_consts``/``num_carry`` with a
# flat-tree structure (jax-ml/jax pull 39005).


def call_body(eqn) -> tuple[str, Any]:
    """``(param name, ClosedJaxpr or None)`` of a jit/pjit/custom_jvp/custom_vjp call."""
    key = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
    sub = eqn.params.get(key)
    return key, (sub if isinstance(sub, ClosedJaxpr) else None)


def inlinable_call(eqn) -> bool:
    """A jit/pjit/closed_call whose parameters say nothing but its body: no shardings,
    layouts, donations or compiler options, which inlining the body would drop."""
    if eqn.primitive.name not in JIT_NAMES or call_body(eqn)[1] is None:
        return False
    p = eqn.params
    return (all(type(x).__name__ == "UnspecifiedValue"
                for x in (*p.get("in_shardings", ()), *p.get("out_shardings", ())))
            and all(x is None for x in (*p.get("in_layouts", ()), *p.get("out_layouts", ())))
            and not any(p.get("donated_invars", ())) and not p.get("compiler_options_kvs"))


def remat_body(eqn) -> Jaxpr:
    return eqn.params["jaxpr"]        # an open jaxpr


def with_remat_body(params: dict, jaxpr: Jaxpr) -> dict:
    return {**params, "jaxpr": jaxpr}


def cond_branches(eqn) -> tuple:
    """The branches (ClosedJaxprs) of a ``cond``; its operands are ``eqn.invars[1:]``."""
    return tuple(eqn.params["branches"])


def with_cond_branches(params: dict, branches) -> dict:
    return {**params, "branches": tuple(branches)}


def scan_body(eqn) -> tuple[ClosedJaxpr, int]:
    """``(body, number of leading constant operands)`` of a ``scan``."""
    return eqn.params["jaxpr"], int(eqn.params["num_consts"])


def with_scan_body(params: dict, body: ClosedJaxpr, added_consts: int) -> dict:
    """``params`` with ``body`` taking ``added_consts`` new leading constants."""
    new = {**params, "jaxpr": body, "num_consts": params["num_consts"] + added_consts}
    if "linear" in params:
        new["linear"] = (False,) * added_consts + tuple(params["linear"])
    return new


def while_body(eqn) -> tuple[ClosedJaxpr, int, int]:
    """``(body, cond's constant operands, body's constant operands)`` of a ``while``; the
    body's operands are ``eqn.invars[cond consts:]``."""
    p = eqn.params
    return p["body_jaxpr"], int(p["cond_nconsts"]), int(p["body_nconsts"])


def with_while_body(params: dict, body: ClosedJaxpr, added_consts: int) -> dict:
    return {**params, "body_jaxpr": body,
            "body_nconsts": params["body_nconsts"] + added_consts}


def location_view(loc) -> tuple[str, Any]:
    """``(kind, view)`` of an MLIR location: kind "file", "name", "fused", "callsite" or
    "unknown", ``view`` with that kind's accessors (jaxlib 0.10.2 has a class per kind;
    0.10.0 puts ``is_a_*()`` and every accessor on ``Location``)."""
    ir = mlir()[0]
    if hasattr(ir, "FileLineColLoc"):
        for kind, cls in (("file", ir.FileLineColLoc), ("name", ir.NameLoc),
                          ("fused", ir.FusedLoc), ("callsite", ir.CallSiteLoc)):
            try:
                return kind, cls(loc)
            except Exception:
                continue
        return "unknown", loc
    for kind in ("file", "name", "fused", "callsite"):
        if getattr(loc, f"is_a_{kind}")():
            return kind, loc
    return "unknown", loc


def mlir_context():
    """A fresh MLIR context with the dialects JAX registers (stablehlo, chlo, func, ...)."""
    from jax._src.interpreters import mlir as _jmlir
    return _jmlir.make_ir_context()


def module_to_portable_artifact(module) -> bytes:
    """Serialize a module as JAX serializes exported modules (a StableHLO portable artifact)."""
    from jax._src.export import _export
    return _export._module_to_bytecode(module)


def exported_with_inputs(exp, kept, new_avals, module_bytes):
    """``exp`` (a ``jax.export.Exported``) with the module ``module_bytes`` whose inputs are
    ``exp``'s inputs ``kept`` (in order) and then new inputs of ``new_avals`` (unsharded):
    flat positional inputs. Touches ``Exported``'s private sharding fields (jax 0.10)."""
    import dataclasses
    avals = [exp.in_avals[i] for i in kept] + [_core.ShapedArray(a.shape, a.dtype)
                                               for a in new_avals]
    extra = (None,) * len(new_avals)
    fields = dict(
        in_tree=jax.tree_util.tree_structure((tuple(range(len(avals))), {})),
        in_avals=tuple(avals),
        in_shardings_hlo=tuple(exp.in_shardings_hlo[i] for i in kept) + extra,
        module_kept_var_idx=tuple(range(len(avals))),
        mlir_module_serialized=module_bytes)
    named = getattr(exp, "_in_named_shardings", None)
    if named is not None:
        fields["_in_named_shardings"] = tuple(named[i] for i in kept) + extra
    return dataclasses.replace(exp, **fields)
