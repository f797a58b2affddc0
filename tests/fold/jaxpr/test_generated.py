"""Generated programs: hypothesis builds random conv networks and checks every fold.

Each example is a network of 1–6 conv layers of one rank, with random layouts, geometry,
dtypes, affine chains, extra consumers, nesting and parameter kinds: the list is in
``tests/helpers/programs.py``.

Properties, for every program:

1. ``fold_jaxpr`` does not raise;
2. ``check_jaxpr`` accepts the folded program;
3. the number of folded ``conv_affine`` sites equals the number of sites that are safe by
   construction (computed by the generator: the affine ops before the first value with a
   second reader, folded unless they are empty or a single add/sub, which is canonical);
4. the folded program computes the same outputs within the tolerance model of ``bound``
   (float32) and ``bf16_bound`` (bfloat16, against a float32 run of the same net);
5. folding the folded program again returns the same object and folds nothing.

The default hypothesis profile is "ci" (200 derandomized examples, see conftest.py). Locally,
``HYPOTHESIS_PROFILE=long python -m pytest tests/fold/jaxpr/test_generated.py`` runs 2000 random ones.
"""
from __future__ import annotations

import jax
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

import hlofold  # noqa: E402
import hlofold._compat as C  # noqa: E402
from tests.helpers.programs import Spec, bf16_bound, bound, build, err, specs  # noqa: E402


def check_program(spec: Spec):
    """All the properties for one generated program (raises AssertionError)."""
    f, args = build(spec)
    closed = jax.make_jaxpr(f)(*args)
    new, rep = hlofold.fold_jaxpr(closed)                     # 1. never raises
    C.check_jaxpr(new.jaxpr)                                  # 2. a valid program
    n = sum(s.pattern == "conv_affine" for s in rep.folded)
    assert n == spec.expected(), f"{n} conv_affine sites folded, {spec.expected()} safe\n{rep}"
    ref = jax.jit(C.jaxpr_as_fun(closed))(*args)              # 4. same numbers
    out = jax.jit(C.jaxpr_as_fun(new))(*args) if new is not closed else ref
    if spec.dtype == "float32":
        for k, (r, o) in enumerate(zip(ref, out)):
            e, b = err(r, o), bound(spec, r)
            assert e <= b, f"output {k}: max|Δ| = {e:.3g} > {b:.3g}\n{rep}"
    else:
        f32, args32 = build(spec, ref=True)
        ref32 = jax.jit(f32)(*args32)
        for k, (r32, r, o) in enumerate(zip(ref32, ref, out)):
            err_u, err_f = err(r32, r), err(r32, o)
            b = bf16_bound(err_u, r32)
            assert err_f <= b, (f"output {k}: folded max|Δ| = {err_f:.3g} > {b:.3g} "
                                    f"(unfolded {err_u:.3g})\n{rep}")
    again, rep2 = hlofold.fold_jaxpr(new)                     # 5. idempotent
    assert again is new and rep2.num_folded == 0, f"second fold:\n{rep2}"
    return rep


@pytest.mark.slow
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs())
def test_generated_programs(spec):
    check_program(spec)
