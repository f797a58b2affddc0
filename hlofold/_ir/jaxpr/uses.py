"""Who reads each value of a jaxpr, and which equation made it: the index every walk over
a jaxpr's equations starts from."""
from __future__ import annotations

from hlofold import _compat as C


def index_uses(jaxpr):
    """``(uses, producer)``: each var's readers ``(eqn, operand index)`` (``(None, -1)`` for
    an output of the jaxpr), and the equation that made it."""
    uses, producer = {}, {}
    for i, e in enumerate(jaxpr.eqns):
        for k, v in enumerate(e.invars):
            if isinstance(v, C.Var):
                uses.setdefault(v, []).append((e, k))
        for v in e.outvars:
            producer[v] = e
    for v in jaxpr.outvars:
        if isinstance(v, C.Var):
            uses.setdefault(v, []).append((None, -1))
    return uses, producer
