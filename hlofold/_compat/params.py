"""Parameters of JAX's call and control-flow primitives, read and rebuilt in one place.

Each reader checks that the parameters it relies on are there with the kinds it expects, and
otherwise raises :class:`~hlofold._compat.lookup.CompatError` naming the primitive: the
nested-jaxpr rules then leave that equation as it is (its body is not entered), and the
report says why. JAX 0.11 replaced ``scan``'s ``num_consts``/``num_carry``/``linear`` with
flat trees (``ft_in``/``ft_out``): on such a JAX, scan bodies are not folded.
"""
from __future__ import annotations

import functools
from typing import Any

import jax

from .jaxpr import MERGED, ClosedJaxpr, Jaxpr
from .lookup import CompatError, internal

# Higher-order primitives by name (names are stable; the objects move between modules).
JIT_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call"})


def _expect(eqn, kinds: dict[str, Any]) -> dict:
    """``eqn.params``, after checking each name in ``kinds`` is there with that kind."""
    p = eqn.params
    bad = [k for k, kind in kinds.items() if k not in p or not isinstance(p[k], kind)]
    if bad:
        have = ", ".join(sorted(p))
        raise CompatError(f"the parameters of {eqn.primitive.name} (expected "
                          f"{', '.join(bad)}; found {have})", "jaxpr")
    return p


def call_body(eqn) -> tuple[str, Any]:
    """``(param name, ClosedJaxpr or None)`` of a jit/pjit/custom_jvp/custom_vjp call."""
    key = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
    sub = eqn.params.get(key)
    return key, (sub if isinstance(sub, ClosedJaxpr) else None)


def with_call_consts(eqn, body: ClosedJaxpr, added: int) -> dict | None:
    """The parameters of a jit/pjit/closed_call ``eqn`` whose body (``body``) takes
    ``added`` new leading inputs (constants hoisted out of it: unsharded, not donated, any
    layout); None for a call whose parameters this cannot extend (custom_jvp/vjp calls)."""
    p, name = eqn.params, eqn.primitive.name
    if name in ("closed_call", "core_call"):
        return {**p, "call_jaxpr": body}
    if name not in JIT_NAMES or not all(isinstance(p.get(k), tuple) for k in
                                        ("in_shardings", "in_layouts", "donated_invars")):
        return None
    unspecified = [x for x in p["in_shardings"] + tuple(p.get("out_shardings", ()))
                   if type(x).__name__ == "UnspecifiedValue"]
    if not unspecified:              # no instance of "any sharding" to copy
        return None
    return {**p, "jaxpr": body,
            "in_shardings": (unspecified[0],) * added + p["in_shardings"],
            "in_layouts": (None,) * added + p["in_layouts"],
            "donated_invars": (False,) * added + p["donated_invars"]}


def call_constraints(eqn) -> tuple[list, list] | None:
    """What inlining a jit/pjit/closed_call keeps of its parameters: ``(in, out)``, per
    operand and result None or a ``NamedSharding`` on automatic mesh axes (inlined, a
    sharding constraint, as JAX's lowering writes it). None where inlining would drop
    something: layouts, donations, compiler options, explicit or manual axes, another kind
    of sharding."""
    if eqn.primitive.name not in JIT_NAMES or call_body(eqn)[1] is None:
        return None
    p = eqn.params
    if any(x is not None for x in (*p.get("in_layouts", ()), *p.get("out_layouts", ()))) or \
            any(p.get("donated_invars", ())) or p.get("compiler_options_kvs"):
        return None
    auto = jax.sharding.AxisType.Auto

    def one(x):
        if type(x).__name__ == "UnspecifiedValue":
            return None
        if isinstance(x, jax.sharding.NamedSharding) and \
                all(t == auto for t in getattr(x.mesh, "axis_types", (None,))):
            return x
        return False
    ins = [one(x) for x in p.get("in_shardings", ())]
    outs = [one(x) for x in p.get("out_shardings", ())]
    return None if any(x is False for x in ins + outs) else (ins, outs)


def inlinable_call(eqn) -> bool:
    """A call whose body can take its place (:func:`call_constraints`: its shardings, if
    any, written as constraints)."""
    return call_constraints(eqn) is not None


