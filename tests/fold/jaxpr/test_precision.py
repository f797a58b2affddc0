"""Mixed precision: a bf16 network, measured against its float32 reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from tests.helpers import walk_eqns

RNG = np.random.default_rng(11)


def bf16_net(depth=8, width=16):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(depth):
                x = nn.Conv(width, (3, 3), dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
                x = nn.BatchNorm(use_running_average=True, dtype=jnp.bfloat16,
                                 param_dtype=jnp.float32)(x)
                x = nn.relu(x)
            return x

    net = Net()
    x = jnp.asarray(RNG.standard_normal((2, 12, 12, 3)), jnp.float32)
    v = net.init(jax.random.key(0), x)

    def stats(path, a):
        name = jax.tree_util.keystr(path)
        if "var" in name:
            return jnp.asarray(np.exp(0.5 * RNG.standard_normal(a.shape)), a.dtype)
        if "mean" in name or "bias" in name:
            return jnp.asarray(0.3 * RNG.standard_normal(a.shape), a.dtype)
        if "scale" in name:
            return jnp.asarray(1 + 0.3 * RNG.standard_normal(a.shape), a.dtype)
        return a
    return net, jax.tree_util.tree_map_with_path(stats, v), x


@pytest.mark.parametrize("freeze", [(), 0])
def test_bf16_kernel_feeding_float32_batchnorm_is_refused(freeze):
    """Flax computes BatchNorm in float32 even with ``dtype=bfloat16`` (the float32
    statistics promote it): rounding K·s to bf16 would lose accuracy the unfolded program
    keeps, so by default the fold is refused and the reason names the way out."""
    net, v, x = bf16_net()
    ff = hlofold.fold(net.apply, freeze=freeze)
    rep = ff.report(v, x)
    assert rep.num_folded == 0 and rep.num_refused == 8, str(rep)
    for s in rep.refused:
        assert "kernel is bfloat16 but the chain computes in float32" in s.reason
        assert "float32_kernels=True" in s.reason
    np.testing.assert_array_equal(np.asarray(ff(v, x), np.float32),
                                  np.asarray(jax.jit(net.apply)(v, x), np.float32))


@pytest.mark.parametrize("freeze", [(), 0])
def test_bf16_folding_is_no_less_accurate(freeze):
    net, v, x = bf16_net()
    ff = hlofold.fold(net.apply, freeze=freeze, float32_kernels=True)
    rep = ff.report(v, x)
    assert rep.num_folded == 8
    p = ff.measure_precision(v, x)
    assert p["reference"] == "float32"
    assert p["max_abs_err_unfolded"] > 0          # bf16 really differs from float32
    # folded vs float32 reference: no worse than 1.5x the unfolded bf16 program's error
    assert p["max_abs_err_folded"] <= 1.5 * p["max_abs_err_unfolded"], p
    assert "precision vs a float32 reference" in str(rep)
    assert rep.to_dict()["precision"]["ratio"] == p["ratio"]


def test_float32_kernels_option():
    net, v, x = bf16_net()
    ff = hlofold.fold(net.apply, freeze=0, float32_kernels=True)
    p = ff.measure_precision(v, x)
    # Activations are still rounded to bf16 after every layer, which dominates the error:
    # a float32 kernel removes only the kernel's rounding, so the bound stays the same.
    assert p["max_abs_err_folded"] <= 1.5 * p["max_abs_err_unfolded"], p
    assert p["rms_err_folded"] <= 1.5 * p["rms_err_unfolded"], p
    convs = [e for e, _ in walk_eqns(ff.jaxpr(v, x)) if e.primitive.name == "conv_general_dilated"]
    assert len(convs) == 8
    assert all(e.invars[1].aval.dtype == jnp.float32 for e in convs)
    assert all(e.invars[0].aval.dtype == jnp.float32 for e in convs)
    out = ff(v, x)
    assert out.dtype == jnp.bfloat16                # the program's outputs keep their dtype
