"""Real libraries nobody here wrote, folded as their users would (issue 69): small configs,
random init perturbed (so no γ = 1, β = 0, layer scale 1e-6 hides a wrong fold), every entry
point — ``fold_params`` (written back), ``fold`` (the decorator) and ``fold_stablehlo`` on the
``jax.export`` — counted against what the model code allows and compared with the unfolded
program. The slow tier only: ``.ci/run`` installs the pinned libraries
(``requirements-slow*.txt``) for it; the default suite never imports them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold

pytestmark = pytest.mark.slow
TOL = 2e-5


def _perturb(tree, seed=1, scale=0.2):
    rng = np.random.default_rng(seed)

    def one(leaf):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return (leaf.astype(jnp.float32) +
                    jnp.asarray(scale * rng.standard_normal(leaf.shape), jnp.float32))
        return leaf
    return jax.tree_util.tree_map(one, tree)


def _err(a, b):
    return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))


def _check(f, params, args, written, *, stablehlo=None, tol=TOL):
    """``fold_params`` writes ``written`` sites, ``fold(f)`` folds them (at least), and the
    export folds ``stablehlo`` of them (default: ``written``); every output as the model's."""
    ref = f(params, *args)
    out = hlofold.fold_params(f, params, *args)
    assert len(out.changes) == written, str(out)
    assert _err(f(out.params, *args), ref) < tol * max(1.0, float(jnp.max(jnp.abs(ref))))
    ff = hlofold.fold(f, fold_costly=True)
    assert ff.report(params, *args).num_folded >= written, str(ff.report(params, *args))
    assert _err(ff(params, *args), ref) < tol * max(1.0, float(jnp.max(jnp.abs(ref))))
    leaves = jax.tree.leaves(params)
    exp = jax.export.export(jax.jit(lambda p, *a: f(jax.tree.unflatten(
        jax.tree.structure(params), p), *a)))(leaves, *args)
    new, rep, prep = hlofold.fold_stablehlo(exp, params={f"arg{i}": v
                                                         for i, v in enumerate(leaves)})
    assert rep.num_folded >= (written if stablehlo is None else stablehlo), str(rep)
    assert _err(new.call(*args, *prep), ref) < tol * max(1.0, float(jnp.max(jnp.abs(ref))))
    return out


# ------------------------------------------------------------------- CNNs with BatchNorm


def test_flaxmodels_resnet18():
    """20 BatchNorms (stem 1, 8 blocks × 2, 3 projection shortcuts): all written; the global
    mean's 1/HW, folded into the head in the program, is not a parameter to write."""
    fm = pytest.importorskip("flaxmodels")
    m = fm.ResNet18(output="logits", pretrained=None, normalize=False, num_classes=10)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64, 64, 3)), jnp.float32)
    v = _perturb(m.init(jax.random.PRNGKey(0), x, train=False))
    out = _check(lambda v, x: m.apply(v, x, train=False), v, (x,), 20)
    left = [s for s in out.report.sites if s.status == "refused"]
    assert all("div's operand" in s.reason for s in left), str(out.report)


@pytest.mark.parametrize("kind,written", [("resnet", 12), ("regnet", 17)])
def test_transformers_flax_cnns(kind, written):
    """transformers' Flax ResNet (basic blocks, 4 stages of 1: 1 + 4 × 2 + 3 shortcuts = 12
    BatchNorms) and RegNet (Y blocks: 1 + 4 × 3 + 4 shortcuts = 17; the SE means' 1/HW is no
    parameter)."""
    tr = pytest.importorskip("transformers")
    sizes = dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
    if kind == "resnet":
        m = tr.FlaxResNetModel(tr.ResNetConfig(layer_type="basic", **sizes),
                               input_shape=(1, 64, 64, 3), seed=0)
    else:
        m = tr.FlaxRegNetModel(tr.RegNetConfig(groups_width=8, **sizes),
                               input_shape=(1, 64, 64, 3), seed=0)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 64, 64)), jnp.float32)
    _check(lambda p, x: m(x, params=p, train=False).pooler_output, _perturb(m.params), (x,),
           written)


# ------------------------------------------------------------------ norms before layers


def test_equimo_convnext():
    """equimo's ConvNeXt (depths 2·2·2·2): 8 block LayerNorm2d → pwconv1 and 3 downsampler
    LayerNorm2d → strided conv forward (11), the final LayerNorm → the head (1), the 8 layer
    scales after pwconv2 backward (8): 20. Left, with true reasons: the stem's LayerNorm2d (read
    by block 0's depthwise conv *and* its residual) and the 5 layer scales whose block output
    is read by the next depthwise conv and the next residual."""
    pytest.importorskip("equimo")
    import equinox as eqx
    from equimo.vision.models.convnext import ConvNeXt
    m = _perturb(ConvNeXt(depths=[2, 2, 2, 2], dims=[16, 32, 48, 64], num_classes=10,
                          key=jax.random.PRNGKey(0)), scale=0.3)
    p, static = eqx.partition(m, eqx.is_array)      # (its eps: Python floats, static)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 32, 32)), jnp.float32)
    out = _check(lambda p, x: eqx.combine(p, static)(x, key=None, inference=True), p, (x,),
                 20)
    kinds = sorted(s.pattern for s in out.report.sites if s.status == "folded")
    assert kinds.count("affine_conv") == 11 and kinds.count("affine_dot") == 1, kinds
    refused = [s.reason for s in out.report.sites if s.status == "refused"]
    assert len(refused) == 5 and all("2 consumers" in r for r in refused), refused
    (left,) = [s for s in out.report.sites if s.status == "not-reached"]
    assert "is read by 2 ops" in left.reason, left.reason


def _gemma(num_kv_heads):
    pytest.importorskip("gemma")
    from gemma.gm.nn import _config, _modules, _transformer
    cfg = _config.TransformerConfig(
        num_embed=64, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
        num_kv_heads=num_kv_heads, final_logit_softcap=None, use_post_attn_norm=False,
        use_post_ffw_norm=False, attention_types=[_modules.AttentionType.GLOBAL] * 2)
    m = _transformer.Transformer(config=cfg)
    tok = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 6)), jnp.int32)
    v = _perturb(m.init(jax.random.PRNGKey(0), tok))
    return (lambda v, tok: m.apply(v, tok).logits), v, tok


@pytest.mark.parametrize("kv", [4, 2], ids=["mha-qkv-einsum", "gqa-kv-einsum"])
def test_gemma(kv):
    """DeepMind's gemma: γ applied as ``x·(1 + scale)``, q/k/v as one einsum
    ``'BTD,SNDH->SBTNH'`` (output axes reordered) or q + the grouped ``kv_einsum``. The 4
    block norms (pre-attention, pre-ffw × 2 layers) are written; the final norm is not (the
    head is the tied embedding, also read by the token gather); ``smooth=`` pairs the same 4."""
    f, v, tok = _gemma(kv)
    out = _check(f, v, (tok,), 4 if kv == 4 else 6, stablehlo=4)
    (left,) = [s for s in out.report.sites if s.status == "refused"]
    assert "also read by gather" in left.reason, left.reason
    sm = hlofold.fold_params(f, v, tok, smooth=[(tok,)])
    assert sorted(e.first.split("']['")[-2] for e in sm.smoothed) == \
        ["pre_attention_norm", "pre_attention_norm", "pre_ffw_norm", "pre_ffw_norm"], str(sm)
    assert _err(f(sm.params, tok), f(v, tok)) < 1e-4
