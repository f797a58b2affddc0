"""Folds and rewrites of ``fold_stablehlo`` checked before they are returned. On a JAX newer
than the tested window every fold (:func:`checked`); on every JAX a rewrite for quantization
(:func:`check_rewrite`, as ``fold_params`` checks one). The check: the folded artifact
against the one given on random inputs (the weights bound by ``params=`` as given; ``split=``: prepare, then apply), on the CPU, under hlofold's tolerance
model per result (:func:`artifact_profiles`). Where they differ the artifact comes back as
given (with ``params=``/``split=``, whose results take other arguments, a ``CompatError``);
where the check cannot run here (another platform, key or 64-bit inputs, symbolic shapes) the
report says it was not checked. On a tested JAX a fold without a rewrite is not run here.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np

from hlofold import _compat as C
from hlofold._ir.stablehlo.artifacts import as_given, input_specs, module_callable, read_artifact
from hlofold._ir.stablehlo.module import parse_module
from .accumulation import module_output_profiles
from hlofold._base import tolerance
from hlofold._ir.stablehlo.weights import argument_index


def checked(data, result: tuple, params, split):
    """On a JAX newer than the tested window: the fold run against the artifact given, on
    random inputs (the weights bound by ``params=`` as given), on the CPU — as
    ``hlofold.fold`` verifies its first call there. Where they differ beyond hlofold's
    tolerance: without ``params``/``split`` the artifact as given, with the reason; with
    them (whose results take other arguments) a ``CompatError`` saying so."""
    report = result[1]
    if not report.num_folded and not report.merged:
        return result
    state, why = on_random_inputs(data, result, params, split)
    if state == "unchecked":
        report.compat.append(f"not checked on this untested JAX {C.JAX_VERSION}: {why}")
        return result
    if state == "same":
        return result
    if params is not None or split is not None:
        raise C.CompatError(f"what hlofold reads (on random inputs the fold differs from "
                            f"the module given: {why})", "stablehlo")
    warnings.warn(f"hlofold.fold_stablehlo: on this untested JAX {C.JAX_VERSION} the folded "
                  f"module differs from the one given ({why}); returning the one given",
                  RuntimeWarning, stacklevel=3)
    return as_given(data), dataclasses.replace(
        report, running=f"the module as given (the fold differed from it on this untested "
                        f"JAX {C.JAX_VERSION}: {why})")


def check_rewrite(data, result: tuple, params) -> None:
    """On every JAX: a module rewritten for quantization (``equalize=``, ``smooth=``) run
    against the artifact given on random inputs of its shapes (the weights bound by
    ``params=`` as given), as ``fold_params`` checks a rewritten tree — the calibration or
    example inputs may be degenerate and hide a wrong rewrite. Raises where they differ;
    where the check cannot run here (symbolic shapes, 64-bit or key inputs) the report
    says the rewrite was not checked."""
    state, why = on_random_inputs(data, result, params, None)
    if state == "differs":
        raise RuntimeError(f"hlofold.fold_stablehlo: the rewritten module changes the "
                           f"outputs on random inputs ({why}); please report this")
    if state == "unchecked":
        result[1].compat.append(f"the rewrite was not checked on random inputs: {why}")


def on_random_inputs(data, result: tuple, params, split) -> tuple[str, str | None]:
    """``("same", None)``, ``("differs", why)`` or ``("unchecked", why)``: ``result`` (of
    ``fold_stablehlo``) against the artifact given, on random inputs, on the CPU, under the
    tolerance model per result."""
    mismatch, random_inputs = tolerance.mismatch, tolerance.random_inputs   # (read now)
    folded = result[0]
    specs = input_specs(data)
    try:
        plain = all(isinstance(d, int) for sp in specs for d in sp.shape) and (
            jax.config.jax_enable_x64 or all(np.dtype(sp.dtype).itemsize < 8 for sp in specs))
    except TypeError:           # an input of an extended type (a PRNG key)
        plain = False
    if not plain:
        return "unchecked", "symbolic shapes, 64-bit or key inputs: check it with hlofold.verify"
    args = random_inputs(specs)
    if params is not None:
        # (arrays as given: a jax.Array is not copied to the host and back, a PRNG key
        # stays a key, as the module given takes it)
        bound = {argument_index(k): v if isinstance(v, jax.Array) else np.asarray(v)
                 for k, v in params.items()}
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
        return "unchecked", (f"the module given does not run on this machine's CPU on random "
                             f"inputs ({type(e).__name__}: {str(e).strip()[:120]})")
    got = run()
    out = [] if got is None else jax.tree.leaves(got)
    bad = [why for p, r, o in zip(artifact_profiles(data), ref, out)
           if (why := mismatch(np.asarray(r), np.asarray(o), *p)) is not None]
    if len(ref) == len(out) and not bad:
        return "same", None
    return "differs", bad[0] if bad else ("prepare's ok is false" if got is None else
                                          "a different number of outputs")


def artifact_profiles(data) -> list[tuple]:
    """``(L, D, compute)`` of each result of an artifact, for the tolerance model."""
    with C.mlir_context():
        return module_output_profiles(parse_module(read_artifact(data).module))
