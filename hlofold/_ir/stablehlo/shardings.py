"""Shardings of the arguments a fold creates: prepared weights keep their origin's sharding.

A sharded module (``jax.jit(f, in_shardings=...)`` lowers with Shardy's ``sdy.sharding``; GSPMD
modules carry ``mhlo.sharding``) says on each ``@main`` argument how it is laid out over the
mesh. A folded kernel ``K ⊙ s`` or a prepared bias is a new argument of the apply module (and
a result of the prepare module): it takes the sharding of the weight argument it was computed
from that has its type — the kernel's for ``K ⊙ s``, the BatchNorm vectors' for the bias —
where every such argument agrees; otherwise none (the compiler propagates one). A sharding
annotation changes where values live, never what they are.
"""
from __future__ import annotations

from typing import Any

from hlofold import _compat as C
from .ir import owner_op

ir, stablehlo, _ = C.mlir()

KEYS = ("sdy.sharding", "mhlo.sharding")


def _dicts(main, name: str, n: int) -> list[dict]:
    if name not in main.attributes:
        return [{} for _ in range(n)]
    return [{k: ir.DictAttr(d)[k] for k in KEYS if k in ir.DictAttr(d)}
            for d in ir.ArrayAttr(main.attributes[name])]


def argument_shardings(main) -> list[dict]:
    """Per ``@main`` argument, its sharding attributes by key (empty when it has none)."""
    return _dicts(main, "arg_attrs", len(main.regions[0].blocks[0].arguments))


def agreed(candidates: list[dict]) -> dict:
    """The sharding all ``candidates`` that split over some mesh axis have (compared as
    printed: a replicated one yields to them, as the compiler's propagation does — β
    replicated beside γ on "model" gives "model"); all of them where none splits; else {}."""
    split = [c for c in candidates if c and not _replicated(c)]
    pool = split or candidates
    if not pool or not pool[0]:
        return {}
    first = {k: str(v) for k, v in pool[0].items()}
    if all({k: str(v) for k, v in c.items()} == first for c in pool[1:]):
        return dict(pool[0])
    return {}


def _replicated(sharding: dict) -> bool:
    """Whether a sharding attribute (Shardy's or GSPMD's) splits over no mesh axis."""
    text = " ".join(str(v) for v in sharding.values())
    return "replicated" in text or ('"' not in text.split("[", 1)[-1] and "sdy" in text)


def from_arguments(value, block, shardings: list[dict]) -> dict:
    """The sharding of the arguments of ``block`` that ``value`` is computed from and that
    have its type (see the module docstring)."""
    if not any(shardings):       # an unsharded module (the common case): nothing to walk
        return {}
    args = {a: i for i, a in enumerate(block.arguments)}
    seen, todo, found = set(), [value], []
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in args:
            if v.type == value.type:
                found.append(shardings[args[v]])
            continue
        op = owner_op(v)
        if op is not None:
            todo.extend(op.operands)
    return agreed(found)


def _merged(old, shard: dict):
    """``old`` (a DictAttr or None) with the sharding keys of ``shard`` set."""
    items = {} if old is None else {a.name: a.attr for a in ir.DictAttr(old)}
    items.update(shard)
    return ir.DictAttr.get(items)


def set_argument_shardings(main, shards: dict[int, dict]) -> None:
    """Set the sharding of ``@main`` arguments (argument number → sharding)."""
    shards = {i: s for i, s in shards.items() if s}
    if not shards:
        return
    n = len(main.regions[0].blocks[0].arguments)
    old = list(ir.ArrayAttr(main.attributes["arg_attrs"])) if "arg_attrs" in main.attributes \
        else [None] * n
    main.attributes["arg_attrs"] = ir.ArrayAttr.get(
        [_merged(old[i], shards[i]) if i in shards else (old[i] or ir.DictAttr.get({}))
         for i in range(n)])


def set_result_shardings(main, shards: list[dict]) -> None:
    """Give ``@main``'s results these shardings (and no other result attributes)."""
    if any(shards):
        main.attributes["res_attrs"] = ir.ArrayAttr.get([_merged(None, s) for s in shards])
    elif "res_attrs" in main.attributes:
        del main.attributes["res_attrs"]


def by_type(values: list[Any], removed: list[tuple[Any, dict]]) -> dict[int, dict]:
    """For values that replace weight arguments bound to constants (``removed``: their
    types and shardings): the sharding all removed arguments of a value's type agree on."""
    by: dict = {}
    for t, sh in removed:
        if sh:
            by.setdefault(str(t), []).append(sh)
    if not by:                   # an unsharded module (the common case): nothing to do
        return {}
    out = {}
    for k, v in enumerate(values):
        s = agreed(by.get(str(v.type), []))
        if s:
            out[k] = s
    return out
