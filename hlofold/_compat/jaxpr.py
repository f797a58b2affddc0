"""Reading and rebuilding jaxprs: the JAX internals the jaxpr adapter needs.

Every name is looked up through :func:`lookup.internal` (feature ``"jaxpr"`` unless said
otherwise); a missing one switches its feature off instead of failing the import.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Sequence

import jax

from .lookup import CompatError, internal, mark_changed, require


def _jx(name: str, feature: str = "jaxpr") -> Any:
    """``name`` from ``jax.extend.core``, else ``jax._src.core``."""
    return internal(feature, f"jax.extend.core:{name}", f"jax._src.core:{name}")


Jaxpr = _jx("Jaxpr")
# (0.12 keeps ClosedJaxpr only as an alias of Jaxpr in jax.extend.core; without it, one class)
ClosedJaxpr = internal("jaxpr", "jax.extend.core:ClosedJaxpr", "jax._src.core:ClosedJaxpr",
                       "jax.extend.core:Jaxpr")
JaxprEqn = _jx("JaxprEqn")
Literal = _jx("Literal")
Var = _jx("Var")
DropVar = _jx("DropVar")
check_jaxpr = _jx("check_jaxpr")
# JAX 0.11 merged the two classes: a ``Jaxpr`` carries its constants (its leading inputs
# with values attached), ``ClosedJaxpr`` is ``Jaxpr``, ``ClosedJaxpr(jaxpr, consts)`` attaches
# ``consts`` and ``.jaxpr`` is the jaxpr itself. hlofold's adapter keeps the 0.10 reading — a
# closed jaxpr is ``(.jaxpr, .consts)`` with ``.jaxpr.constvars`` paired with ``.consts`` —
# which both forms give; what differs is telling open from closed (:func:`is_closed`,
# :func:`as_closed`, ``params.param_jaxprs``).
MERGED: bool = ClosedJaxpr is Jaxpr
if MERGED and not all(hasattr(Jaxpr, a) for a in ("consts", "with_consts", "jaxpr")):
    mark_changed("ClosedJaxpr", "jaxpr", "its jaxpr classes (ClosedJaxpr is Jaxpr, which does "
                                         "not carry its constants)")

_eval_jaxpr = internal("jaxpr", "jax._src.core:eval_jaxpr")
Tracer = internal("jaxpr", "jax._src.core:Tracer")
ShapedArray = internal("jaxpr", "jax._src.core:ShapedArray")
DebugInfo = internal("jaxpr", "jax._src.core:DebugInfo", "jax.extend.core:DebugInfo")
_new_jaxpr_eqn = internal("jaxpr", "jax._src.core:new_jaxpr_eqn")
_join_effects = internal("jaxpr", "jax._src.core:join_effects")
_no_effects = internal("jaxpr", "jax._src.core:no_effects")
_convert_constvars = internal("jaxpr", "jax._src.interpreters.partial_eval:"
                                       "convert_constvars_jaxpr")
_partial_eval = internal("jaxpr", "jax._src.interpreters.partial_eval:"
                                  "partial_eval_jaxpr_nounits")
_trace_to_jaxpr = internal("jaxpr", "jax._src.interpreters.partial_eval:"
                                    "trace_to_jaxpr_dynamic")
_wrap_init = internal("jaxpr", "jax._src.linear_util:wrap_init")
# (jax 0.10.0 names it standard_insert_pvary; 0.10.2 has both, the newer one also inserting
# reshards of reduced operands)
_auto_insert_reshard = internal("shard_map", "jax._src.core:auto_insert_reshard",
                                "jax._src.core:standard_insert_pvary")
_SourceInfo = internal("source", "jax._src.source_info_util:SourceInfo")
_user_context = internal("source", "jax._src.source_info_util:user_context")
_current_name_stack = internal("source", "jax._src.source_info_util:current_name_stack")
_user_frames = internal("source", "jax._src.source_info_util:user_frames")
_user_frame = internal("source", "jax._src.source_info_util:user_frame")


def jaxpr_as_fun(closed: ClosedJaxpr) -> Callable:
    """``closed`` as a function of its inputs (:func:`eval_jaxpr`)."""
    def fun(*args):
        return eval_jaxpr(closed.jaxpr, closed.consts, *args)
    return fun


def is_closed(x: Any) -> bool:
    """Whether ``x`` is a closed jaxpr (on JAX 0.11+: any jaxpr, its constants attached)."""
    return isinstance(x, ClosedJaxpr)


def is_open(x: Any) -> bool:
    """Whether ``x`` is an open jaxpr (on JAX 0.11+: a jaxpr without attached constants)."""
    if MERGED:
        return isinstance(x, Jaxpr) and not x.consts
    return isinstance(x, Jaxpr) and not isinstance(x, ClosedJaxpr)


def closed_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any]) -> ClosedJaxpr:
    """``jaxpr`` closed over ``consts`` (its leading ``len(consts)`` inputs, its constvars,
    get those values; on 0.11+ any constants it carried are replaced)."""
    if MERGED:
        return jaxpr.with_consts(list(consts))
    return ClosedJaxpr(jaxpr, consts)


def as_closed(x: Any) -> ClosedJaxpr:
    """``x`` as a closed jaxpr: a closed one as it is, an open one without constants closed
    over nothing. A ``TypeError`` for anything else."""
    if is_closed(x):
        return x
    if is_open(x):
        return closed_jaxpr(x, ())
    raise TypeError(f"expected a jaxpr (from jax.make_jaxpr), got {type(x).__name__}")


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (``shard_map``'s vma type; empty elsewhere)."""
    mat = getattr(jax.typeof(x), "mat", None) if is_tracer(x) else None
    return getattr(mat, "varying", None) or frozenset()


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluate (or, under a trace, re-stage) an open jaxpr, keeping source info; inside
    ``shard_map``, with ``pvary`` inserted where :func:`bind_eqn` says."""
    if not any(varying_axes(a) for a in args):
        return _eval_jaxpr(jaxpr, consts, *args)
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
        invals = list(_auto_insert_reshard(*invals))
    with source_of(eqn), eqn.ctx.manager:
        ans = eqn.primitive.bind(*invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


# the name stack outside the outermost ``source_of``: nested ones (a folded site's equations
# under its root's) replace the equation's scopes instead of stacking them again
_OUTER_STACK: contextvars.ContextVar = contextvars.ContextVar("hlofold_outer_stack",
                                                              default=None)


def has_source() -> bool:
    """Whether source locations can be read and re-entered on this JAX."""
    try:
        require("source")
        return True
    except CompatError:
        return False


_HAS_SOURCE = has_source()


@contextlib.contextmanager
def source_of(eqn: JaxprEqn):
    """Context in which newly staged equations carry ``eqn``'s source location and name
    scopes (once: re-entered for another equation, the scopes are replaced, not stacked)."""
    if not _HAS_SOURCE:
        yield
        return
    outer = _OUTER_STACK.get()
    if outer is None:
        outer = _current_name_stack()
    token = _OUTER_STACK.set(outer)
    try:
        with _user_context(eqn.source_info.traceback,
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
    tb = eqn.source_info.traceback if _HAS_SOURCE else None
    if tb is None:
        return None, None, None
    for fr in _user_frames(tb):        # lazily: frames are converted one at a time
        name = fr.file_name.replace("\\", "/")
        if not any(m in name for m in _LIBRARY_MARKERS):
            return fr.file_name, fr.start_line, fr.function_name
    fr = _user_frame(tb)
    if fr is None:
        return None, None, None
    return fr.file_name, fr.start_line, fr.function_name


def rebase_source(eqn: JaxprEqn, old: JaxprEqn, new: JaxprEqn):
    """``eqn``'s source info, staged under ``old``'s (``source_of(old)``), as if staged under
    ``new``'s: ``new``'s traceback, and ``old``'s name scopes replaced by ``new``'s."""
    info = eqn.source_info
    if not _HAS_SOURCE:
        return info
    base = old.source_info.name_stack
    stack = info.name_stack.stack
    for k in range(len(stack) - len(base.stack) + 1):   # after any enclosing scope
        if stack[k:k + len(base.stack)] == base.stack:
            stack = stack[:k] + new.source_info.name_stack.stack + stack[k + len(base.stack):]
            break
    tb = new.source_info.traceback if info.traceback is old.source_info.traceback \
        else info.traceback
    return _SourceInfo(tb, type(info.name_stack)(stack))


def name_stack(eqn: JaxprEqn) -> str:
    return str(eqn.source_info.name_stack)


def hoist_consts(closed: ClosedJaxpr) -> tuple[Jaxpr, list[Any]]:
    """Turn a closed jaxpr's constants into leading inputs: (open jaxpr, const values)."""
    return _convert_constvars(closed.jaxpr), list(closed.consts)


