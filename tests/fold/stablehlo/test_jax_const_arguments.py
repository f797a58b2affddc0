"""Constants JAX passes as arguments: from 0.12.1 a jitted function's lowering takes the arrays
it closes over as ``@main`` arguments marked ``jax.const`` (``jax_use_simplified_jaxpr_constants``,
on by default there; switched on here on any JAX, off before 0.12.1). Their values are not in
the module's text: ``fold_stablehlo`` of such a text leaves the site saying so and how to fold
it; ``hlofold.lower(..., freeze=)`` still returns a module that holds its folded weights; a
``jax.export`` of the same function keeps them in the module and folds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from hlofold import examples
from hlofold._base.reasons import reason_kind
from hlofold._ir.stablehlo.artifacts import module_callable
from hlofold._ir.stablehlo.module import jax_const_arguments, main_function, parse_module
from tests.helpers import jax_consts_as_arguments

RNG = np.random.default_rng(7)
K = RNG.standard_normal((3, 3, 4, 8)).astype(np.float32)
S = RNG.uniform(0.5, 2, 8).astype(np.float32)
T = RNG.standard_normal(8).astype(np.float32)
X = jnp.asarray(RNG.standard_normal((2, 8, 8, 4)), jnp.float32)


def _net(x):
    y = lax.conv_general_dilated(x, K, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y * S + T


def _lifts() -> bool:
    """Whether this JAX, its option on, passes the arrays ``_net`` closes over as arguments
    (0.12.1 and later; 0.10.2 has the option but keeps constants in the module)."""
    with jax_consts_as_arguments(True):
        return "jax.const" in jax.jit(_net).lower(X).as_text()


LIFTS = _lifts()
needs_lifting = pytest.mark.skipif(not LIFTS, reason="this JAX keeps closed-over arrays in "
                                   "the module (jax.const arguments come with 0.12.1)")


@needs_lifting
def test_a_lowering_whose_constants_are_arguments_is_left_saying_so():
    with jax_consts_as_arguments(True):
        text = jax.jit(_net).lower(X).as_text()
    module = parse_module(text)
    with module.context:
        n = len(jax_const_arguments(main_function(module)))
    assert n >= 1 and "jax.const" in text
    out, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 0 and len(rep.refused) == 1, str(rep)
    why = rep.refused[0].reason
    assert reason_kind(why) == "weights-not-known"
    assert f"{n} of @main's arguments are marked jax.const" in why and "jax.export" in why
    assert out == text                              # nothing changed: the text as given
    # in the graph (guarded, per call) it folds, and computes what the module given does
    folded, grep = hlofold.fold_stablehlo(text, in_graph=True)
    assert grep.num_folded == 1, str(grep)
    consts = [K, S, T]
    by_shape = {a.shape: a for a in consts}
    module = parse_module(text)
    with module.context:
        block = main_function(module).regions[0].blocks[0]
        args = [by_shape[tuple(a.type.shape)] for a in list(block.arguments)[:n]]
    want = np.asarray(_net(X))
    for m in (text, folded):
        got = np.asarray(module_callable(m)(*args, X)[0])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_without_jax_const_arguments_the_reason_says_nothing_of_them():
    leaves = [K, S, T]
    text = jax.jit(lambda k, s, t, x: lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) * s + t).lower(
        *leaves, X).as_text()
    _, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 0 and "jax.const" not in rep.refused[0].reason, str(rep)


def test_the_export_of_the_same_function_keeps_its_constants_and_folds():
    with jax_consts_as_arguments(True):
        exp = jax.export.export(jax.jit(_net))(X)
    assert "jax.const" not in exp.mlir_module()
    new, rep = hlofold.fold_stablehlo(exp)
    assert rep.num_folded == 1, str(rep)
    np.testing.assert_allclose(np.asarray(new.call(X)), np.asarray(_net(X)), rtol=1e-5,
                               atol=1e-5)


def test_hlofold_lower_with_frozen_params_holds_its_weights_in_the_module():
    """The README's ``hlofold.lower(infer, params, x, freeze=0)``: "params baked in" — a
    module of the per-call input alone, its folded weights constants, with JAX's option on."""
    params = examples.init_resnet(10, width=8)
    x = jnp.asarray(RNG.standard_normal((2, 32, 32, 3)), jnp.float32)
    with jax_consts_as_arguments(True):
        text = hlofold.lower(examples.resnet_apply, params, x, freeze=0)
        assert ("jax.const" in jax.jit(lambda x: examples.resnet_apply(params, x)).lower(
            x).as_text()) == LIFTS                    # (what JAX itself gives there)
    assert "jax.const" not in text
    module = parse_module(text)
    with module.context:
        assert len(main_function(module).regions[0].blocks[0].arguments) == 1
    got = np.asarray(module_callable(text)(x)[0])
    want = np.asarray(examples.resnet_apply(params, x))
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))
