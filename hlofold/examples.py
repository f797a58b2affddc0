"""Built-in example networks in plain JAX (no NN library needed).

``init_resnet(depth)``/``resnet_apply`` build a ResNet (basic blocks for depth 10/18/34, bottlenecks for 50/101)
in NHWC with inference BatchNorm written the way Flax writes it, and parameters with
realistic BN statistics (means ≠ 0, variances spread around 1, γ ≠ 1, β ≠ 0). The same
network *without* BN (conv + bias, the limit of folding) is available through
``resnet_apply(..., bn=False)`` with ``ideal_params``.

``init_repvgg``/``repvgg_apply`` build a RepVGG-style stack trained as a sum of parallel
branches (3×3 conv+BN, 1×1 conv+BN, a BN of the input), and ``repvgg_deploy`` /
``repvgg_deploy_apply`` its deploy form written by hand (one 3×3 conv + bias per block):
what ``hlofold.fold`` merges the train-time form into.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_BLOCKS = {10: ("basic", [1, 1, 1, 1]), 18: ("basic", [2, 2, 2, 2]),
           34: ("basic", [3, 4, 6, 3]), 50: ("bottleneck", [3, 4, 6, 3]),
           101: ("bottleneck", [3, 4, 23, 3])}
EPS = 1e-5


def _bn_params(rng: np.random.Generator, c: int) -> dict:
    return {"scale": (1.0 + 0.2 * rng.standard_normal(c)).astype(np.float32),
            "bias": (0.1 * rng.standard_normal(c)).astype(np.float32),
            "mean": (0.2 * rng.standard_normal(c)).astype(np.float32),
            "var": np.exp(0.5 * rng.standard_normal(c)).astype(np.float32)}


def _conv_params(rng, kh, kw, cin, cout):
    std = np.sqrt(2.0 / (kh * kw * cin))
    return (std * rng.standard_normal((kh, kw, cin, cout))).astype(np.float32)


def init_resnet(depth: int = 18, *, width: int = 64, num_classes: int = 10, seed: int = 0,
                in_channels: int = 3) -> dict:
    """Parameters of a ResNet-``depth`` with realistic random BN statistics."""
    if depth not in _BLOCKS:
        raise ValueError(f"depth must be one of {sorted(_BLOCKS)}, got {depth}")
    kind, counts = _BLOCKS[depth]
    rng = np.random.default_rng(seed)
    p = {"stem": {"conv": _conv_params(rng, 7, 7, in_channels, width),
                  "bn": _bn_params(rng, width)}}
    cin = width
    expansion = 4 if kind == "bottleneck" else 1
    for si, n in enumerate(counts):
        cmid = width * 2 ** si
        cout = cmid * expansion
        for bi in range(n):
            stride = 2 if (bi == 0 and si > 0) else 1
            blk: dict = {}
            if kind == "basic":
                blk["conv1"], blk["bn1"] = _conv_params(rng, 3, 3, cin, cmid), _bn_params(rng, cmid)
                blk["conv2"], blk["bn2"] = _conv_params(rng, 3, 3, cmid, cout), _bn_params(rng, cout)
            else:
                blk["conv1"], blk["bn1"] = _conv_params(rng, 1, 1, cin, cmid), _bn_params(rng, cmid)
                blk["conv2"], blk["bn2"] = _conv_params(rng, 3, 3, cmid, cmid), _bn_params(rng, cmid)
                blk["conv3"], blk["bn3"] = _conv_params(rng, 1, 1, cmid, cout), _bn_params(rng, cout)
            if stride != 1 or cin != cout:
                blk["proj"], blk["bn_proj"] = (_conv_params(rng, 1, 1, cin, cout),
                                               _bn_params(rng, cout))
            p[f"stage{si}_block{bi}"] = blk
            cin = cout
    p["head"] = {"w": (rng.standard_normal((cin, num_classes)) / np.sqrt(cin)).astype(np.float32),
                 "b": np.zeros(num_classes, np.float32)}
    return jax.tree.map(jnp.asarray, p)


def ideal_params(params: dict) -> dict:
    """The same network with every BN folded by hand (conv kernel·s, bias t): the ideal."""
    def fold(conv, bn):
        s = bn["scale"] / jnp.sqrt(bn["var"] + EPS)
        return {"kernel": conv * s, "bias": bn["bias"] - bn["mean"] * s}
    out = {}
    for name, blk in params.items():
        if name == "head":
            out[name] = blk
            continue
        nb = {}
        for k in blk:
            if k.startswith("conv") or k == "proj":
                bn_key = "bn" if k == "conv" else ("bn_proj" if k == "proj" else "bn" + k[4:])
                nb[k] = fold(blk[k], blk[bn_key])
        out[name] = nb
    return out


def _conv(x, k, stride=1):
    pad = "SAME" if k.shape[0] > 1 else "VALID"
    return lax.conv_general_dilated(x, k, (stride, stride), pad,
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _bn(y, bn):
    # Flax linen's spelling: (y - mean) * (rsqrt(var + eps) * scale) + bias
    return (y - bn["mean"]) * (lax.rsqrt(bn["var"] + EPS) * bn["scale"]) + bn["bias"]


def _conv_bn(x, blk, conv_key, bn_key, stride, bn):
    if bn:
        return _bn(_conv(x, blk[conv_key], stride), blk[bn_key])
    c = blk[conv_key]
    return _conv(x, c["kernel"], stride) + c["bias"]


def resnet_apply(params: dict, x: jax.Array, *, bn: bool = True) -> jax.Array:
    """Logits of the ResNet for NHWC images ``x``. ``bn=False`` takes ``ideal_params``."""
    relu = jax.nn.relu
    x = relu(_conv_bn(x, params["stem"], "conv", "bn", 2, bn))
    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    for name in params:
        if not name.startswith("stage"):
            continue
        blk = params[name]
        stride = 2 if name.endswith("block0") and not name.startswith("stage0") else 1
        bottleneck = "conv3" in blk
        h = relu(_conv_bn(x, blk, "conv1", "bn1", 1 if bottleneck else stride, bn))
        if bottleneck:
            h = relu(_conv_bn(h, blk, "conv2", "bn2", stride, bn))
            h = _conv_bn(h, blk, "conv3", "bn3", 1, bn)
        else:
            h = _conv_bn(h, blk, "conv2", "bn2", 1, bn)
        sc = _conv_bn(x, blk, "proj", "bn_proj", stride, bn) if "proj" in blk else x
        x = relu(h + sc)
    x = jnp.mean(x, axis=(1, 2))
    return x @ params["head"]["w"] + params["head"]["b"]


def count_bn(params: dict) -> int:
    """Number of BatchNorm layers in ``params``."""
    return sum(1 for blk in params.values() for k in blk if k.startswith("bn"))


# ------------------------------------------------------------------ a RepVGG-style stack


def init_repvgg(blocks: int = 4, *, width: int = 32, in_channels: int = 16,
                seed: int = 0) -> list:
    """Parameters of :func:`repvgg_apply`: ``blocks`` RepVGG blocks of ``width`` channels
    (the first from ``in_channels``), each a 3×3 conv+BN, a 1×1 conv+BN and, where the block
    keeps its width, a BN of its input; trained-looking BN statistics."""
    rng = np.random.default_rng(seed)
    out, cin = [], in_channels
    for _ in range(blocks):
        blk = {"k3": _conv_params(rng, 3, 3, cin, width), "bn3": _bn_params(rng, width),
               "k1": _conv_params(rng, 1, 1, cin, width), "bn1": _bn_params(rng, width)}
        if cin == width:
            blk["bn_id"] = _bn_params(rng, width)
        out.append(blk)
        cin = width
    return jax.tree.map(jnp.asarray, out)


def repvgg_apply(params: list, x: jax.Array) -> jax.Array:
    """The train-time form in inference mode: per block, the branches summed, then ReLU."""
    for blk in params:
        y = _bn(_conv(x, blk["k3"]), blk["bn3"]) + _bn(_conv(x, blk["k1"]), blk["bn1"])
        if "bn_id" in blk:
            y = y + _bn(x, blk["bn_id"])
        x = jax.nn.relu(y)
    return x


def repvgg_deploy(params: list) -> list:
    """The deploy form's parameters, merged by hand as RepVGG's ``reparameterize`` does (the
    1×1 kernel and the identity centred in the 3×3 window): ``{"kernel", "bias"}`` per block."""
    out = []
    for blk in params:
        k = np.array(blk["k3"], np.float64)
        s3, t3 = _affine(blk["bn3"])
        s1, t1 = _affine(blk["bn1"])
        k = k * s3
        k[1, 1] += np.asarray(blk["k1"], np.float64)[0, 0] * s1
        bias = t3 + t1
        if "bn_id" in blk:
            si, ti = _affine(blk["bn_id"])
            k[1, 1] += np.diag(si)
            bias = bias + ti
        out.append({"kernel": jnp.asarray(k, jnp.float32), "bias": jnp.asarray(bias, jnp.float32)})
    return out


def _affine(bn) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(bn["scale"], np.float64) / np.sqrt(np.asarray(bn["var"], np.float64) + EPS)
    return s, np.asarray(bn["bias"], np.float64) - np.asarray(bn["mean"], np.float64) * s


def repvgg_deploy_apply(params: list, x: jax.Array) -> jax.Array:
    """The deploy form: one 3×3 conv + bias + ReLU per block (:func:`repvgg_deploy`)."""
    for blk in params:
        x = jax.nn.relu(_conv(x, blk["kernel"]) + blk["bias"])
    return x


# ------------------------------------------------------------------ a Llama-style decoder


def init_decoder(layers: int = 2, *, d: int = 64, ffn: int | None = None, vocab: int = 256,
                 seed: int = 0, dtype=jnp.float32) -> dict:
    """Parameters of a Llama-style decoder (:func:`decoder_apply`): an embedding,
    ``layers`` pre-norm blocks (RMSNorm → q, k, v, o; RMSNorm → gate, up, down), a final
    RMSNorm and an untied head. Norm scales are trained-looking (γ ≠ 1). With ``d=2048,
    ffn=5632, layers=8, vocab=32000`` it has 0.54 B parameters. Made from a NumPy seed, one
    leaf at a time (no float64 model-sized temporaries)."""
    ffn = ffn or 4 * d
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray((rng.standard_normal(shape, np.float32) /
                            np.float32(np.sqrt(shape[0]))).astype(dtype))

    def gamma():
        return jnp.asarray((1 + 0.2 * rng.standard_normal(d, np.float32)).astype(dtype))

    return {"embed": w(vocab, d),
            "layers": [{"attn_norm": gamma(), "q": w(d, d), "k": w(d, d), "v": w(d, d),
                        "o": w(d, d), "mlp_norm": gamma(), "gate": w(d, ffn),
                        "up": w(d, ffn), "down": w(ffn, d)} for _ in range(layers)],
            "final_norm": gamma(), "head": w(d, vocab)}


def _rms_norm(x, g):
    x32 = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
    return (x32 * r).astype(x.dtype) * g


def decoder_apply(params: dict, tokens: jax.Array, *, head_dim: int = 64) -> jax.Array:
    """Next-token logits of the decoder for ``tokens`` (batch, length): causal attention
    with heads of ``head_dim`` features (one head when the model is narrower)."""
    x = params["embed"][tokens]
    b, t, d = x.shape
    heads = max(1, d // head_dim)
    mask = jnp.tril(jnp.ones((t, t), bool))
    for lp in params["layers"]:
        h = _rms_norm(x, lp["attn_norm"])
        q, k, v = (jnp.reshape(h @ lp[n], (b, t, heads, d // heads)) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads).astype(np.float32)
        a = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
        x = x + jnp.reshape(jnp.einsum("bhqk,bkhd->bqhd", a, v), (b, t, d)) @ lp["o"]
        h = _rms_norm(x, lp["mlp_norm"])
        x = x + (jax.nn.silu(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]
    return _rms_norm(x, params["final_norm"]) @ params["head"]


def stack_decoder(params: dict, *, head_dim: int = 64) -> dict:
    """:func:`init_decoder`'s parameters laid out as a MaxText-style scanned stack: each
    layer leaf stacked on a leading axis, q/k/v kernels ``(d, heads, head_dim)`` (Flax
    ``DenseGeneral``), o ``(heads, head_dim, d)`` — for :func:`scanned_decoder_apply`."""
    layers = params["layers"]
    d = layers[0]["q"].shape[0]
    heads = max(1, d // head_dim)
    split = {"q": (d, heads, d // heads), "k": (d, heads, d // heads),
             "v": (d, heads, d // heads), "o": (heads, d // heads, d)}
    stacked = {n: jnp.stack([jnp.reshape(lp[n], split.get(n, lp[n].shape)) for lp in layers])
               for n in layers[0]}
    return {**params, "layers": stacked}


def scanned_decoder_apply(params: dict, tokens: jax.Array) -> jax.Array:
    """:func:`decoder_apply` as large JAX models write it: one ``lax.scan`` over the stacked
    layers of :func:`stack_decoder` (``nn.scan``, MaxText), multi-head projections as
    einsums over ``(d, heads, head_dim)`` kernels. The same outputs as ``decoder_apply``."""
    x = params["embed"][tokens]
    t = x.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))

    def layer(x, lp):
        h = _rms_norm(x, lp["attn_norm"])
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, lp[n]) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
        a = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
        x = x + jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqk,bkhd->bqhd", a, v), lp["o"])
        h = _rms_norm(x, lp["mlp_norm"])
        return x + (jax.nn.silu(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"], None

    x, _ = lax.scan(layer, x, params["layers"])
    return _rms_norm(x, params["final_norm"]) @ params["head"]