def partial_eval(closed: ClosedJaxpr, unknowns: Sequence[bool],
                 instantiate: Sequence[bool]):
    """Split ``closed`` into known and unknown parts (see ``pe.partial_eval_jaxpr_nounits``).

    Returns ``(known, unknown, out_unknowns, residual_avals)``: ``known`` maps the known
    inputs to (known outputs, residuals); ``unknown`` maps (residuals, unknown inputs) to the
    unknown outputs.
    """
    return _partial_eval(closed, list(unknowns), list(instantiate))


def jit_info(fun: Callable) -> tuple[Callable, tuple[int, ...], tuple[str, ...],
                                     tuple[int, ...], tuple[str, ...], dict] | None:
    """For a ``jax.jit``-wrapped function: (wrapped python function, static_argnums,
    static_argnames, donate_argnums, donate_argnames, compiler_options). ``None`` for
    anything else; a
    :class:`CompatError` for a jitted function whose settings cannot be read."""
    info = getattr(fun, "_jit_info", None)
    inner = getattr(fun, "_fun", None)
    if info is None or inner is None:
        if all(callable(getattr(fun, a, None)) for a in ("lower", "trace", "eval_shape")):
            raise CompatError("jax.jit's wrapped functions (their _jit_info / _fun)", "jaxpr")
        return None
    try:
        return (inner, tuple(info.static_argnums or ()), tuple(info.static_argnames or ()),
                tuple(getattr(info, "donate_argnums", None) or ()),
                tuple(getattr(info, "donate_argnames", None) or ()),
                dict(getattr(info, "compiler_options_kvs", None) or ()))
    except (AttributeError, TypeError):
        raise CompatError("jax.jit's settings (_jit_info.static_argnums, ...)",
                          "jaxpr") from None


