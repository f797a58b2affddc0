"""Regressions for the third round of adversarial testing (issue 31), the decorator's part:
threads, copies, what ``lower``/``jaxpr`` return, ``verify=True`` with side effects, and the
demo's numeric check. (``shard_map``: ``tests/front/_sharding_script.py``; subnormals and
narrowing casts: ``tests/parity/test_subnormals_and_casts.py``; StableHLO artifacts:
``tests/fold/stablehlo/test_scalar_weights_and_portable.py``.) Each failed before its fix."""
from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from hlofold import examples
from tests.helpers import ROOT, assert_close, in_threads, primitives

DN = ("NHWC", "HWIO", "NHWC")


def conv_bn(p, x):
    y = lax.conv_general_dilated(x, p["k"], (1, 1), "SAME", dimension_numbers=DN)
    return (y - p["m"]) * p["s"] + p["b"]


def conv_bn_params(seed, cin=3, cout=4):
    rng = np.random.default_rng(seed)
    return {"k": jnp.asarray(rng.standard_normal((3, 3, cin, cout)), jnp.float32),
            "m": jnp.asarray(rng.standard_normal(cout), jnp.float32),
            "s": jnp.asarray(1 + rng.random(cout), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(cout), jnp.float32)}


# ------------------------------------------------------------------------------ 1. threads


def test_many_threads_many_parameter_sets_and_shapes_get_their_own_answers():
    """Servers call one folded function from many threads. Before, a thread built the fast
    path from whatever another thread had just prepared: 2–13 of 1,600 calls returned the
    other parameter set's answer, and so did every later call."""
    sets = [conv_bn_params(k) for k in range(2)]
    xs = [jnp.asarray(np.random.default_rng(9).standard_normal((1, n, n, 3)), jnp.float32)
          for n in (6, 8)]
    jf = jax.jit(conv_bn)
    ref = {(i, j): np.asarray(jf(p, x)) for i, p in enumerate(sets) for j, x in enumerate(xs)}
    f = hlofold.fold(conv_bn)
    wrong, errors = [], []

    def work(k):
        try:
            for n in range(1000):
                i, j = k % len(sets), (n // 7 + k) % len(xs)
                out = np.asarray(f(sets[i], xs[j]))
                if not np.allclose(out, ref[i, j], rtol=1e-5, atol=1e-5):
                    wrong.append((k, n, i, j))
        except Exception as e:      # noqa: BLE001 -- reported below
            errors.append(e)

    in_threads(work)                    # switch threads often: interleave the slow path
    assert not errors, errors[0]
    assert not wrong, f"{len(wrong)} calls returned another parameter set's answer"
    for (i, j), r in ref.items():                      # and nothing stuck afterwards
        np.testing.assert_allclose(np.asarray(f(sets[i], xs[j])), r, rtol=1e-5, atol=1e-5)
    assert f.report(sets[0], xs[0]).num_folded == 1


def test_the_fast_path_serves_the_values_its_call_was_prepared_with():
    """The same race, made deterministic: while one call runs on parameters ``p1``, another
    prepares ``p2``. The first call's fast path must still map ``p1`` to ``p1``'s folded
    values (before, it took ``p2``'s: every later call with ``p1`` got ``p2``'s answer)."""
    f = hlofold.fold(conv_bn)
    p1, p2 = conv_bn_params(1), conv_bn_params(2)
    x = jnp.ones((1, 6, 6, 3))
    prepare, meanwhile = f._folding_for, []

    def interleaved(prog, known, count=True):
        entry = prepare(prog, known, count)
        if not meanwhile:
            meanwhile.append(None)
            meanwhile[0] = f(p2, x)          # another thread's call, between the two steps
        return entry

    f._folding_for = interleaved
    assert_close(conv_bn(p1, x), f(p1, x))
    del f._folding_for
    assert_close(conv_bn(p2, x), meanwhile[0])
    for _ in range(3):
        assert_close(conv_bn(p1, x), f(p1, x))
        assert_close(conv_bn(p2, x), f(p2, x))


# ------------------------------------------------------------------------------ 7. copies


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_folded_function_copies_after_its_first_call(how):
    """``copy.deepcopy`` and pickling failed after the first call (the cached programs hold
    tracebacks); a copy is a fresh folded function that folds again on its first call."""
    f = hlofold.fold(examples.resnet_apply)
    p = examples.init_resnet(10, width=4)
    x = jnp.ones((1, 8, 8, 3))
    y = f(p, x)
    g = copy.deepcopy(f) if how == "deepcopy" else pickle.loads(pickle.dumps(f))
    assert g is not f and not g._programs
    np.testing.assert_allclose(g(p, x), y, rtol=1e-6, atol=1e-6)
    assert g.report(p, x).num_folded == f.report(p, x).num_folded > 0
    np.testing.assert_allclose(f(p, x), y)                    # the original still works


# ------------------------------------------------------------------- 8. lower and jaxpr


def test_jaxpr_and_lower_are_what_calls_run_and_take_no_parameters_they_ignore():
    """``infer.lower(params, x)`` was the unfolded program while the report said "folded
    (prepared)", and ``infer.jaxpr(params, x)`` took the parameters as inputs and ignored
    them (run with other parameters: the first ones' answer). Both are now the program
    calls run: the prepared kernels and biases are its constants, its inputs the per-call
    ones, so no other parameter values can be passed to it."""
    f = hlofold.fold(conv_bn)
    p1, p2 = conv_bn_params(1), conv_bn_params(2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, 6, 3)), jnp.float32)
    for p in (p1, p2):
        closed = f.jaxpr(p, x)
        assert len(closed.jaxpr.invars) == 1                   # x only
        assert not {"sub", "mul"} & set(primitives(closed))    # folded, as calls run it
        out = hlofold._compat.jaxpr_as_fun(closed)(x)[0]
        assert_close(conv_bn(p, x), out)
        lowered = f.lower(p, x)
        text = lowered.as_text()
        assert "stablehlo.multiply" not in text and "stablehlo.subtract" not in text
        assert_close(conv_bn(p, x), lowered.compile()(x))
    assert "folded" in str(f.report(p1, x)) and f.report(p1, x).num_folded == 1
    # the artifact form keeps every leaf an argument (guarded in the graph on request)
    art = hlofold.fold(conv_bn, in_graph=True).lower_with_arguments(p2, x)
    assert_close(conv_bn(p2, x), art.compile()(*jax.tree.leaves((p2, x))))