def constraint_eqn(x, out, sharding):
    """The equation ``out = with_sharding_constraint(x, sharding)`` (as JAX traces it)."""
    return _constraint_template(tuple(x.aval.shape), x.aval.dtype, sharding).replace(
        invars=[x], outvars=[out])


@functools.lru_cache(maxsize=256)
def _constraint_template(shape: tuple, dtype, sharding):
    """One traced constraint per type and sharding (traced once, its variables replaced)."""
    closed = jax.make_jaxpr(lambda v: jax.lax.with_sharding_constraint(v, sharding))(
        jax.ShapeDtypeStruct(shape, dtype))
    (e,) = closed.jaxpr.eqns
    return e


def remat_body(eqn) -> Jaxpr:
    """The open jaxpr of a ``checkpoint``/``remat``."""
    p = eqn.params
    if not _is_open_jaxpr(p.get("jaxpr")):
        raise CompatError(f"the parameters of {eqn.primitive.name} (expected an open jaxpr "
                          f"as jaxpr)", "jaxpr")
    return p["jaxpr"]


REMAT_NAMES = ("checkpoint", "remat", "remat2")


def remat_without_consts(eqn) -> bool:
    """A ``checkpoint``/``remat`` whose body has no constants of its own (its values are its
    body's, inlined: what reading it needs)."""
    if eqn.primitive.name not in REMAT_NAMES:
        return False
    try:
        return not remat_body(eqn).constvars
    except CompatError:
        return False


def forward_remat(eqn) -> bool:
    """:func:`remat_without_consts`, traced forward only (``differentiated`` False: no
    gradient was taken through it yet): lowered, it is its body (JAX's lowering evaluates it
    inline; only a later gradient reads its boundary)."""
    return eqn.params.get("differentiated") is False and remat_without_consts(eqn)


# The parameters that hold *open* jaxprs (their constants are operands of the equation): on
# JAX 0.10 told by class; on 0.11+, where every jaxpr is one class, by this table, read from
# 0.10 (``checkpoint``/``remat``, ``shard_map``, scatters' update, ``run_state``, Pallas).
# Every other jaxpr in an equation's parameters is closed.
OPEN_SLOTS = frozenset({("checkpoint", "jaxpr"), ("remat", "jaxpr"), ("remat2", "jaxpr"),
                        ("shard_map", "jaxpr"), ("run_state", "jaxpr"),
                        ("pallas_call", "jaxpr"), ("select_and_scatter", "select_jaxpr"),
                        ("select_and_scatter", "scatter_jaxpr")})
_OPEN_KEYS = frozenset({"update_jaxpr"})         # scatter, scatter-add, ...


def _is_open_jaxpr(x) -> bool:
    if MERGED:
        return isinstance(x, Jaxpr) and not x.consts
    return isinstance(x, Jaxpr) and not isinstance(x, ClosedJaxpr)


def is_closed_param(eqn, key: str, x) -> bool:
    """Whether ``x``, in ``eqn``'s parameter ``key``, is a closed jaxpr (hlofold folds inside
    those; an open one's constants are the equation's operands)."""
    if MERGED:
        return isinstance(x, Jaxpr) and (eqn.primitive.name, key) not in OPEN_SLOTS \
            and key not in _OPEN_KEYS
    return isinstance(x, ClosedJaxpr)


def param_jaxprs(eqn):
    """``(jaxpr, closed)`` for every jaxpr in ``eqn``'s parameters (each element of a tuple
    of them too): ``closed`` as :func:`is_closed_param` says."""
    for key, v in eqn.params.items():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, (ClosedJaxpr, Jaxpr)):
                yield x, is_closed_param(eqn, key, x)


def with_remat_body(params: dict, jaxpr: Jaxpr) -> dict:
    return {**params, "jaxpr": jaxpr}


def cond_branches(eqn) -> tuple:
    """The branches (ClosedJaxprs) of a ``cond``; its operands are ``eqn.invars[1:]``."""
    p = _expect(eqn, {"branches": (tuple, list)})
    if not all(isinstance(b, ClosedJaxpr) for b in p["branches"]):
        raise CompatError("the parameters of cond (branches that are not closed jaxprs)",
                          "jaxpr")
    return tuple(p["branches"])


