"""keras_hub's own models through hlofold (issue 39 items 2 and 4), when keras_hub is installed.

keras_hub is not a dependency of the suite (it requires TensorFlow Text; ``pip install
--no-deps keras-hub`` plus ``tokenizers sentencepiece regex rich absl-py kagglehub`` is
enough to build its backbones on the JAX backend). The suite tests the forms these models
are made of with Keras and Flax layers; this script runs the models themselves, with random
weights (nothing is downloaded) and small configurations: the decoders Llama, Mistral,
Gemma and Qwen (RMSNorm → EinsumDense q/k/v with (d, heads, head_dim) kernels), and the
vision backbones EfficientNet (BatchNorm after DepthwiseConv2D/Conv2D) and ViT (LayerNorm →
EinsumDense q/k/v with biases).

For each model, on both paths:

* ``fold(f, fold_costly=True)``: the report's counts, outputs vs ``jax.jit(f)``; the same
  with the weights frozen (``freeze=0``: constants of the traced program);
* ``fold_params``: how many norm (scale) leaves it sets to identity, outputs of the unchanged
  model with the folded weights;
* ``fold_stablehlo(params=)`` of ``jax.export`` of the same function with the weights as
  arguments: counts (the same sites, the same statuses), outputs.

``python -m benchmarks.keras_hub_models`` writes ``docs/benchmarks/keras_hub_cpu.{md,json}``.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hlofold  # noqa: E402

from .common import code_info, machine_info, machine_line  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, os.pardir, "docs", "benchmarks")
DECODERS = ("llama", "mistral", "gemma", "qwen")
VISION = ("efficientnet", "vit")


def build(name: str):
    """``(backbone, inputs)`` with random, trained-looking weights (norm scales ≠ 1)."""
    import keras_hub
    common = dict(vocabulary_size=64, num_layers=2, hidden_dim=32, intermediate_dim=64)
    m = keras_hub.models
    if name == "llama":
        bb = m.LlamaBackbone(num_query_heads=4, num_key_value_heads=2, **common)
    elif name == "mistral":
        bb = m.MistralBackbone(num_query_heads=4, num_key_value_heads=2, **common)
    elif name == "gemma":
        bb = m.GemmaBackbone(num_query_heads=4, num_key_value_heads=1, head_dim=8, **common)
    elif name == "qwen":
        bb = m.QwenBackbone(num_query_heads=4, num_key_value_heads=2, **common)
    elif name == "vit":
        bb = m.ViTBackbone(image_shape=(32, 32, 3), patch_size=8, num_layers=2, num_heads=4,
                           hidden_dim=32, mlp_dim=64)
    elif name == "efficientnet":
        bb = _efficientnet(m)
    else:
        raise KeyError(name)
    rng = np.random.default_rng(0)
    for w in bb.weights:
        path = w.path.lower()
        if len(w.shape) == 1 and ("norm" in path or path.endswith((
                "gamma", "beta", "moving_mean", "moving_variance"))):
            if "gamma" in path or "scale" in path:
                w.assign((1.0 + 0.3 * rng.standard_normal(w.shape)).astype("float32"))
            elif "beta" in path or "bias" in path or "mean" in path:
                w.assign((0.2 * rng.standard_normal(w.shape)).astype("float32"))
            elif "variance" in path:
                w.assign((0.5 + rng.random(w.shape)).astype("float32"))
    if name in DECODERS:
        x = {"token_ids": jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32),
             "padding_mask": jnp.ones((2, 8), jnp.int32)}
    else:
        x = jnp.asarray(rng.standard_normal((2, 32, 32, 3)), jnp.float32)
    return bb, x


def _efficientnet(m):
    return m.EfficientNetBackbone(
        width_coefficient=0.25, depth_coefficient=0.25, stackwise_kernel_sizes=[3, 3],
        stackwise_num_repeats=[1, 1], stackwise_input_filters=[32, 16],
        stackwise_output_filters=[16, 24], stackwise_expansion_ratios=[1, 6],
        stackwise_strides=[1, 2], stackwise_block_types=["v1", "v1"],
        stackwise_squeeze_and_excite_ratios=[0.25, 0.25], include_stem_padding=True,
        input_shape=(32, 32, 3))


def norm_leaves(bb) -> int:
    return sum(1 for w in bb.weights if w.path.lower().endswith(("gamma", "scale")))


def run(name: str) -> dict:
    bb, x = build(name)
    tv = [v.value for v in bb.trainable_variables]
    ntv = [v.value for v in bb.non_trainable_variables]

    def apply(params, x):
        y, _ = bb.stateless_call(params[0], params[1], x)
        return y
    params = (tv, ntv)
    ref = jax.jit(apply)(params, x)
    scale = float(jnp.max(jnp.abs(ref)))
    out = {"model": name, "norm_scale_leaves": norm_leaves(bb)}
    f = hlofold.fold(apply, fold_costly=True)
    got = f(params, x)
    rep = f.report(params, x)
    out["fold"] = {"counts": rep.counts(), "rel_err": float(jnp.max(jnp.abs(got - ref))) / scale}
    fz = hlofold.fold(apply, fold_costly=True, freeze=0)     # the weights as constants
    got_z = fz(params, x)
    out["freeze"] = {"counts": fz.report(params, x).counts(),
                     "rel_err": float(jnp.max(jnp.abs(got_z - ref))) / scale}
    res = hlofold.fold_params(apply, params, x)
    after = jax.jit(apply)(res.params, x)
    identities = len({n for c in res.changes for n in c.identity})
    out["fold_params"] = {"changes": len(res.changes), "identities": identities,
                          "counts": res.report.counts(),
                          "rel_err": float(jnp.max(jnp.abs(after - ref))) / scale}
    # StableHLO: the weights as arguments, as an exporter leaves them
    flat, tree = jax.tree.flatten(params)
    exp = jax.export.export(jax.jit(lambda ws, x: apply(tree.unflatten(ws), x),
                                    keep_unused=True))(flat, x)
    text = exp.mlir_module()
    n_x = len(jax.tree.leaves(x))
    ws = {f"arg{i}": np.asarray(w) for i, w in enumerate(flat)}
    folded, srep, prepared = hlofold.fold_stablehlo(text, params=ws)
    from hlofold._ir.stablehlo.artifacts import module_callable
    got_s = module_callable(folded)(*jax.tree.leaves(x), *prepared)
    got_s = got_s[0] if isinstance(got_s, (list, tuple)) else got_s
    out["stablehlo"] = {"counts": srep.counts(),
                        "rel_err": float(jnp.max(jnp.abs(got_s - ref))) / scale,
                        "inputs": n_x}
    out["same_counts"] = rep.counts() == srep.counts() == out["freeze"]["counts"]
    return out


def markdown(res: dict) -> str:
    lines = [f"# keras_hub models through hlofold ({res['when']})", "",
             machine_line(res["machine"]), f"keras_hub {res.get('keras_hub')}", "",
             "Random weights, small configurations (2 layers). Counts: the report's statuses; "
             "errors: max |Δ| relative to max |output| against `jax.jit` of the model.", "",
             "| model | norm γ leaves | fold: counts | rel err | `freeze=`: counts | rel err "
             "| fold_params: sites written (leaves set to identity) | rel err "
             "| StableHLO (params=): counts | rel err | same counts |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items()))   # noqa: E731
    for r in res["models"]:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} |||||||||")
            continue
        lines.append(f"| {r['model']} | {r['norm_scale_leaves']} | {fmt(r['fold']['counts'])} | "
                     f"{r['fold']['rel_err']:.1e} | {fmt(r['freeze']['counts'])} | "
                     f"{r['freeze']['rel_err']:.1e} | {r['fold_params']['changes']} "
                     f"({r['fold_params']['identities']}) | "
                     f"{r['fold_params']['rel_err']:.1e} | {fmt(r['stablehlo']['counts'])} | "
                     f"{r['stablehlo']['rel_err']:.1e} | {r['same_counts']} |")
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """What the rows say:

