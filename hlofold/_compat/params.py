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


def scan_layout(eqn) -> tuple[int, int, int]:
    """``(constant operands, carried operands, length)`` of a ``scan``; the rest of its
    operands are the scanned ones (sliced along axis 0, one slice per iteration)."""
    p = _expect(eqn, {"jaxpr": ClosedJaxpr, "num_consts": int, "num_carry": int,
                      "length": int})
    return int(p["num_consts"]), int(p["num_carry"]), int(p["length"])


def with_scan_body(params: dict, body: ClosedJaxpr, added_consts: int) -> dict:
    """``params`` with ``body`` taking ``added_consts`` new leading constants."""
    return with_scan_operands(params, body, added_consts + params["num_consts"],
                              [False] * added_consts + list(scan_linear(params)))


def scan_linear(params: dict) -> tuple:
    """Which operands of a ``scan`` are linear (all False where JAX does not say)."""
    return tuple(params.get("linear", ()))


def with_scan_operands(params: dict, body: ClosedJaxpr, num_consts: int, linear) -> dict:
    """``params`` of a ``scan`` whose operands were rebuilt: ``body`` taking ``num_consts``
    constants, the carry as before, then the scanned operands; ``linear`` one flag per
    operand."""
    new = {**params, "jaxpr": body, "num_consts": num_consts}
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
