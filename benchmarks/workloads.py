"""Workloads of ``benchmarks.calls``: networks with parameters made in NumPy (no compile
before the measured call), a one-conv model, and StableHLO artifacts with weight arguments.

Networks, as ``(f, params, x)`` with ``f(params, x)``:

* ``flax-resnet18|50``, ``flax-mobilenetv2``: :mod:`benchmarks.models` (Flax linen);
* ``haiku-resnet50``: ``haiku.nets.ResNet50``, inference mode;
* ``tiny-flax``: a ResNet-18 of width 8 (smoke runs);
* ``flaxmodels-resnet18``: the ``flaxmodels`` library's ResNet-18 (``pip install flaxmodels``;
  the slow tier's lock pins it), the small CNN users start with;
* ``fwd-stem``, ``fwd-bn-conv``: affines folded forward into SAME-padded convs, through a
  per-position bias map (:func:`forward_net`).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np


def fill(shapes, seed: int = 0):
    """Random parameters for a pytree of ``ShapeDtypeStruct``, by leaf name: BatchNorm
    variances positive (log-normal around 1), scales around 1, shifts and means small,
    kernels He-scaled, integer leaves (counters) zero."""
    rng = np.random.default_rng(seed)

    def one(path, s):
        name = jax.tree_util.keystr(path).lower()
        shape, dt = tuple(s.shape), np.dtype(s.dtype)
        if not np.issubdtype(dt, np.floating):
            return np.zeros(shape, dt)
        n = rng.standard_normal(shape)
        if "var" in name:
            v = np.exp(0.5 * n)
        elif "scale" in name:
            v = 1 + 0.2 * n
        elif len(shape) >= 2:
            v = n * np.sqrt(2.0 / max(1, int(np.prod(shape[:-1]))))
        else:
            v = 0.1 * n
        return jnp.asarray(v.astype(dt))
    return jax.tree_util.tree_map_with_path(one, shapes)


def network(name: str, size: int, batch: int = 1):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((batch, size, size, 3)),
                    jnp.float32)
    if name.startswith("haiku-"):
        import haiku as hk
        depth = int(name.split("resnet")[1])
        net = {50: hk.nets.ResNet50, 18: hk.nets.ResNet18}[depth]
        tr = hk.transform_with_state(lambda x, training: net(1000)(x, is_training=training))
        # the moving averages exist once a training step made them
        p_s, s_s = jax.eval_shape(lambda k, x: tr.init(k, x, True), jax.random.key(0), x)
        params = {"params": fill(p_s), "state": fill(s_s, 1)}

        def f(v, x):
            return tr.apply(v["params"], v["state"], None, x, False)[0]
        return f, params, x
    if name.startswith("fwd-"):
        return forward_net(name, size, batch)
    if name == "flaxmodels-resnet18":
        import flaxmodels as fm
        m = fm.ResNet18(output="logits", pretrained=None, normalize=False, num_classes=10)
        shapes = jax.eval_shape(lambda k, x: m.init(k, x, train=False), jax.random.key(0), x)
        return (lambda v, x: m.apply(v, x, train=False)), fill(shapes), x
    from . import models as M
    if name == "tiny-flax":
        model = M.resnet18(num_classes=10, width=8)
    else:
        model = M.MODELS[name.split("-", 1)[1]](num_classes=1000)
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    params = fill(shapes)
    return (lambda v, x: model.apply(v, x)), params, x


def forward_net(name: str, size: int, batch: int = 1):
    """Affines in front of SAME-padded convs (folded with a bias map ``conv(pad(t), K)``):

    * ``fwd-stem``: ``(x − mean)/std`` → conv 7×7/2 SAME, 64 → BatchNorm → ReLU (a ResNet
      stem with its input standardization inside the model);
    * ``fwd-bn-conv``: conv 3×3 SAME, 64 → ReLU → BatchNorm → conv 3×3 SAME → ReLU (BN
      after the activation folds forward only), at ``size/4``."""
    rng = np.random.default_rng(0)
    he = lambda *s: jnp.asarray(rng.standard_normal(s) * np.sqrt(2 / np.prod(s[:-1])),  # noqa
                                jnp.float32)
    bn = lambda c: {"mean": jnp.asarray(0.1 * rng.standard_normal(c), jnp.float32),  # noqa
                    "var": jnp.asarray(np.exp(0.3 * rng.standard_normal(c)), jnp.float32),
                    "scale": jnp.asarray(1 + 0.1 * rng.standard_normal(c), jnp.float32),
                    "bias": jnp.asarray(0.1 * rng.standard_normal(c), jnp.float32)}
    conv = lambda x, k, s=1: jax.lax.conv_general_dilated(  # noqa: E731
        x, k, (s, s), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    norm = lambda y, p: (y - p["mean"]) * jax.lax.rsqrt(p["var"] + 1e-5) * p["scale"] \
        + p["bias"]  # noqa: E731
    if name == "fwd-stem":
        params = {"mean": jnp.asarray([0.485, 0.456, 0.406], jnp.float32),
                  "std": jnp.asarray([0.229, 0.224, 0.225], jnp.float32),
                  "k": he(7, 7, 3, 64), "bn": bn(64)}
        x = jnp.asarray(rng.uniform(size=(batch, size, size, 3)), jnp.float32)

        def f(p, x):
            return jax.nn.relu(norm(conv((x - p["mean"]) / p["std"], p["k"], 2), p["bn"]))
        return f, params, x
    params = {"k1": he(3, 3, 64, 64), "bn": bn(64), "k2": he(3, 3, 64, 64)}
    x = jnp.asarray(rng.standard_normal((batch, size // 4, size // 4, 64)), jnp.float32)

    def f(p, x):
        return jax.nn.relu(conv(norm(jax.nn.relu(conv(x, p["k1"])), p["bn"]), p["k2"]))
    return f, params, x


def one_conv():
    """conv → BatchNorm on an 8×8×4 image: the per-call overhead dominates."""
    rng = np.random.default_rng(0)
    params = {"k": jnp.asarray(rng.standard_normal((3, 3, 4, 8)) / 6, jnp.float32),
              "mean": jnp.asarray(0.1 * rng.standard_normal(8), jnp.float32),
              "var": jnp.asarray(np.exp(0.3 * rng.standard_normal(8)), jnp.float32),
              "scale": jnp.asarray(1 + 0.1 * rng.standard_normal(8), jnp.float32),
              "bias": jnp.asarray(0.1 * rng.standard_normal(8), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((1, 8, 8, 4)), jnp.float32)

    def f(p, x):
        y = jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (y - p["mean"]) * jax.lax.rsqrt(p["var"] + 1e-5) * p["scale"] + p["bias"]
    return f, params, x


def nnx_vit_keys(d: int = 64, depth: int = 4, tokens: int = 16):
    """A Flax NNX ViT-style encoder built with ``rngs=`` (LayerNorm → MLP blocks, dropout):
    its state holds PRNG key leaves (6 here) beside ~40 arrays, every norm left by the cost
    rule — a steady call is all dispatch (issue 69, item 8). ``(f, state, x)``."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(d, rngs=rngs)
            self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return x + self.drop(self.fc2(jax.nn.gelu(self.fc1(self.norm(x)))))

    class ViT(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Linear(48, d, rngs=rngs)
            blocks = [Block(rngs) for _ in range(depth)]
            self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
            self.norm, self.head = nnx.LayerNorm(d, rngs=rngs), nnx.Linear(d, 10, rngs=rngs)
            self.rngs = rngs

        def __call__(self, x):
            x = self.embed(x)
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(x).mean(1))

    model = ViT(nnx.Rngs(0, dropout=1))
    model.eval()
    graphdef, state = nnx.split(model)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, tokens, 48)), jnp.float32)
    return (lambda state, x: nnx.merge(graphdef, state)(x)), state, x


