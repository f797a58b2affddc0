"""On a JAX newer than the tested window, ``fold_stablehlo`` checks its fold before it is
returned: the folded artifact against the one given on random inputs (the weights bound by
``params=`` as given; ``split=``: prepare, then apply), on the CPU, under hlofold's tolerance
model per result (:func:`artifact_profiles`). Where they differ the artifact comes back as
given (with ``params=``/``split=``, whose results take other arguments, a ``CompatError``);
where the check cannot run here (another platform, key or 64-bit inputs, symbolic shapes) the
report says it was not checked. On a tested JAX nothing runs here.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np

from hlofold import _compat as C
from hlofold._base import tolerance
from hlofold._ir.stablehlo.weights import argument_index


def checked(data, result: tuple, params, split):
    """On a JAX newer than the tested window: the fold run against the artifact given, on
    random inputs (the weights bound by ``params=`` as given), on the CPU — as
    ``hlofold.fold`` verifies its first call there. Where they differ beyond hlofold's
    tolerance: without ``params``/``split`` the artifact as given, with the reason; with
    them (whose results take other arguments) a ``CompatError`` saying so."""
    from hlofold._ir.stablehlo.artifacts import as_given, input_specs, module_callable
    mismatch, random_inputs = tolerance.mismatch, tolerance.random_inputs   # (read now)
    folded, report = result[0], result[1]
    if not report.num_folded and not report.merged:
        return result
    specs = input_specs(data)
    try:
        plain = all(isinstance(d, int) for sp in specs for d in sp.shape) and (
            jax.config.jax_enable_x64 or all(np.dtype(sp.dtype).itemsize < 8 for sp in specs))
    except TypeError:           # an input of an extended type (a PRNG key)
        plain = False
    if not plain:
        report.compat.append(f"not verified on this untested JAX {C.JAX_VERSION} (symbolic "
                             f"shapes, 64-bit or key inputs): check it with hlofold.verify")
        return result
    args = random_inputs(specs)
    if params is not None:
        bound = {argument_index(k): np.asarray(v) for k, v in params.items()}
        args = [bound.get(i, a) for i, a in enumerate(args)]
        rest = [a for i, a in enumerate(args) if i not in bound]
        run = lambda: module_callable(folded, "cpu")(*rest, *result[2])   # noqa: E731
    elif split is not None:
        calls = sorted({argument_index(k) for k in split})

        def run():
            *made, ok = jax.tree.leaves(module_callable(result[2], "cpu")(
                *[a for i, a in enumerate(args) if i not in calls]))
            if not bool(np.asarray(ok)):
                return None
            return module_callable(folded, "cpu")(*[args[i] for i in calls], *made)
    else:
        run = lambda: module_callable(folded, "cpu")(*args)               # noqa: E731
    try:
        ref = jax.tree.leaves(module_callable(data, "cpu")(*args))
    except Exception as e:      # noqa: BLE001 — the module given does not run here: no check
        report.compat.append(f"not checked on this untested JAX {C.JAX_VERSION}: the module "
                             f"given does not run on this machine's CPU on random inputs "
                             f"({type(e).__name__}: {str(e).strip()[:120]})")
        return result
    got = run()
    out = [] if got is None else jax.tree.leaves(got)
    bad = [why for p, r, o in zip(artifact_profiles(data), ref, out)
           if (why := mismatch(np.asarray(r), np.asarray(o), *p)) is not None]
    if len(ref) == len(out) and not bad:
        return result
    why = bad[0] if bad else ("prepare's ok is false" if got is None else
                              "a different number of outputs")
    if params is not None or split is not None:
        raise C.CompatError(f"what hlofold reads (on random inputs the fold differs from "
                            f"the module given: {why})", "stablehlo")
    warnings.warn(f"hlofold.fold_stablehlo: on this untested JAX {C.JAX_VERSION} the folded "
                  f"module differs from the one given ({why}); returning the one given",
                  RuntimeWarning, stacklevel=3)
    return as_given(data), dataclasses.replace(
        report, running=f"the module as given (the fold differed from it on this untested "
                        f"JAX {C.JAX_VERSION}: {why})")


def artifact_profiles(data) -> list[tuple]:
    """``(L, D, compute)`` of each result of an artifact, for the tolerance model."""
    from .accumulation import module_output_profiles
    from hlofold._ir.stablehlo.artifacts import read_artifact
    from hlofold._ir.stablehlo.module import parse_module
    with C.mlir_context():
        return module_output_profiles(parse_module(read_artifact(data).module))