def with_cond_branches(params: dict, branches) -> dict:
    return {**params, "branches": tuple(branches)}


# JAX 0.11 gave ``scan`` flat trees for its operands and results (``ft_in = (consts, carry,
# xs)``, ``ft_out = (carry, ys)``) instead of the counts ``num_consts``/``num_carry`` and the
# ``linear`` flags; both forms are read here, and a rebuilt scan keeps the form it had.
_FT = internal("jaxpr", "jax._src.flattree") if MERGED else None   # (0.11 brought both)


def _scan_counts(eqn_or_params) -> tuple[int, int]:
    """``(constant operands, carried operands)`` of a ``scan`` in either form."""
    p = getattr(eqn_or_params, "params", eqn_or_params)
    if "ft_in" in p and "num_consts" not in p:
        if _FT is None:
            raise CompatError("the parameters of scan (flat trees without jax._src.flattree)",
                              "jaxpr")
        try:
            consts, carry, _ = p["ft_in"].unpack()
            return len(consts), len(carry)
        except (AttributeError, TypeError, ValueError):
            raise CompatError("the parameters of scan (ft_in is not three flat trees)",
                              "jaxpr") from None
    if not all(isinstance(p.get(k), int) for k in ("num_consts", "num_carry")):
        have = ", ".join(sorted(p))
        raise CompatError(f"the parameters of scan (expected num_consts, num_carry or "
                          f"ft_in; found {have})", "jaxpr")
    return int(p["num_consts"]), int(p["num_carry"])


def scan_body(eqn) -> tuple[ClosedJaxpr, int]:
    """``(body, number of leading constant operands)`` of a ``scan``."""
    p = _expect(eqn, {"jaxpr": ClosedJaxpr})
    return p["jaxpr"], _scan_counts(eqn)[0]


def scan_layout(eqn) -> tuple[int, int, int]:
    """``(constant operands, carried operands, length)`` of a ``scan``; the rest of its
    operands are the scanned ones (sliced along axis 0, one slice per iteration)."""
    p = _expect(eqn, {"jaxpr": ClosedJaxpr, "length": int})
    return (*_scan_counts(eqn), int(p["length"]))


def scan_reverse(eqn) -> bool:
    """Whether a ``scan`` runs its iterations from the last to the first."""
    p = _expect(eqn, {"reverse": bool})
    return bool(p["reverse"])


def with_scan_body(params: dict, body: ClosedJaxpr, added_consts: int) -> dict:
    """``params`` with ``body`` taking ``added_consts`` new leading constants."""
    return with_scan_operands(params, body, added_consts + _scan_counts(params)[0],
                              [False] * added_consts + list(scan_linear(params)))


def scan_linear(params: dict) -> tuple:
    """Which operands of a ``scan`` are linear (empty where JAX does not say)."""
    return tuple(params.get("linear", ()))


def with_scan_operands(params: dict, body: ClosedJaxpr, num_consts: int, linear) -> dict:
    """``params`` of a ``scan`` whose operands were rebuilt: ``body`` taking ``num_consts``
    constants, the carry as before, then the scanned operands; ``linear`` one flag per
    operand (ignored where JAX keeps none)."""
    new = {**params, "jaxpr": body}
    if "ft_in" in params and "num_consts" not in params:
        _, carry, _ = params["ft_in"].unpack()
        n_xs = len(body.jaxpr.invars) - num_consts - len(carry)
        new["ft_in"] = _FT.pack((_FT.nones(num_consts), carry, _FT.nones(n_xs)))
        return new
    new["num_consts"] = num_consts
    if "linear" in params:
        new["linear"] = tuple(linear)
    return new


def while_body(eqn) -> tuple[ClosedJaxpr, int, int]:
    """``(body, cond's constant operands, body's constant operands)`` of a ``while``; the
    body's operands are ``eqn.invars[cond consts:]``."""
    p = _expect(eqn, {"body_jaxpr": ClosedJaxpr, "cond_nconsts": int, "body_nconsts": int})
    return p["body_jaxpr"], int(p["cond_nconsts"]), int(p["body_nconsts"])


def with_while_body(params: dict, body: ClosedJaxpr, added_consts: int) -> dict:
    return {**params, "body_jaxpr": body,
            "body_nconsts": params["body_nconsts"] + added_consts}
