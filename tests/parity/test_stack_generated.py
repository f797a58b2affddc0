"""Differential test of every entry point over generated layer stacks (issue 50 item 1).

Each stack (``tests/helpers/stack_programs.py``: scans forward and reversed, unrolled, the
``xs``, counter and ``fori_loop`` forms, counters from any start by any step, ``cond`` and
summed branches in the body) is folded by every entry point of both paths, and each folded
program's outputs are compared with ``jax.jit`` of the original, tightly (float32, a few
layers: a wrong layer's kernel is an error of the output's own scale):

* jaxpr path: ``fold(f)`` (parameters as inputs, prepared), ``freeze=0``, ``fold_jaxpr``,
  ``split()``, ``hlofold.lower(freeze=0)``, ``fold_params`` (the unchanged model on the
  written parameters);
* StableHLO path: ``fold_stablehlo`` of the module with the weights as constants, with
  ``params=`` on an export, with ``split=``, and the CLI (``--params``/``--prepared-out``).

Both paths fold the same sites: the jaxpr path's counts are the StableHLO path's.
"""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

import hlofold  # noqa: E402
import hlofold._compat as C  # noqa: E402
from hlofold._ir.stablehlo.artifacts import module_callable  # noqa: E402
from tests.helpers.stack_programs import FIXED, StackSpec, build, stack_specs  # noqa: E402
from tests.helpers import lower_with_constants  # noqa: E402

RTOL = 2e-5            # of the output's largest magnitude


def _first(out):
    return out[0] if isinstance(out, (list, tuple)) else out


def check(name: str, ref, got) -> None:
    ref, got = np.asarray(ref, np.float64), np.asarray(_first(got), np.float64)
    assert ref.shape == got.shape, (name, ref.shape, got.shape)
    err = float(np.max(np.abs(ref - got)))
    scale = max(1.0, float(np.max(np.abs(ref))))
    assert err <= RTOL * scale, f"{name}: max|Δ| {err:.3g} > {RTOL * scale:.3g}"


def counts(rep) -> tuple[int, int]:
    """Sites folded and sums merged, each counted once per layer it runs in (an unrolled
    scan's StableHLO holds ``unroll`` layers per loop iteration, or none in a loop)."""
    return (sum(s.layers or 1 for s in rep.folded), sum(s.layers or 1 for s in rep.merged))


def check_every_entry_point(spec: StackSpec, tmp_path) -> None:
    if os.environ.get("HLOFOLD_SHOW_SPECS"):
        print("SPEC", spec, flush=True)
    f, p, x = build(spec)
    ref = jax.jit(f)(p, x)
    leaves = jax.tree.leaves(p)
    want = (spec.folds() * spec.layers, spec.merges() * spec.layers)
    # ---- the jaxpr path
    ff = hlofold.fold(f, fold_costly=True)
    check("fold", ref, ff(p, x))
    check("fold, steady", ref, ff(p, x))
    rep = ff.report(p, x)
    assert counts(rep) == want, f"{spec}\n{rep}"
    assert len(rep.folded) == spec.folds() and \
        all(s.layers == spec.layers for s in rep.folded + rep.merged), str(rep)
    fz = hlofold.fold(f, freeze=0, fold_costly=True)
    check("freeze", ref, fz(p, x))
    assert counts(fz.report(p, x)) == want, str(fz.report(p, x))
    closed = jax.make_jaxpr(lambda x: f(p, x))(x)
    new, jrep = hlofold.fold_jaxpr(closed)
    C.check_jaxpr(new.jaxpr)
    check("fold_jaxpr", ref, C.jaxpr_as_fun(new)(x))
    sp = ff.split(p, x)
    check("split", ref, sp.apply(sp.prepare(p, x), p, x))
    check("lower", ref, module_callable(hlofold.lower(f, p, x, freeze=0))(x))
    fp = hlofold.fold_params(f, p, x)
    check("fold_params", ref, f(fp.params, x))
    # ---- the StableHLO path: the same sites fold
    text = lower_with_constants(jax.jit(lambda x: f(p, x)), x).as_text()
    folded, srep = hlofold.fold_stablehlo(text)
    check("fold_stablehlo", ref, module_callable(folded)(x))
    assert counts(srep) == counts(jrep) == want, f"{spec}\n{jrep}\n{srep}"
    exp = jax.export.export(jax.jit(f))(p, x)
    bound = {i: np.asarray(a) for i, a in enumerate(leaves)}
    applied, prep, prepared = hlofold.fold_stablehlo(exp, params=bound)
    check("params=", ref, applied.call(x, *prepared))
    assert counts(prep) == want, str(prep)
    args_text = lower_with_constants(jax.jit(f), p, x).as_text()
    apply, srep2, prepare = hlofold.fold_stablehlo(args_text, split=[f"arg{len(leaves)}"])
    *made, ok = module_callable(prepare)(*leaves)
    assert bool(ok)
    check("split=", ref, module_callable(apply)(x, *made))
    assert counts(srep2) == want, str(srep2)
    # ---- the CLI, as a user runs it on the module with its weights in a file
    from hlofold._front.cli import main as cli
    src, out, pout = (os.path.join(tmp_path, n) for n in ("m.mlir", "o.mlir", "p.npz"))
    with open(src, "w") as fh:
        fh.write(args_text)
    np.savez(os.path.join(tmp_path, "w.npz"), **{f"arg{i}": a for i, a in bound.items()})
    assert cli(["fold", src, "-o", out, "--params", os.path.join(tmp_path, "w.npz"),
                "--prepared-out", pout]) == 0
    with np.load(pout) as z:
        given = [z[k] for k in sorted(z.files, key=lambda k: int(k[3:]))]
    check("CLI", ref, module_callable(open(out).read())(x, *given))


@pytest.mark.slow
@pytest.mark.parametrize("spec", FIXED, ids=lambda s: (
    f"{s.form}-L{s.layers}{'-rev' if s.reverse else ''}-s{s.start}by{s.step}-{s.body}"))
def test_fixed_stacks_fold_alike_on_every_entry_point(spec, tmp_path):
    check_every_entry_point(spec, tmp_path)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("HLOFOLD_STACK_EXAMPLES", 25)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=stack_specs())
def test_generated_stacks_fold_alike_on_every_entry_point(spec, tmp_path_factory):
    check_every_entry_point(spec, tmp_path_factory.mktemp("stack"))
