"""``smooth=`` with calibration inputs of other shapes than the example (issue 68, item 4):
calibration sets vary in batch and length, and ``fold_params`` raised JAX's ``TypeError:
broadcast_in_dim operand dimension sizes…`` (its calibration ran the equations traced at the
example's shapes). Each input is now run at its own shapes: the program traced there, each
pair's end found at its place. The scales then depend on the calibration values alone —
whatever the example's shapes are."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from benchmarks.quantization import smooth_case
from tests.helpers.pair_programs import scanned_decoder_program
from tests.quant.jaxpr.test_equalize import rel


def _same_trees(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _tokens(rng, *shape):
    return jnp.asarray(rng.integers(0, 256, shape))


@pytest.mark.parametrize("alpha", [0.5, "search:w4a8"])
def test_calibration_of_other_batches_and_lengths(alpha):
    f, p, x, _ = smooth_case("decoder", 0)
    rng = np.random.default_rng(1)
    calib = [(_tokens(rng, 3, 11),), (_tokens(rng, 1, 23),)]
    out = hlofold.fold_params(f, p, *x, smooth=calib, alpha=alpha)     # (raised TypeError)
    assert out.smoothed and rel(f(p, *x), f(out.params, *x)) <= 1e-5, str(out)
    # the scales are the calibration's, whatever the example's shapes
    at = hlofold.fold_params(f, p, calib[0][0], smooth=calib, alpha=alpha)
    _same_trees(out.params, at.params)


@pytest.mark.slow
def test_a_scanned_stack_calibrated_at_other_lengths():
    g, sp, _, _, x, calib, per_layer = scanned_decoder_program(0, 3, False, 1)
    c = np.asarray(calib[0])
    longer = [jnp.asarray(np.concatenate([c, c[:, :3]], axis=1)), jnp.asarray(c[:1])]
    out = hlofold.fold_params(g, sp, x, smooth=longer)
    assert len(out.smoothed) == per_layer + 1, str(out)
    assert rel(g(sp, x), g(out.params, x)) <= 1e-5
    at = hlofold.fold_params(g, sp, longer[0], smooth=longer)
    _same_trees(out.params, at.params)


def test_a_program_that_is_another_at_the_calibration_shapes_says_so():
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    g = jnp.asarray(1 + rng.random(8), jnp.float32)

    def f(p, x):
        h = x * p["g"]
        if x.shape[0] > 4:                       # another program for longer inputs
            h = jnp.tanh(h)
        return (h @ p["w1"]) @ p["w2"]
    p = {"g": g, "w1": w1, "w2": w2}
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    with pytest.raises(ValueError, match="unlike the example's, and the program traced at "
                                         "them is another one"):
        hlofold.fold_params(f, p, x, smooth=[jnp.ones((6, 8), jnp.float32)])


def test_a_module_says_its_shapes_are_fixed():
    """A StableHLO module's shapes are fixed: fold_stablehlo names the input and the shapes
    (before: JAX's TypeError from inside the calibration run)."""
    f, p, x, calib = smooth_case("decoder", 0)
    leaves, tree = jax.tree.flatten(p)
    g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    text = g.lower(*leaves, *x).as_text()
    bound = {f"arg{i}": np.asarray(a) for i, a in enumerate(leaves)}
    rng = np.random.default_rng(2)
    with pytest.raises(hlofold.StableHLOError, match=r"smooth= input 1 has shapes \[\(3, 11\)\]"
                                                     r".*a module's shapes are fixed"):
        hlofold.fold_stablehlo(text, params=bound,
                               smooth=[calib[0], _tokens(rng, 3, 11)])