TESTDATA = os.path.join(os.path.dirname(__file__), os.pardir, "tests", "testdata")


def artifacts(quick: bool = False) -> dict:
    """``name: (original callable, its args, folded callable, its args)`` for StableHLO
    modules whose weights are arguments; the folded one is the apply module of
    ``fold_stablehlo(..., params=weights)``, taking the input then the prepared weights."""
    import hlofold
    from hlofold import examples
    from hlofold._ir.stablehlo.artifacts import module_callable
    out = {}
    data = os.path.join(TESTDATA, "stablehlo")
    text = open(os.path.join(data, "keras_tf_args.mlir")).read()
    w = dict(np.load(os.path.join(data, "keras_tf_args.npz")))
    x = np.load(os.path.join(data, "keras_tf_io.npz"))["x"]
    apply, _, prepared = hlofold.fold_stablehlo(text, params=w)
    # weights on the device once, on both sides, as a user running the module would
    x, prepared = jax.device_put(x), jax.device_put(prepared)
    out["keras-tf (TensorFlow's module, 3 BN)"] = (
        jax.jit(module_callable(text)),
        (x, *jax.device_put([w[f"arg{i}"] for i in range(1, len(w) + 1)])),
        jax.jit(module_callable(apply)), (x, *prepared))
    # the same module split into prepare (run once) and apply: hlofold not needed at run time
    s_apply, _, s_prep = hlofold.fold_stablehlo(text, split=["arg0"])
    *s_prepared, ok = module_callable(s_prep)(*[w[f"arg{i}"] for i in range(1, len(w) + 1)])
    assert bool(ok)
    out["keras-tf, split= (prepare module once, apply)"] = (
        jax.jit(module_callable(text)),
        (x, *jax.device_put([w[f"arg{i}"] for i in range(1, len(w) + 1)])),
        jax.jit(module_callable(s_apply)), (x, *s_prepared))
    depth, width, size, batch = (10, 8, 32, 2) if quick else (18, 64, 112, 8)
    P = examples.init_resnet(depth, width=width, seed=0)
    leaves, tree = jax.tree.flatten(P)
    xr = jnp.asarray(np.random.default_rng(0).standard_normal((batch, size, size, 3)),
                     jnp.float32)

    def f(*a):
        return examples.resnet_apply(jax.tree.unflatten(tree, a[:-1]), a[-1])
    exp = jax.export.export(jax.jit(f))(*leaves, xr)
    params = {f"arg{i}": np.asarray(l) for i, l in enumerate(leaves)}
    new, _, prep = hlofold.fold_stablehlo(exp, params=params)
    out[f"jax.export ResNet-{depth} w{width} {size}px b{batch}"] = (
        jax.jit(exp.call), (*leaves, xr), jax.jit(new.call), (xr, *prep))
    module = exp.mlir_module()
    s_apply, _, s_prep = hlofold.fold_stablehlo(module, split=[len(leaves)])
    *s_prepared, ok = module_callable(s_prep)(*leaves)
    assert bool(ok)
    out[f"ResNet-{depth} module, split="] = (
        jax.jit(exp.call), (*leaves, xr), jax.jit(module_callable(s_apply)), (xr, *s_prepared))
    return out