# ------------------------------------------------------------------ 9. verify and effects


def test_verify_does_not_run_side_effects_twice():
    """``verify=True`` ran the original and the folded program on the first call, so an
    ordered ``io_callback`` fired twice. Such a program is not verified (a warning says
    why), and its effects run once per call."""
    seen = []

    def f(p, x):
        jax.experimental.io_callback(lambda v: seen.append(float(v)), None, x.sum(),
                                     ordered=True)
        return conv_bn(p, x)

    p = conv_bn_params(4)
    x = jnp.ones((1, 5, 5, 3))
    g = hlofold.fold(f, verify=True)
    with pytest.warns(RuntimeWarning, match="side effects"):
        out = g(p, x)
    assert_close(conv_bn(p, x), out)
    assert len(seen) == 1, seen
    g(p, x)
    assert len(seen) == 2
    assert g.report(p, x).num_folded == 1


def test_verify_still_compares_programs_without_effects():
    g = hlofold.fold(conv_bn, verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(conv_bn_params(5), jnp.ones((1, 5, 5, 3)))
    assert next(iter(g._programs.values())).verified is True


# ------------------------------------------------------------------------- 10. the demo


def test_demo_checks_numerics_with_the_tolerance_model():
    """The demo used its own bound (1e-5·max|ref| + 1e-6), not hlofold's tolerance model."""
    out = subprocess.run([sys.executable, "-m", "hlofold", "demo", "--depth", "10",
                          "--width", "4", "--size", "16", "--rounds", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tolerance model, L = " in out.stdout and "1e-5·max|ref|" not in out.stdout
    assert out.stdout.count("PASS") == 2