def is_tracer(x: Any) -> bool:
    return isinstance(x, Tracer)


def trace(fun: Callable, avals: Sequence[Any]) -> ClosedJaxpr:
    """Stage ``fun(*args)`` (a flat list of outputs or one output) into a closed jaxpr.

    Like ``jax.make_jaxpr`` without its ``jit`` machinery, which dominates the cost of
    tracing the many small functions that splice folded sites into a program.
    """
    def flat(*args):
        out = fun(*args)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    dbg = DebugInfo("hlofold", getattr(fun, "__name__", "fold"), None, None)
    in_avals = [_traced_aval(a) for a in avals]
    jaxpr, _, consts = _trace_to_jaxpr(_wrap_init(flat, debug_info=dbg), in_avals)
    return closed_jaxpr(jaxpr, consts)


def _traced_aval(a):
    """The ShapedArray a value is traced as: shape, dtype, weak type, and inside
    ``shard_map`` the manual axes it varies over."""
    if getattr(getattr(a, "mat", None), "varying", None):
        return a            # its type names the manual mesh too
    return ShapedArray(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))


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
        jaxpr = _convert_constvars(t.jaxpr)
        n = len(t.consts)
        ins = ([new_var(aval_of(c)) for c in consts[:k]] + jaxpr.invars[:n] +
               [new_var(aval_of(c)) for c in consts[k + n:]] + jaxpr.invars[n:])
        closed.append(closed_jaxpr(jaxpr.replace(invars=ins), []))
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
    info = _SourceInfo(source_info.traceback, source_info.name_stack.extend(scope)) \
        if _HAS_SOURCE else source_info
    effects = _join_effects(*(b.effects for b in branches))
    return _new_jaxpr_eqn([index, *operands], [out], lax.cond_p,
                          {"branches": tuple(branches)}, effects, info)


def add_eqn(x: Any, y: Any, out: Var, source_info: Any) -> JaxprEqn:
    """``out = x + y`` (``y`` may have size-1 dimensions where ``x`` has more), made without
    a trace."""
    from jax import lax
    return _new_jaxpr_eqn([x, y], [out], lax.add_p, {}, _no_effects, source_info)


def jaxpr_of(invars: Sequence[Var], eqns: Sequence[JaxprEqn], outvars: Sequence[Any]
             ) -> ClosedJaxpr:
    """A closed jaxpr made of existing equations (no trace)."""
    effects = frozenset().union(*(e.effects for e in eqns))
    dbg = DebugInfo("hlofold", "jaxpr_of", None, None)
    return closed_jaxpr(Jaxpr([], list(invars), list(outvars), list(eqns), effects, dbg), [])


def new_var(aval) -> Var:
    return Var(aval)


def aval_of(x):
    return jax.typeof(x)          # of a concrete or traced input


def shape_struct(aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
