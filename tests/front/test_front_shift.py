"""``fold_params`` where no bias of the layer can carry the shift in front of it — a norm's
β before a bias-free projection, a BatchNorm before a padded convolution (pre-activation
ResNets), whose border would need a bias per position: the front's scales become
identities, ``s`` goes into the kernel and the shift stays in front as ``t/s``
(``ParamChange.front``). Exact in float: the unchanged model computes
``root(x + t/s, K ⊙ s) = root(x·s + t, K)``, borders too."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from tests.front.test_writeback import leaf
from tests.helpers import assert_close
from tests.helpers.blocks import X, flax_linen_block
from tests.helpers.front_programs import program


@pytest.mark.parametrize("seed", range(40))
def test_generated_fronts_are_written_back_exactly(seed):
    fn, p, x, want = program(seed)
    out = hlofold.fold_params(fn, p, x)
    assert_close(fn(p, x), fn(out.params, x), jax.make_jaxpr(fn)(p, x))
    assert len(out.changes) == want["sites"], (want, str(out))
    fronts = {c.front for c in out.changes}
    if want["front"]:
        assert len(fronts) == 1 and None not in fronts, (want, str(out))
        slot = fronts.pop()
        # the front's scales are identities now: only its shift leaf differs from them
        assert slot in ("['b']", "['mu']"), slot
        if want["kind"] in ("bn", "norm", "add_then_mul"):
            np.testing.assert_array_equal(np.asarray(out.params["g"]), 1.0)
    else:
        assert fronts == {None}, (want, str(out))


def test_a_norm_before_a_bias_free_projection_keeps_beta_over_gamma():
    """The Flax block's K projection has no bias: LayerNorm's β·W_k has no slot. All five
    projections fold; the first norm's β becomes β/γ, its γ ones."""
    import flax.linen as nn
    f, v = flax_linen_block(nn.LayerNorm)
    out = hlofold.fold_params(f, v, X)
    assert_close(f(v, X), f(out.params, X))
    assert len(out.changes) == 5
    ln0 = "['params']['LayerNorm_0']"
    assert {c.front for c in out.changes} == {f"{ln0}['bias']", None}
    g, b = (np.asarray(leaf(v, f"{ln0}['{k}']"), np.float64) for k in ("scale", "bias"))
    np.testing.assert_allclose(np.asarray(leaf(out.params, f"{ln0}['bias']")), b / g,
                               rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(leaf(out.params, f"{ln0}['scale']")), 1.0)
    assert "kept in front as t/s" in str(out)
    assert all(c.front is None for c in out.changes if "Dense_4" in c.kernel)  # biases there


def test_preactivation_bn_before_a_same_conv():
    """Flax ``BatchNorm → Conv(SAME, no bias)``: was left (the border needs a bias per
    position); now written back, the border exact."""
    import flax.linen as nn

    class Pre(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=True)(x)
            return nn.Conv(8, (3, 3), padding="SAME", use_bias=False)(x)
    m, rng = Pre(), np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, 8, 4)), jnp.float32)
    v = m.init(jax.random.key(0), x)
    v = {"params": {"BatchNorm_0": {"scale": jnp.asarray(rng.uniform(0.5, 2, 4), jnp.float32),
                                    "bias": jnp.asarray(3 + rng.standard_normal(4), jnp.float32)},
                    "Conv_0": v["params"]["Conv_0"]},
         "batch_stats": {"BatchNorm_0": {"mean": jnp.asarray(rng.standard_normal(4), jnp.float32),
                                         "var": jnp.asarray(rng.uniform(0.5, 2, 4), jnp.float32)}}}
    out = hlofold.fold_params(m.apply, v, x)
    assert len(out.changes) == 1 and out.changes[0].front == "['params']['BatchNorm_0']['bias']"
    ref, got = np.asarray(m.apply(v, x)), np.asarray(m.apply(out.params, x))
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))   # borders included


def test_a_zero_scale_under_a_shift_is_refused():
    """γ_i = 0 with β_i ≠ 0: row i of the folded kernel is 0 and β_i·K_i has nowhere to go."""
    rng = np.random.default_rng(1)
    p = {"g": jnp.asarray([1.0, 0.0, 2.0, 0.5], jnp.float32),
         "b": jnp.asarray(rng.standard_normal(4), jnp.float32),
         "k": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)

    def f(p, x):
        return (x * p["g"] + p["b"]) @ p["k"]
    out = hlofold.fold_params(f, p, x)
    assert out.changes == [] and "no bias parameter to carry the folded shift" in str(out)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out.params),
                                                     jax.tree.leaves(p)))
