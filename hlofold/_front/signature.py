"""How the decorator reads a call's arguments: names, static and frozen ones, pytree paths.

A :class:`Signature` binds positional and keyword arguments to parameter names (``#i`` for a
function whose signature cannot be read), turns ``static_argnums``/``freeze`` given as
numbers or names into names, calls the function back with bound arguments, and names each
flattened leaf by its pytree path (the names the fold report uses for parameters).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import numpy as np


class Signature:
    """The argument handling of one folded function ``py`` (called as ``fun``)."""

    def __init__(self, fun: Callable, py: Callable):
        self.fun, self.py = fun, py
        try:
            self.sig = inspect.signature(py)
        except (TypeError, ValueError):
            self.sig = None

    def positional(self) -> list[str]:
        """Names of the positional parameters, in order."""
        if self.sig is None:
            return []
        return [p.name for p in self.sig.parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def names(self, items, what: str) -> frozenset:
        """Argument numbers or names (``static_argnums``, ``freeze=``, …) as names; a number
        out of range or an unknown name raises ``ValueError`` naming ``what``."""
        pos = self.positional()
        out = set()
        where = f"{getattr(self.py, '__name__', self.py)}{self.sig}"
        for it in items:
            if isinstance(it, int):
                if self.sig is None:
                    out.add(f"#{it}")
                elif it < len(pos):
                    out.add(pos[it])
                else:
                    raise ValueError(f"hlofold.fold: {what} argnum {it} is out of range for "
                                     f"{where}")
            else:
                if self.sig is not None and it not in self.sig.parameters:
                    raise ValueError(f"hlofold.fold: {what} argname {it!r} is not a parameter "
                                     f"of {where}")
                out.add(it)
        return frozenset(out)

    def bind(self, args, kwargs) -> dict[str, Any]:
        """The call's arguments by parameter name."""
        if self.sig is None:
            out = {f"#{i}": a for i, a in enumerate(args)}
            out.update(kwargs)
            return out
        return dict(self.sig.bind(*args, **kwargs).arguments)

    def call(self, arguments: dict[str, Any]):
        """``fun`` called with arguments bound by :meth:`bind`."""
        if self.sig is None:
            pos = [v for k, v in arguments.items() if k.startswith("#")]
            kw = {k: v for k, v in arguments.items() if not k.startswith("#")}
            return self.fun(*pos, **kw)
        ba = inspect.BoundArguments(self.sig, arguments)
        return self.fun(*ba.args, **ba.kwargs)

    @staticmethod
    def leaf_name(path) -> str:
        """A leaf's name from its pytree path (``params['conv1']['kernel']``)."""
        if not path:
            return "<arg>"
        head, rest = path[0], path[1:]
        name = getattr(head, "key", None)
        if name is None:
            return jax.tree_util.keystr(path)
        if isinstance(name, str) and name.startswith("#"):
            name = f"args[{name[1:]}]"
        return f"{name}{jax.tree_util.keystr(tuple(rest))}"

    @staticmethod
    def shape_key(arguments: dict, static: frozenset, static_key: Callable):
        """Structure, shapes and dtypes of every non-static argument (frozen ones included)
        and the static values: the signature a verify failure applies to, concrete or
        traced."""
        leaves, tree = jax.tree_util.tree_flatten(
            {k: v for k, v in arguments.items() if k not in static})
        return (tree, tuple((tuple(np.shape(l)), str(getattr(l, "dtype", type(l))))
                            for l in leaves),
                static_key({k: v for k, v in arguments.items() if k in static}))
