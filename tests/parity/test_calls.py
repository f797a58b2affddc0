"""Chains that continue into a call: a ``jax.jit``-ed helper holding the BatchNorm.

On a jaxpr the call is a ``jit`` equation; lowered, it is a private ``func.call``. Both paths
follow the chain into the body when the body takes the chain on (the call's argument has one
reader, a chain op), inline it, and leave the program as it was when nothing then folds.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import hlofold
import hlofold._compat as C
from hlofold._base.reasons import reason_kind
from tests.helpers import assert_close, assert_no_scaling_after_convs, fold_both

RNG = np.random.default_rng(11)
X = RNG.standard_normal((2, 6, 6, 3)).astype(np.float32)
K1 = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
K2 = RNG.standard_normal((3, 3, 4, 4)).astype(np.float32)
S = RNG.uniform(0.5, 2, 4).astype(np.float32)
T = RNG.standard_normal(4).astype(np.float32)


def conv(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


@jax.jit
def bn(y, scale, shift):
    return y * scale + shift


def test_a_chain_into_a_jitted_helper_folds_on_both_paths():
    f = lambda x: jax.nn.relu(bn(conv(x, K1), S, T))
    results, ref, _ = fold_both(f, X)
    for path, rep, out, new in results:
        assert rep.num_folded == 1, (path, str(rep))
        assert_close(ref, out)
    new = results[0][3]
    assert_no_scaling_after_convs(new)
    top = [e.primitive.name for e in new.jaxpr.eqns]
    assert not set(top) & C.JIT_NAMES and "mul" not in top, top     # inlined, K·s folded


def test_one_helper_called_twice_inlines_with_fresh_variables():
    """jax caches the helper's jaxpr: both calls hold the same body, inlined twice."""
    def f(x):
        y = jax.nn.relu(bn(conv(x, K1), S, T))
        return bn(conv(y, K2), S * 0.5, T + 1.0)
    closed = jax.make_jaxpr(f)(X)
    calls = [e for e in closed.jaxpr.eqns if e.primitive.name in C.JIT_NAMES]
    assert len(calls) == 2 and C.call_body(calls[0])[1] is C.call_body(calls[1])[1]
    results, ref, _ = fold_both(f, X)
    for path, rep, out, new in results:
        assert rep.num_folded == 2, (path, str(rep))
        assert_close(ref, out)


def test_a_helper_that_also_returns_its_input_is_not_entered():
    """The call's argument has two readers in the body (the mul and the output): folding
    would change the second. Both paths refuse to enter it and change nothing."""
    @jax.jit
    def bn_and_raw(y):
        return y * S + T, y

    def f(x):
        a, b = bn_and_raw(conv(x, K1))
        return a + jnp.sum(b)
    results, ref, same = fold_both(f, X)
    for path, rep, out, _ in results:
        assert rep.num_folded == 0, (path, str(rep))
        assert "chain ends at" in rep.sites[0].reason, (path, rep.sites[0].reason)
        assert "output" in rep.sites[0].reason or "return" in rep.sites[0].reason, \
            (path, rep.sites[0].reason)
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(out))
    assert same == {"jaxpr": True, "stablehlo": True}, same


def test_a_chain_refused_inside_the_helper_leaves_the_program_as_it_was():
    """Inlined on trial: the body adds an activation (a residual), nothing folds, and the
    program returned is the original, the call still there. Each chain ends where it meets
    the other activation: nothing to fold, not a refusal (issue 39 item 4)."""
    @jax.jit
    def add_residual(y, r):
        return y + r

    f = lambda x: add_residual(conv(x, K1), conv(x, K1 * 2))
    results, ref, same = fold_both(f, X)
    for path, rep, out, _ in results:
        assert rep.num_folded == 0, (path, str(rep))
        assert all(s.status != "folded" for s in rep.sites)
    assert same == {"jaxpr": True, "stablehlo": True}, same
    kinds = {path: sorted(reason_kind(s.reason) for s in rep.sites)
             for path, rep, _, _ in results}
    assert kinds["jaxpr"] == kinds["stablehlo"] == ["chain-end"] * 2, kinds
    assert all(rep.num_refused == 0 for _, rep, _, _ in results)


def test_a_call_with_shardings_is_not_inlined():
    """A jit with explicit shardings: inlining would drop them, so the jaxpr path stops."""
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pinned = jax.jit(lambda y, s, t: y * s + t, out_shardings=dev)
    closed = jax.make_jaxpr(lambda x: pinned(conv(x, K1), S, T))(X)
    new, rep = hlofold.fold_jaxpr(closed)
    assert rep.num_folded == 0 and new is closed, str(rep)
    assert rep.sites[0].reason == "chain ends at jit", rep.sites[0].reason


def test_the_decorator_folds_through_a_jitted_helper():
    """hlofold.fold with the parameters as inputs (prepared once, then cached)."""
    from tests.helpers import fold_checked

    def f(p, x):
        y = jax.nn.relu(bn(conv(x, p["k1"]), p["s"], p["t"]))
        return bn(conv(y, p["k2"]), p["s"], p["t"])
    params = {"k1": K1, "k2": K2, "s": S, "t": T}
    fold_checked(f, params, X, folds=2, root="conv_general_dilated")
