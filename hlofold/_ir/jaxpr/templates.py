"""Templates of folded jaxpr sites: sites with equal plans are traced once and cloned.

:func:`template_key` describes a site's plan from its equations and plan fields themselves
(every dataclass field but those saying where a site is or what is reported of it, so a new
field cannot be forgotten): two sites with equal keys trace to the same equations up to
renaming. :func:`clone_eqns` renames one site's equations for another (fresh variables
inside, the other's inputs and end, its source location and name scope, also inside a
guard's branches). ``tests/parity/test_parity.py`` checks clones against a trace per site.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hlofold import _compat as C

# plan fields that say where a site is or what is reported of it, not what it computes
_NOT_PLAN = frozenset({"root_idx", "end_idx", "record", "t_traced"})
_SCALARS = frozenset({bool, int, float, str})
_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _plan_fields(tx: type) -> tuple[str, ...] | None:
    """The plan fields of a dataclass type (None for other types), computed once per type."""
    if tx not in _FIELDS:
        _FIELDS[tx] = (tuple(f.name for f in dataclasses.fields(tx) if f.name not in _NOT_PLAN)
                       if dataclasses.is_dataclass(tx) else None)
    return _FIELDS[tx]


def template_key(site, atoms: list, opts):
    """A hashable description of ``site``'s plan (``atoms``: the scope variables its
    equations read, numbered in this order; ``opts``: the fold's options). None when the
    site bakes a value known at transform time into its equations (it is traced on its
    own)."""
    index = {a: k for k, a in enumerate(atoms)}
    internal: dict[Any, int] = {}

    def atom(v):
        if isinstance(v, C.Literal):
            return ("literal", repr(v.val), v.aval.dtype)
        if v in index:
            return ("input", index[v])
        # an internal value's type follows from the inputs' types and the equations
        return ("internal", internal.setdefault(v, len(internal)))

    eqn_t, var_ts = C.JaxprEqn, (C.Var, C.Literal)

    def plan(x):
        tx = type(x)
        if x is None or tx in _SCALARS:
            return x
        if tx is list or tx is tuple:
            return tuple([plan(y) for y in x])
        if tx is eqn_t:
            return (x.primitive.name, tuple(sorted(x.params.items())),
                    tuple([atom(v) for v in x.invars]), tuple([atom(v) for v in x.outvars]))
        if isinstance(x, var_ts):
            return atom(x)
        if isinstance(x, np.ndarray):
            raise TypeError("a value known at transform time")
        names = _plan_fields(tx)
        if names is not None:
            return (tx, *[plan(getattr(x, f)) for f in names])
        if isinstance(x, (list, tuple)):
            return tuple([plan(y) for y in x])
        return x

    try:
        key = (plan(site), tuple([(a.aval.shape, a.aval.dtype,
                                   getattr(a.aval, "weak_type", False)) for a in atoms]), opts)
        hash(key)
    except TypeError:
        return None
    return key


def clone_eqns(eqns: list, from_atoms: list, to_atoms: list, from_end, to_end,
                from_root, to_root) -> list:
    """``eqns`` (one site's equations, reading ``from_atoms``, ending in ``from_end``) renamed
    for another site: inputs mapped to ``to_atoms``, fresh variables inside, ``to_end`` out,
    and the source location and name scope of ``from_root`` replaced by ``to_root``'s."""
    ren: dict[Any, Any] = dict(zip(from_atoms, to_atoms))
    ren[from_end] = to_end
    out = []
    for e in eqns:
        ins = [ren.get(v, v) if isinstance(v, C.Var) else v for v in e.invars]
        outs = []
        for o in e.outvars:
            if o not in ren:
                ren[o] = C.new_var(o.aval)
            outs.append(ren[o])
        out.append(_rebased(e, from_root, to_root, invars=ins, outvars=outs))
    return out


def _rebased(e, old, new, **changes):
    """``e`` with ``old``'s source location and scopes replaced by ``new``'s, also inside the
    branches of a guard (a cloned ``cond`` would otherwise share the template's), and
    ``changes`` made (one ``replace``)."""
    if e.primitive.name == "cond":
        changes["params"] = C.with_cond_branches(e.params, tuple(
            C.closed_jaxpr(b.jaxpr.replace(eqns=[_rebased(x, old, new) for x in b.jaxpr.eqns]),
                          b.consts) for b in C.cond_branches(e)))
    return e.replace(source_info=C.rebase_source(e, old, new), **changes)
