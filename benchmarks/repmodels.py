"""Multi-branch (re-parameterizable) CNN blocks in Flax, written from their papers, with
their deploy forms: the tests' and benchmarks' models for branch merging.

* RepVGG (Ding et al. 2021): 3×3 conv+BN, 1×1 conv+BN, and a BN of the input when the
  block keeps its shape; summed, then ReLU. Stride-2 blocks have no identity.
* MobileOne (Vasu et al. 2023): a depthwise stage (k 3×3 depthwise conv+BN branches, a 1×1
  depthwise conv+BN, an identity BN) then a pointwise stage (k 1×1 conv+BN branches, an
  identity BN), each summed, then ReLU.
* ACNet (Ding et al. 2019): 3×3, 1×3 and 3×1 conv+BN summed.
* Diverse Branch Block (Ding et al. 2021): k×k conv+BN, 1×1 conv+BN, 1×1 conv+BN → k×k
  average pool → BN, and 1×1 conv+BN → k×k conv+BN, summed.

``make(kind, ...)`` gives ``(apply, variables, deploy_apply)``: ``apply(variables, x)`` the
trained (multi-branch) form in inference mode, with trained-looking BatchNorm statistics;
``deploy_apply(dvars, x)`` the hand-written deploy form (one conv + bias per block, the
same widths), whose variables ``deploy_variables(...)`` gives (random: for timing).
Flax is imported when a model is made (it is in the test extra, not a dependency).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _linen():
    import flax.linen as nn
    return nn


def _conv_bn(nn, c, k, stride=1, groups=1, pad=None, name=None):
    pad = pad if pad is not None else [(kk // 2, kk // 2) for kk in k]

    class ConvBN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(c, tuple(k), strides=stride, padding=pad, feature_group_count=groups,
                        use_bias=False)(x)
            return nn.BatchNorm(use_running_average=True)(x)
    return ConvBN(name=name)


def repvgg_block(nn, cin, cout, stride, groups=1):
    class RepVGGBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = _conv_bn(nn, cout, (3, 3), stride, groups)(x) + \
                _conv_bn(nn, cout, (1, 1), stride, groups)(x)
            if cin == cout and stride == 1:
                y = y + nn.BatchNorm(use_running_average=True)(x)
            return nn.relu(y)
    return RepVGGBlock()


def mobileone_block(nn, cin, cout, stride, k=2):
    class MobileOneBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = sum(_conv_bn(nn, cin, (3, 3), stride, cin)(x) for _ in range(k))
            y = y + _conv_bn(nn, cin, (1, 1), stride, cin)(x)
            if stride == 1:
                y = y + nn.BatchNorm(use_running_average=True)(x)
            x = nn.relu(y)
            y = sum(_conv_bn(nn, cout, (1, 1))(x) for _ in range(k))
            if cin == cout:
                y = y + nn.BatchNorm(use_running_average=True)(x)
            return nn.relu(y)
    return MobileOneBlock()


def acnet_block(nn, cin, cout, stride):
    class ACBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = _conv_bn(nn, cout, (3, 3), stride)(x)
            y = y + _conv_bn(nn, cout, (1, 3), stride, pad=[(0, 0), (1, 1)])(x)
            y = y + _conv_bn(nn, cout, (3, 1), stride, pad=[(1, 1), (0, 0)])(x)
            return nn.relu(y)
    return ACBlock()


def dbb_block(nn, cin, cout, stride):
    class DBBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = _conv_bn(nn, cout, (3, 3), stride)(x) + _conv_bn(nn, cout, (1, 1), stride)(x)
            a = _conv_bn(nn, cout, (1, 1))(x)
            a = nn.avg_pool(a, (3, 3), strides=(stride, stride), padding=((1, 1), (1, 1)))
            y = y + nn.BatchNorm(use_running_average=True)(a)
            s = _conv_bn(nn, cin, (1, 1))(x)
            y = y + _conv_bn(nn, cout, (3, 3), stride)(s)
            return nn.relu(y)
    return DBBlock()


BLOCKS = {"repvgg": repvgg_block, "mobileone": mobileone_block, "acnet": acnet_block,
          "dbb": dbb_block}


def stages(kind: str, width: int, blocks: int) -> list[tuple[int, int, int]]:
    """(cin, cout, stride) per block: a stem-like stride-2 block, then ``blocks - 1`` blocks
    in stages that double the width at each stride 2."""
    out, c = [(3, width, 2)], width
    for i in range(1, blocks):
        stride = 2 if i % 3 == 0 else 1
        cout = c * 2 if stride == 2 else c
        out.append((c, cout, stride))
        c = cout
    return out


# the published networks' stages: (width, blocks), each stage starting with a stride 2
ARCHS = {
    "repvgg_a0": ("repvgg", [(48, 1), (48, 2), (96, 4), (192, 14), (1280, 1)]),
    "mobileone_s0": ("mobileone", [(48, 1), (48, 2), (128, 8), (256, 10), (1024, 1)]),
}


def flat_spec(width: int, blocks: int = 4, cin: int = 16) -> list[tuple[int, int, int]]:
    """``blocks`` blocks of ``width`` channels at stride 1, the first from ``cin`` channels:
    the stack the option grid of ``benchmarks.branches --grid`` runs (issue 53)."""
    return [(cin, width, 1)] + [(width, width, 1)] * (blocks - 1)


def arch_spec(name: str) -> tuple[str, list[tuple[int, int, int]]]:
    """``(block kind, [(cin, cout, stride), ...])`` of a published network (``ARCHS``)."""
    kind, stages_ = ARCHS[name]
    out, c = [], 3
    for width, n in stages_:
        for i in range(n):
            out.append((c, width, 2 if i == 0 else 1))
            c = width
    return kind, out


def make(kind: str, width: int = 32, blocks: int = 4, size: int = 32, batch: int = 1,
         seed: int = 0, spec=None):
    """``(apply, variables, x)``: the multi-branch network in inference mode (``kind`` a
    block kind with ``stages(kind, width, blocks)``, or a name in ``ARCHS``)."""
    nn = _linen()
    if kind in ARCHS:
        kind, spec = arch_spec(kind)
    spec = spec or stages(kind, width, blocks)
    k_branches = {"mobileone": 4}.get(kind)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for cin, cout, s in spec:
                x = (BLOCKS[kind](nn, cin, cout, s, k=k_branches) if k_branches else
                     BLOCKS[kind](nn, cin, cout, s))(x)
            return jnp.mean(x, axis=(1, 2))

    net = Net()
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(
        (batch, size, size, spec[0][0])), jnp.float32)
    variables = trained_like(net.init(jax.random.PRNGKey(seed), x), seed)
    return net.apply, variables, x


def trained_like(variables, seed: int = 0):
    """BatchNorm statistics and affine parameters as training leaves them (init values
    would make every BN an identity)."""
    rng = np.random.default_rng(seed + 1)

    def f(path, a):
        name = str(path[-1])
        if "mean" in name or "bias" in name:
            return jnp.asarray(rng.standard_normal(a.shape) * 0.2, a.dtype)
        if "var" in name:
            return jnp.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype)
        if "scale" in name:
            return jnp.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype)
        return jnp.asarray(rng.standard_normal(a.shape) * (2.0 / max(1, np.prod(a.shape[:-1]))) ** 0.5,
                           a.dtype)
    return jax.tree_util.tree_map_with_path(f, variables)


def make_deploy(kind: str, width: int = 32, blocks: int = 4, size: int = 32,
                batch: int = 1, seed: int = 0, spec=None):  # (kind: a block kind, or in ARCHS)
    """``(apply, params, x)``: the deploy form a hand-written re-parameterization gives —
    per block one conv of the largest window plus a bias (MobileOne: a 3×3 depthwise and a
    1×1 conv) — with random weights (for timing)."""
    rng = np.random.default_rng(seed)
    if kind in ARCHS:
        kind, spec = arch_spec(kind)
    spec = spec or stages(kind, width, blocks)
    params = []
    for cin, cout, s in spec:
        if kind == "mobileone":
            layers = [(rng.standard_normal((3, 3, 1, cin)) * 0.3, cin, s, 1),
                      (rng.standard_normal((1, 1, cin, cout)) * 0.3, 1, 1, 0)]
        else:
            layers = [(rng.standard_normal((3, 3, cin, cout)) * 0.1, 1, s, 1)]
        params.append([(jnp.asarray(k, jnp.float32), jnp.asarray(rng.standard_normal(
            k.shape[-1]) * 0.1, jnp.float32), g, st, p) for k, g, st, p in layers])
    statics = [[(g, st, p) for _, _, g, st, p in block] for block in params]
    weights = [[(k, b) for k, b, *_ in block] for block in params]

    def apply(weights, x):
        for block, st_block in zip(weights, statics):
            for (k, b), (g, st, p) in zip(block, st_block):
                x = jax.lax.conv_general_dilated(
                    x, k, (st, st), [(p, p), (p, p)], feature_group_count=g,
                    dimension_numbers=("NHWC", "HWIO", "NHWC"))
                x = jax.nn.relu(x + b)
        return jnp.mean(x, axis=(1, 2))

    x = jnp.asarray(np.random.default_rng(seed).standard_normal(
        (batch, size, size, spec[0][0])), jnp.float32)
    return apply, weights, x


def conv_count(closed) -> int:
    """Convolutions a program runs (nested jaxprs included; a guard's fallback not)."""
    from tests.helpers import walk_eqns
    return sum(e.primitive.name == "conv_general_dilated" for e, _ in walk_eqns(closed))


def deploy_convs(kind: str, blocks: int) -> int:
    """Convolutions of the deploy form of ``make(kind, blocks=blocks)``."""
    return blocks * (2 if kind == "mobileone" else 1)


__all__: Sequence[str] = ("make", "make_deploy", "conv_count", "deploy_convs", "BLOCKS")
