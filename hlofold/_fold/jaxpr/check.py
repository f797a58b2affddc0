"""On a JAX newer than the tested window, every jaxpr fold is checked before it is used.

hlofold has not seen that JAX: an internal whose meaning changed without its name could make
a fold wrong without any error. So :func:`checked` runs the folded jaxpr against the one
given on random inputs (floats in [0.5, 1.5], integers 0/1), on the CPU, under the tolerance
model of :mod:`hlofold._base.tolerance` (per output); where they differ the jaxpr given is
returned, its report saying why (``running``). Every entry point of the jaxpr path goes
through ``fold_jaxpr`` — ``fold`` (its planning and each prepare), ``lower``, ``export``,
``fold_params`` — so each is checked. On a tested JAX nothing runs here.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np

from hlofold import _compat as C
from hlofold._base.report import FoldReport
from hlofold._base.tolerance import mismatch, random_inputs
from .accumulation import output_profiles


def checked(closed, folded, report: FoldReport) -> tuple:
    """``(folded, report)``, or ``(closed, report saying why)`` where on this untested JAX
    the fold computes other outputs than ``closed`` on random inputs."""
    if not C.untested() or folded is closed:
        return folded, report
    avals = [v.aval for v in closed.jaxpr.invars]
    if closed.effects or any(not isinstance(d, int) for a in avals for d in a.shape) or (
            any(np.dtype(a.dtype).itemsize == 8 for a in avals)
            and not jax.config.jax_enable_x64):
        report.compat.append(f"not checked on this untested JAX {C.JAX_VERSION} (effects, "
                             f"symbolic shapes or 64-bit inputs)")
        return folded, report
    try:
        args = random_inputs([C.shape_struct(a) for a in avals])
        with jax.ensure_compile_time_eval():      # values, also while the caller traces
            ref = jax.jit(C.jaxpr_as_fun(closed))(*args)
    except Exception as e:      # noqa: BLE001 — the program does not run so here: no check
        report.compat.append(f"not checked on this untested JAX {C.JAX_VERSION}: the program "
                             f"does not run on random inputs here ({type(e).__name__})")
        return folded, report
    with jax.ensure_compile_time_eval():
        out = jax.jit(C.jaxpr_as_fun(folded))(*args)
    bad = [why for p, r, o in zip(output_profiles(closed.jaxpr), ref, out)
           if (why := mismatch(np.asarray(r), np.asarray(o), *p)) is not None]
    if not bad and len(ref) == len(out):
        return folded, report
    why = bad[0] if bad else "a different number of outputs"
    warnings.warn(f"hlofold: on this untested JAX {C.JAX_VERSION} a fold differs from the "
                  f"program on random inputs ({why}); the program runs as given",
                  RuntimeWarning, stacklevel=4)
    return closed, dataclasses.replace(
        report, running=f"the original program (on this untested JAX {C.JAX_VERSION} the "
                        f"fold differed from it on random inputs: {why})")
