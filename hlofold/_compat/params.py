"""Parameters of JAX's call and control-flow primitives, read and rebuilt in one place.

Each reader checks that the parameters it relies on are there with the kinds it expects, and
otherwise raises :class:`~hlofold._compat.lookup.CompatError` naming the primitive: the
nested-jaxpr rules then leave that equation as it is (its body is not entered), and the
report says why. JAX 0.11 replaced ``scan``'s ``num_consts``/``num_carry``/``linear`` with
flat trees (``ft_in``/``ft_out``): on such a JAX, scan bodies are not folded.
"""
from __future__ import annotations

from typing import Any

from .jaxpr import ClosedJaxpr, Jaxpr
from .lookup import CompatError

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
    """The open jaxpr of a ``checkpoint``/``remat``."""
    p = eqn.params
    if not isinstance(p.get("jaxpr"), Jaxpr) or isinstance(p.get("jaxpr"), ClosedJaxpr):
        raise CompatError(f"the parameters of {eqn.primitive.name} (expected an open jaxpr "
                          f"as jaxpr)", "jaxpr")
    return p["jaxpr"]


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


def scan_body(eqn) -> tuple[ClosedJaxpr, int]:
    """``(body, number of leading constant operands)`` of a ``scan``."""
    p = _expect(eqn, {"jaxpr": ClosedJaxpr, "num_consts": int, "num_carry": int})
    return p["jaxpr"], int(p["num_consts"])


def with_scan_body(params: dict, body: ClosedJaxpr, added_consts: int) -> dict:
    """``params`` with ``body`` taking ``added_consts`` new leading constants."""
    new = {**params, "jaxpr": body, "num_consts": params["num_consts"] + added_consts}
    if "linear" in params:
        new["linear"] = (False,) * added_consts + tuple(params["linear"])
    return new


def while_body(eqn) -> tuple[ClosedJaxpr, int, int]:
    """``(body, cond's constant operands, body's constant operands)`` of a ``while``; the
    body's operands are ``eqn.invars[cond consts:]``."""
    p = _expect(eqn, {"body_jaxpr": ClosedJaxpr, "cond_nconsts": int, "body_nconsts": int})
    return p["body_jaxpr"], int(p["cond_nconsts"]), int(p["body_nconsts"])


def with_while_body(params: dict, body: ClosedJaxpr, added_consts: int) -> dict:
    return {**params, "body_jaxpr": body,
            "body_nconsts": params["body_nconsts"] + added_consts}
