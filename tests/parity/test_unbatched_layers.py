"""Equinox's unbatched layers under ``vmap`` after a norm (equimo's ConvNeXt: LayerNorm2d →
``Conv2d(1×1)``, the stem's norm → a strided conv, the final norm → ``eqx.nn.Linear``; issue
69, item 5). ``vmap`` of an unbatched ``Conv2d`` puts a ``broadcast_in_dim``/``reshape``
between the norm's ``+ β`` and ``lax.conv`` (the batch axes merged, the channels whole); the
forward fold passes such shape ops next to the root, on both paths, where it had reported
"its result goes to add, not straight into a convolution" (untrue)."""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import hlofold

TOL = 2e-5
C = 8


class LayerNorm2d(eqx.Module):
    """equimo's: a LayerNorm over the channels of a (C, H, W) image."""

    g: jax.Array
    b: jax.Array

    def __call__(self, x):
        m = x.mean(0, keepdims=True)
        v = ((x - m) ** 2).mean(0, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-6) * self.g[:, None, None] + self.b[:, None, None]


class Block(eqx.Module):
    norm: LayerNorm2d
    conv: eqx.nn.Conv2d
    head_norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __call__(self, x):
        y = self.conv(self.norm(x))                       # (16, H', W')
        return self.head(self.head_norm(y.mean((1, 2))))


def _model(kernel, stride, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    norm = LayerNorm2d(1 + 0.2 * jax.random.normal(k[0], (C,)),
                       0.2 * jax.random.normal(k[1], (C,)))
    conv = eqx.nn.Conv2d(C, 16, kernel, stride=stride, key=k[2])
    head_norm = eqx.nn.LayerNorm(16)
    head_norm = eqx.tree_at(lambda n: (n.weight, n.bias), head_norm,
                            (1 + 0.2 * jax.random.normal(k[3], (16,)),
                             0.2 * jax.random.normal(k[4], (16,))))
    net = Block(norm, conv, head_norm, eqx.nn.Linear(16, 5, key=k[5]))
    params, static = eqx.partition(net, eqx.is_array)

    def f(p, x):
        return jax.vmap(eqx.combine(p, static))(x)
    return f, params, jax.random.normal(k[0], (2, C, 8, 8))


def _err(a, b):
    return float(jnp.max(jnp.abs(a - b)))


CASES = [(1, 1), (2, 2)]        # pwconv1; the stem/downsampler's unpadded strided conv


@pytest.mark.parametrize("kernel,stride", CASES)
def test_fold_params_writes_both_norms(kernel, stride):
    f, p, x = _model(kernel, stride)
    out = hlofold.fold_params(f, p, x)
    kernels = sorted(c.kernel for c in out.changes)
    assert kernels == [".conv.weight", ".head.weight"], str(out)
    assert not any("not straight into" in str(s.reason) for s in out.report.sites), str(out)
    assert _err(f(out.params, x), f(p, x)) < TOL


@pytest.mark.parametrize("kernel,stride", CASES)
def test_the_decorator_and_stablehlo_fold_them(kernel, stride):
    f, p, x = _model(kernel, stride)
    ref = f(p, x)
    ff = hlofold.fold(f, freeze=0, fold_costly=True)
    assert ff.report(p, x).num_folded == 2, str(ff.report(p, x))
    assert _err(ff(p, x), ref) < TOL
    exp = jax.export.export(jax.jit(f))(p, x)
    leaves = jax.tree.leaves(p)
    new, rep, prep = hlofold.fold_stablehlo(exp, params={f"arg{i}": v
                                                         for i, v in enumerate(leaves)})
    assert rep.num_folded == 2, str(rep)
    assert _err(new.call(x, *prep), ref) < TOL


def test_a_reshape_that_mixes_the_channels_stops_the_chain():
    """A flatten of (C, H, W) before a dense layer merges the channels with the pixels: the
    norm's scale is no per-input-feature scale of the dense there; nothing folds."""
    k = jax.random.split(jax.random.key(3), 3)
    p = {"g": 1 + 0.2 * jax.random.normal(k[0], (C,)), "w": jax.random.normal(k[1], (C * 4, 3))}

    def f(p, x):                  # x: (B, C, 2, 2)
        y = x * p["g"][:, None, None]
        return y.reshape(x.shape[0], -1) @ p["w"]
    x = jax.random.normal(k[2], (2, C, 2, 2))
    out = hlofold.fold_params(f, p, x)
    assert not out.changes and out.report.num_folded == 0, str(out)
    assert _err(f(out.params, x), f(p, x)) == 0.0


def test_a_norm_read_by_a_layer_and_a_residual_says_so_on_both_paths():
    """equimo's stem norm: its result (past its own ``+ β`` and the unbatched conv's
    ``broadcast_in_dim``) is read by the block's depthwise conv *and* by the residual add.
    Nothing folds it; the record says it has two readers (it said "its result goes to add,
    not straight into a convolution", the norm's own β)."""
    k = jax.random.split(jax.random.key(4), 5)
    stem = eqx.nn.Conv2d(3, C, 2, stride=2, key=k[4])
    norm = LayerNorm2d(1 + 0.2 * jax.random.normal(k[0], (C,)),
                       0.2 * jax.random.normal(k[1], (C,)))
    conv = eqx.nn.Conv2d(C, C, 3, padding=1, groups=C, key=k[2])

    def f(p, x):
        def one(x):
            y = p[1](p[0](x))
            return p[2](y) + y
        return jax.vmap(one)(x)
    p, x = (stem, norm, conv), jax.random.normal(k[3], (2, 3, 12, 12))
    for rep in (hlofold.fold_params(f, p, x).report, hlofold.fold(f).report(p, x),
                hlofold.fold_stablehlo(jax.export.export(jax.jit(f))(p, x))[1]):
        left = [s for s in rep.sites if s.pattern == "unreached_affine"]
        assert rep.num_folded == 0 and len(left) == 1, str(rep)
        assert "is read by 2 ops" in left[0].reason, left[0].reason
        assert "not straight into" not in left[0].reason, left[0].reason
