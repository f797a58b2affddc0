"""Benchmark networks in Flax linen: ResNet-18/50 and MobileNetV2, with and without BatchNorm.

Every convolution is an ``nn.Conv`` followed by ``nn.BatchNorm(use_running_average=True)``
(inference mode), the way Flax models are written. Built with ``use_bn=False`` the same
network has conv + bias and no BatchNorm: the limit of folding ("ideal"). :func:`hand_fold`
computes its parameters from the BatchNorm ones (``K·s``, ``β − μ·s`` with
``s = γ/√(σ²+ε)``, in float64, rounded once), and :func:`randomize_bn` gives the BatchNorms
realistic statistics (μ ≠ 0, σ² spread around 1, γ ≠ 1, β ≠ 0) instead of the identity that
``init`` produces.

Naming: inside every module, a conv ``conv<suffix>`` is followed by the BatchNorm
``bn<suffix>``; residual blocks are named ``block<i>`` (MobileNetV2) or
``stage<s>_block<i>`` (ResNet), so per-block figures can be read from HLO metadata.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-5


def conv_bn(x, features: int, kernel: int, *, name: str, strides: int = 1, groups: int = 1,
            use_bn: bool = True, dtype: Any = jnp.float32):
    """``nn.Conv`` (named ``conv<name>``) then inference ``nn.BatchNorm`` (``bn<name>``), or
    ``nn.Conv`` with a bias and no BatchNorm when ``use_bn=False``."""
    x = nn.Conv(features, (kernel, kernel), strides=(strides, strides), padding="SAME",
                feature_group_count=groups, use_bias=not use_bn, dtype=dtype,
                name=f"conv{name}")(x)
    if use_bn:
        x = nn.BatchNorm(use_running_average=True, epsilon=EPS, dtype=dtype,
                         name=f"bn{name}")(x)
    return x


# ----------------------------------------------------------------------------- ResNet

class BasicBlock(nn.Module):
    features: int
    strides: int = 1
    use_bn: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        cb = dict(use_bn=self.use_bn, dtype=self.dtype)
        y = nn.relu(conv_bn(x, self.features, 3, strides=self.strides, name="1", **cb))
        y = conv_bn(y, self.features, 3, name="2", **cb)
        if x.shape[-1] != self.features or self.strides != 1:
            x = conv_bn(x, self.features, 1, strides=self.strides, name="_proj", **cb)
        return nn.relu(x + y)


class BottleneckBlock(nn.Module):
    features: int
    strides: int = 1
    use_bn: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        cb = dict(use_bn=self.use_bn, dtype=self.dtype)
        y = nn.relu(conv_bn(x, self.features, 1, name="1", **cb))
        y = nn.relu(conv_bn(y, self.features, 3, strides=self.strides, name="2", **cb))
        y = conv_bn(y, 4 * self.features, 1, name="3", **cb)
        if x.shape[-1] != 4 * self.features or self.strides != 1:
            x = conv_bn(x, 4 * self.features, 1, strides=self.strides, name="_proj", **cb)
        return nn.relu(x + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    block_cls: Callable
    num_classes: int = 1000
    width: int = 64
    use_bn: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = x.astype(self.dtype)
        x = nn.relu(conv_bn(x, self.width, 7, strides=2, name="_stem", use_bn=self.use_bn,
                            dtype=self.dtype))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for s, n in enumerate(self.stage_sizes):
            for i in range(n):
                x = self.block_cls(self.width * 2 ** s, strides=2 if (i == 0 and s > 0) else 1,
                                   use_bn=self.use_bn, dtype=self.dtype,
                                   name=f"stage{s}_block{i}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


def resnet18(**kw) -> ResNet:
    return ResNet(stage_sizes=(2, 2, 2, 2), block_cls=BasicBlock, **kw)


def resnet50(**kw) -> ResNet:
    return ResNet(stage_sizes=(3, 4, 6, 3), block_cls=BottleneckBlock, **kw)


# ----------------------------------------------------------------------------- MobileNetV2

def _divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class InvertedResidual(nn.Module):
    """Expand 1×1 (ReLU6) → depthwise 3×3 (``feature_group_count`` = channels, ReLU6) →
    linear project 1×1; identity shortcut when stride 1 and shapes match."""
    features: int
    strides: int
    expand_ratio: int
    use_bn: bool = True
    dtype: Any = jnp.float32
    act: Any = nn.relu6

    @nn.compact
    def __call__(self, x):
        cb = dict(use_bn=self.use_bn, dtype=self.dtype)
        cin = x.shape[-1]
        hidden = cin * self.expand_ratio
        y = x
        if self.expand_ratio != 1:
            y = self.act(conv_bn(y, hidden, 1, name="_expand", **cb))
        y = self.act(conv_bn(y, hidden, 3, strides=self.strides, groups=hidden, name="_dw",
                             **cb))
        y = conv_bn(y, self.features, 1, name="_project", **cb)
        if self.strides == 1 and cin == self.features:
            y = x + y
        return y


MOBILENET_V2_CFG = [  # (expand ratio t, channels c, repeats n, first stride s)
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
    (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


class MobileNetV2(nn.Module):
    num_classes: int = 1000
    width_mult: float = 1.0
    use_bn: bool = True
    dtype: Any = jnp.float32
    act: Any = nn.relu6      # (nn.relu: the form cross-layer equalization passes)

    @nn.compact
    def __call__(self, x):
        cb = dict(use_bn=self.use_bn, dtype=self.dtype)
        x = x.astype(self.dtype)
        x = self.act(conv_bn(x, _divisible(32 * self.width_mult), 3, strides=2, name="_stem",
                             **cb))
        b = 0
        for t, c, n, s in MOBILENET_V2_CFG:
            for i in range(n):
                x = InvertedResidual(_divisible(c * self.width_mult), s if i == 0 else 1, t,
                                     name=f"block{b}", act=self.act, **cb)(x)
                b += 1
        last = _divisible(1280 * max(1.0, self.width_mult))
        x = self.act(conv_bn(x, last, 1, name="_last", **cb))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


def mobilenet_v2(**kw) -> MobileNetV2:
    return MobileNetV2(**kw)


MODELS = {"resnet18": resnet18, "resnet50": resnet50, "mobilenetv2": mobilenet_v2}


# ----------------------------------------------------------------------------- parameters

def init(model: nn.Module, image_size: int, *, seed: int = 0, batch: int = 1):
    """``model.init`` on a zero image, with :func:`randomize_bn` applied."""
    x = jnp.zeros((batch, image_size, image_size, 3), jnp.float32)
    variables = jax.jit(model.init)(jax.random.key(seed), x)
    return randomize_bn(variables, seed + 1) if "batch_stats" in variables else variables


def randomize_bn(variables, seed: int = 0):
    """Realistic BatchNorm statistics: γ ~ 1 + 0.2·N, β ~ 0.1·N, μ ~ 0.2·N, σ² ~ exp(0.5·N)
    (log-normal around 1), drawn per channel."""
    rng = np.random.default_rng(seed)

    def walk(params, stats):
        p_out, s_out = {}, {}
        for k in params:
            if k.startswith("bn") and "scale" in params[k]:
                c = params[k]["scale"].shape
                dt = params[k]["scale"].dtype
                p_out[k] = {"scale": jnp.asarray(1 + 0.2 * rng.standard_normal(c), dt),
                            "bias": jnp.asarray(0.1 * rng.standard_normal(c), dt)}
                s_out[k] = {"mean": jnp.asarray(0.2 * rng.standard_normal(c), dt),
                            "var": jnp.asarray(np.exp(0.5 * rng.standard_normal(c)), dt)}
            elif isinstance(params[k], dict) and not k.startswith("conv") and k != "head":
                p_out[k], s_out[k] = walk(params[k], stats.get(k, {}))
                if not s_out[k]:
                    del s_out[k]
            else:
                p_out[k] = params[k]
        return p_out, s_out

    params, stats = walk(_plain(variables["params"]), _plain(variables["batch_stats"]))
    return {"params": params, "batch_stats": stats}


def hand_fold(variables, eps: float = EPS):
    """Parameters of the ``use_bn=False`` network equivalent to ``variables``: every
    ``conv<x>`` gets kernel ``K·s`` and bias ``β − μ·s`` with ``s = γ/√(σ²+ε)`` taken from
    ``bn<x>``, computed in float64 and rounded once to the parameter dtype."""
    def walk(params, stats):
        out = {}
        for k, v in params.items():
            if k.startswith("conv"):
                bn = "bn" + k[4:]
                dt = v["kernel"].dtype
                K = np.asarray(v["kernel"], np.float64)
                g = np.asarray(params[bn]["scale"], np.float64)
                b = np.asarray(params[bn]["bias"], np.float64)
                m = np.asarray(stats[bn]["mean"], np.float64)
                var = np.asarray(stats[bn]["var"], np.float64)
                s = g / np.sqrt(var + eps)
                out[k] = {"kernel": jnp.asarray(K * s, dt), "bias": jnp.asarray(b - m * s, dt)}
            elif k.startswith("bn"):
                continue
            elif isinstance(v, dict) and k != "head":
                out[k] = walk(v, stats.get(k, {}))
            else:
                out[k] = v
        return out

    return {"params": walk(_plain(variables["params"]), _plain(variables["batch_stats"]))}


def _plain(tree):
    """FrozenDict/dict → nested plain dicts."""
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def count_bn(variables) -> int:
    """Number of BatchNorm layers (modules with running statistics)."""
    n = 0
    stack = [variables.get("batch_stats", {})]
    while stack:
        d = stack.pop()
        for k, v in d.items():
            if k.startswith("bn") and "mean" in v:
                n += 1
            elif hasattr(v, "items"):
                stack.append(v)
    return n


def block_names(variables) -> list[str]:
    """Names of the residual blocks (top-level scopes named ``...block<i>``), in order."""
    import re
    key = lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)]  # noqa: E731
    return sorted((k for k in variables["params"] if "block" in k), key=key)


def build(name: str, *, image_size: int = 224, num_classes: int = 1000, width: float | None = None,
          dtype: Any = jnp.float32, seed: int = 0):
    """``(model, ideal_model, variables, ideal_variables)`` for ``name`` in :data:`MODELS`.

    ``width``: base width for ResNets (default 64), width multiplier for MobileNetV2
    (default 1.0)."""
    kw: dict = {"num_classes": num_classes, "dtype": dtype}
    if width is not None:
        kw["width_mult" if name == "mobilenetv2" else "width"] = (
            float(width) if name == "mobilenetv2" else int(width))
    model = MODELS[name](use_bn=True, **kw)
    ideal_model = MODELS[name](use_bn=False, **kw)
    variables = init(model, image_size, seed=seed)
    ideal = hand_fold(variables)
    return model, ideal_model, variables, ideal