* **Decoders** (Llama, Mistral, Gemma, Qwen): each layer's two RMSNorms fold forward into
  the projections that read them (q/k/v as `EinsumDense` with (d, heads, head_dim) kernels;
  gate/up), on both paths, and `fold_params` writes them (4 norm leaves set to identity of
  5: the final norm is the model's output, reached by no projection: `not-reached`).
* **`refused`** sites are ones where an affine op *was* there: the attention scores' scale
  (its kernel is an activation).
* **Qwen, ViT**: the q/k/v biases over (heads, head_dim) are `canonical` (the projection's
  output features are one block of axes); ViT's LayerNorms fold forward, γ and β, into q/k/v
  (β·W joins their bias) and into the MLP; `fold_params` writes them where the layer has a
  bias. The patch embedding is `canonical`.
* **EfficientNet**: every BatchNorm folds; the squeeze-and-excite convolutions are conv +
  bias (`canonical`). (Before this run the StableHLO path counted two of them `folded`: JAX
  lowers `sigmoid` to `negate, exponential, …`, and folding a lone negation into the kernel
  was counted a fold; a negation no longer counts, on either path.)"""


def main(argv=None) -> dict:
    chosen = argv if argv is not None else sys.argv[1:]
    names = chosen or list(DECODERS + VISION)
    try:
        import keras_hub
    except ImportError:
        print("keras_hub is not installed: pip install --no-deps keras-hub tokenizers "
              "sentencepiece regex rich absl-py kagglehub")
        return {}
    import datetime
    res = {"when": datetime.date.today().isoformat(), "machine": machine_info(),
           "code": code_info(), "keras_hub": keras_hub.__version__, "models": []}
    for n in names:
        try:
            r = run(n)
        except Exception as e:      # noqa: BLE001 — one model's failure is a row, not a crash
            r = {"model": n, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        res["models"].append(r)
        print(json.dumps(r), flush=True)
    if not chosen:                  # the full run is the record
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "keras_hub_cpu.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(OUT, "keras_hub_cpu.md"), "w") as f:
            f.write(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
