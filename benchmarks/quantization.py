"""What folding does to int8 weight quantization (issue 12, item 3).

Per-output-channel symmetric int8 quantization of every conv/Dense kernel (``scale =
max|W|/127`` per output channel, round to nearest), once on the model's own weights (the
normalizations stay in float) and once on the weights :func:`hlofold.fold_params` wrote
back. Error of each against the float model, ``‖y_q − y‖ / ‖y‖`` on random inputs, median
and range over seeds.

* BN CNN: Flax ResNet-18 (``benchmarks/models.py``, realistic BN statistics), 32 px.
* Transformer block: Flax linen pre-norm block (``tests/helpers/blocks.py``), LayerNorm and
  RMSNorm, with γ drawn log-normal with spread σ_γ (real LLM norms have outlier channels).

Run: ``python -m benchmarks.quantization [--seeds 5] [--qwix] [--out FILE]`` (``--qwix``:
Qwix's post-training quantization, int8 weights and activations, in place of the weight
quantizer).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import hlofold


def quantize(tree, per_tensor: bool = False):
    """Every ``kernel`` leaf quantized per output channel (Flax: the last axis), or with one
    scale for the whole kernel (``per_tensor``)."""
    def q(path, w):
        if "kernel" not in jax.tree_util.keystr(path) or w.ndim < 2:
            return w
        w = np.asarray(w, np.float64)
        axes = None if per_tensor else tuple(range(w.ndim - 1))
        scale = np.max(np.abs(w), axis=axes, keepdims=True) / 127
        scale = np.where(scale == 0, 1, scale)
        return jnp.asarray(np.clip(np.round(w / scale), -127, 127) * scale, jnp.float32)
    return jax.tree_util.tree_map_with_path(q, tree)


def rel_err(ref, out) -> float:
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def measure(f, params, x):
    """(error unfolded-quantized, error folded-quantized, folds written back)."""
    ref = f(params, x)
    folded = hlofold.fold_params(f, params, x)
    return (rel_err(ref, f(quantize(params), x)),
            rel_err(ref, f(quantize(folded.params), x)), len(folded.changes))


def qwix_ptq(f, x, weights=jnp.int8, acts=jnp.int8):
    """Qwix's post-training quantization of the Flax linen model behind ``f`` (its bound
    ``apply``): int8 weights and int8 activations (w8a8, Qwix's rule for every module;
    ``weights``/``acts`` other types, ``acts`` None: weights only); returns ``variables ->
    outputs`` of the quantized model, the weights quantized by ``qwix.quantize_params``."""
    import qwix
    rules = [qwix.QtRule(module_path=".*", weight_qtype=weights, act_qtype=acts)]
    ptq = qwix.quantize_model(f.__self__, qwix.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]

    def run(variables):
        q = qwix.quantize_params(variables["params"], abstract)
        return ptq.apply({**variables, "params": q}, x)
    return run


def measure_qwix(f, params, x):
    """:func:`measure` with Qwix's w8a8 PTQ in place of the per-channel weight quantizer."""
    ref = f(params, x)
    folded = hlofold.fold_params(f, params, x)
    run = qwix_ptq(f, x)
    return rel_err(ref, run(params)), rel_err(ref, run(folded.params)), len(folded.changes)


def cnn_case(seed):
    from benchmarks import models
    model, _, variables, _ = models.build("resnet18", image_size=32, num_classes=10,
                                          width=16, seed=seed)
    x = jax.random.normal(jax.random.key(100 + seed), (4, 32, 32, 3))
    return model.apply, variables, x


def block_case(kind, spread, seed):
    import flax.linen as nn

    from tests.helpers.blocks import X, flax_linen_block
    f, v = flax_linen_block(getattr(nn, kind))
    rng = np.random.default_rng(seed)

    def norm(path, a):
        p = jax.tree_util.keystr(path)
        if "Norm" in p and p.endswith("['scale']"):
            return jnp.asarray(np.exp(spread * rng.standard_normal(a.shape)), a.dtype)
        if "Norm" in p and p.endswith("['bias']"):
            return jnp.zeros_like(a)       # no β: every projection folds (K has no bias)
        return a
    v = jax.tree_util.tree_map_with_path(norm, v)
    x = jnp.asarray(rng.standard_normal((8,) + X.shape[1:]), jnp.float32)
    return f, v, x


# ----------------------------------------------------- cross-layer equalization (issue 51)

def spread_gamma(variables, where: str, seed: int):
    """γ of the BNs whose path has ``where`` spread over two decades, ``10^U(−1, 1)``, as a
    trained MobileNet's depthwise BNs have (Nagel et al. 2019, fig. 2)."""
    rng = np.random.default_rng(1000 + seed)

    def f(path, a):
        p = jax.tree_util.keystr(path)
        if where in p and "['bn" in p and p.endswith("['scale']"):
            return jnp.asarray(10 ** rng.uniform(-1, 1, a.shape), a.dtype)
        return a
    return jax.tree_util.tree_map_with_path(f, variables)


def equalize_case(name: str, seed: int):
    import flax.linen as nn

    from benchmarks import models
    if name == "mobilenetv2":
        model = models.MobileNetV2(num_classes=10, width_mult=0.5, act=nn.relu)
        where = "_dw"
    else:
        model = models.resnet18(num_classes=10, width=16)
        where = "bn"
    v = spread_gamma(models.init(model, 32, seed=seed), where, seed)
    x = jax.random.normal(jax.random.key(200 + seed), (8, 32, 32, 3))
    return model.apply, v, x


def measure_equalize(f, params, x, qwix_run=None):
    """Errors of int8 weights: per tensor (unfolded, folded, folded + equalized), per channel
    (folded); the pairs equalized."""
    ref = f(params, x)
    folded = hlofold.fold_params(f, params, x)
    eq = hlofold.fold_params(f, params, x, equalize=True)
    if qwix_run is not None:
        return ([rel_err(ref, qwix_run(t)) for t in (params, folded.params, eq.params)] +
                [rel_err(ref, f(quantize(folded.params), x)), len(eq.equalized)])
    return ([rel_err(ref, f(quantize(t, per_tensor=True), x))
             for t in (params, folded.params, eq.params)] +
            [rel_err(ref, f(quantize(folded.params), x)), len(eq.equalized)])


def qwix_weights_per_tensor(f, x):
    """Qwix's PTQ with int8 weights with one scale per tensor (``disable_channelwise_axes``)
    and int8 activations (Qwix quantizes a convolution's weights only with its
    activations): ``variables -> outputs``."""
    import qwix
    rules = [qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8,
                         disable_channelwise_axes=True)]
    ptq = qwix.quantize_model(f.__self__, qwix.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]

    def run(variables):
        return ptq.apply({**variables, "params": qwix.quantize_params(variables["params"],
                                                                      abstract)}, x)
    return run


def equalize_table(seeds, use_qwix: bool) -> list[str]:
    what = "Qwix w8a8, weights per tensor" if use_qwix else "int8 weights per tensor"
    lines = [f"| model | {what}: unfolded | folded | folded + `equalize=True` | "
             "per channel, folded (plain quantizer) | equalized / folded | equalized / per "
             "channel (each seed's; median, range) | pairs and streams |",
             "|---|---|---|---|---|---|---|---|"]
    for name, label in (("mobilenetv2", "MobileNetV2-style (ReLU), width 0.5, 32 px, "
                                        "depthwise γ over two decades"),
                        ("resnet18", "ResNet-18, width 16, 32 px, γ over two decades")):
        rows = []
        for s in seeds:
            f, v, x = equalize_case(name, s)
            rows.append(measure_equalize(f, v, x, qwix_weights_per_tensor(f, x)
                                         if use_qwix else None))
        a = np.asarray(rows)
        med, lo, hi = np.median(a, 0), a.min(0), a.max(0)
        cell = lambda k: f"{med[k]:.3g} ({lo[k]:.3g}–{hi[k]:.3g})"   # noqa: E731
        r = a[:, 2] / a[:, 3]
        lines.append(f"| {label} | {cell(0)} | {cell(1)} | {cell(2)} | {cell(3)} | "
                     f"{med[2] / med[1]:.2f}× | {np.median(r):.2f}× ({r.min():.2f}–"
                     f"{r.max():.2f}) | {int(med[4])} |")
    return lines


# ------------------------------------------------------------ smoothing (issue 51, item 2)

def fake_quant(x, bits: int, axes=None):
    """Symmetric round-to-nearest with ``bits`` bits, one scale over ``axes`` (None: the
    whole tensor)."""
    q = 2 ** (bits - 1) - 1
    s = jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None) / q
    s = jnp.where(s == 0, 1, s)
    return jnp.clip(jnp.round(x / s), -q, q) * s


def wxa8(f, params, *args, wbits: int = 8, abits: int = 8):
    """``f(params, *args)`` with every dot/conv whose kernel is a parameter leaf run on
    quantized operands: weights per output channel (``wbits``), activations per tensor
    (``abits``, the scale from this call's values) — the plain w8a8 / w4a8 quantizer."""
    from hlofold import _compat as C
    leaves, tree = jax.tree.flatten(params)
    closed = jax.make_jaxpr(lambda ls, *a: f(tree.unflatten(ls), *a))(leaves, *args)
    jaxpr = closed.jaxpr
    kernels = set(jaxpr.invars[:len(leaves)])
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, [*leaves, *jax.tree.leaves(args)]))
    read = lambda v: v.val if isinstance(v, C.Literal) else env[v]     # noqa: E731
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        name = e.primitive.name
        if name in ("dot_general", "conv_general_dilated") and e.invars[1] in kernels:
            if name == "dot_general":
                contracted = tuple(e.params["dimension_numbers"][0][1])
            else:
                rhs = e.params["dimension_numbers"].rhs_spec
                contracted = tuple(d for d in range(ins[1].ndim) if d != rhs[0])
            ins = [fake_quant(ins[0], abits), fake_quant(ins[1], wbits, contracted)]
        outs = C.bind_eqn(e, ins)
        env.update(zip(e.outvars, outs))
    return [read(v) for v in jaxpr.outvars][0]


def smooth_case(name: str, seed: int, outliers: float = 30.0, block_seed: int | None = None):
    """A pre-norm decoder whose residual stream carries a few massive channels (as real
    LLMs do): the built-in decoder (d = 128, 2 layers), the Flax linen decoders (RMSNorm,
    LayerNorm: ``benchmarks/quant_decoders.py``), keras_hub's Llama or the Flax block (its
    parameters from ``block_seed``'s generator where given, else from the tests' shared one:
    then they depend on the calls before, as in one benchmark run)."""
    rng = np.random.default_rng(300 + seed)
    if name == "keras_llama":
        from benchmarks.quant_decoders import keras_llama
        return keras_llama(rng, seed, outliers)
    if name in ("flax_rms", "flax_ln"):
        from benchmarks.quant_decoders import flax_decoder
        return flax_decoder("RMSNorm" if name == "flax_rms" else "LayerNorm", seed, outliers)
    if name == "decoder":
        from hlofold import examples
        p = examples.init_decoder(2, d=128, vocab=256, seed=seed)
        massive = rng.choice(128, 3, replace=False)
        e = np.array(p["embed"])
        e[:, massive] *= outliers
        p["embed"] = jnp.asarray(e)
        f = examples.decoder_apply

        def inputs(k):
            return (jnp.asarray(np.random.default_rng(k).integers(0, 256, (4, 16))),)
    else:
        import flax.linen as nn

        from tests.helpers.blocks import X, flax_linen_block
        f, p = flax_linen_block(getattr(nn, name), block_seed)
        massive = rng.choice(X.shape[-1], 3, replace=False)

        def inputs(k):
            x = np.random.default_rng(k).standard_normal((8,) + X.shape[1:]).astype(np.float32)
            x[..., massive] *= outliers
            return (jnp.asarray(x),)
    return f, p, inputs(seed), [inputs(1000 + 10 * seed + j) for j in range(4)]


def measure_smooth(f, params, x, calib, wbits: int, run=None, draws: int = 0):
    """Errors: original, folded, + smooth, + rotate, + rotate and smooth (nan where the
    stream is not rotated); pairs smoothed. ``run``: a quantized model (Qwix) in place of
    the plain quantizer. ``draws``: the last three each the median over that many draws
    (smoothing's scales times exact random factors; rotation's ``seed``)."""
    ref = f(params, *x)
    run = run or (lambda t: wxa8(f, t, *x, wbits=wbits))
    folded = hlofold.fold_params(f, params, *x)
    rows = []
    for d in range(max(draws, 1)):
        undo = lambda: None       # noqa: E731
        if draws:
            from benchmarks.quantization_full import with_smoothing_draws
            undo = with_smoothing_draws(np.random.default_rng(d))
        try:
            sm = hlofold.fold_params(f, params, *x, smooth=calib)
            both = hlofold.fold_params(f, params, *x, rotate=True, smooth=calib, seed=d)
        finally:
            undo()
        rot = hlofold.fold_params(f, params, *x, rotate=True, seed=d)
        ok = rot.rotation.reason is None
        rows.append([rel_err(ref, run(sm.params))] +
                    [rel_err(ref, run(t.params)) if ok else float("nan") for t in (rot, both)])
    return [rel_err(ref, run(params)), rel_err(ref, run(folded.params)),
            *np.median(np.asarray(rows), 0), len(sm.smoothed)]


SMOOTH_CASES = (("decoder", "built-in decoder, d = 128, 2 layers, 3 massive residual "
                             "channels ×30"),
                ("flax_rms", "Flax linen decoder, RMSNorm (Llama-style), d = 128, 2 layers, "
                             "3 massive residual channels ×30"),
                ("flax_ln", "Flax linen decoder, LayerNorm (GPT-2-style), d = 128, 2 layers, "
                            "3 massive residual channels ×30"),
                ("RMSNorm", "Flax block, RMSNorm, 3 massive channels ×30"),
                ("LayerNorm", "Flax block, LayerNorm, 3 massive channels ×30"),
                ("keras_llama", "keras_hub LlamaBackbone, d = 128, 2 layers, GQA, 3 massive "
                                "channels ×30 (its output: the final norm's, no head)"))


def smooth_table(seeds, use_qwix: bool = False, only=None, draws: int = 0) -> list[str]:
    lines = ["| model | quantizer | original | folded | + `smooth=` (α = 0.5) | "
             "+ `rotate=True` | + rotate and smooth | best / original | best / folded | "
             "pairs smoothed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in SMOOTH_CASES:
        if (only and name not in only) or (use_qwix and name in ("decoder", "keras_llama")):
            continue                    # (Qwix quantizes Flax modules, not plain functions)
        if name == "keras_llama" and importlib.util.find_spec("keras_hub") is None:
            continue                    # (not a dependency: benchmarks/keras_hub_models.py)
        for wbits in ((8,) if use_qwix else (8, 4)):
            rows = []
            for s in seeds:
                f, p, x, calib = smooth_case(name, s)
                rows.append(measure_smooth(f, p, x, calib, wbits,
                                           qwix_w8a8_run(f, x) if use_qwix else None, draws))
            a = np.asarray(rows)
            med, lo, hi = np.median(a, 0), a.min(0), a.max(0)
            cell = lambda k: ("–" if np.isnan(med[k]) else    # noqa: E731
                              f"{med[k]:.3g} ({lo[k]:.3g}–{hi[k]:.3g})")
            best = np.nanmin(med[2:5])
            q = "Qwix w8a8" if use_qwix else f"w{wbits}a8"
            lines.append(f"| {label} | {q} | {cell(0)} | {cell(1)} | {cell(2)} | {cell(3)} | "
                         f"{cell(4)} | {best / med[0]:.2f}× | {best / med[1]:.2f}× | "
                         f"{int(med[5])} |")
    return lines


def qwix_w8a8_run(f, x):
    """Qwix's w8a8 PTQ of the Flax model behind ``f``: ``variables -> outputs``."""
    run = qwix_ptq(f, x[0])
    return run


def summarize(rows):
    a = np.asarray(rows)
    med, lo, hi = np.median(a, 0), a.min(0), a.max(0)
    return (f"{med[0]:.2e} ({lo[0]:.2e}–{hi[0]:.2e}) | {med[1]:.2e} ({lo[1]:.2e}–{hi[1]:.2e})"
            f" | {med[1] / med[0]:.2f}× | {int(med[2])}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--qwix", action="store_true",
                    help="quantize with Qwix's PTQ (w8a8) instead of the weight quantizer")
    ap.add_argument("--equalize", action="store_true",
                    help="cross-layer equalization: per-tensor int8 weights of BN CNNs")
    ap.add_argument("--smooth", action="store_true",
                    help="smoothing: w8a8 / w4a8 of decoders with massive channels")
    ap.add_argument("--draws", type=int, default=0, help="with --smooth: smoothing and "
                    "rotation each the median over this many rounding draws per seed")
    ap.add_argument("--only", nargs="*", help="with --smooth: these cases only "
                    f"({', '.join(n for n, _ in SMOOTH_CASES)})")
    a = ap.parse_args(argv)
    if a.smooth:
        text = (f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} "
                f"CPUs, jax {jax.__version__}, {a.seeds} seeds (median, range)"
                f"{f', {a.draws} draws each' if a.draws else ''}; error "
                f"‖y_q − y‖/‖y‖ of the outputs.\n\n" +
                "\n".join(smooth_table(range(a.seeds), a.qwix, a.only, a.draws)) + "\n")
        print(text)
        if a.out:
            with open(a.out, "w") as fh:
                fh.write(text)
        return
    if a.equalize:
        head = (f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} "
                f"CPUs, jax {jax.__version__}, {a.seeds} seeds (median, range); error "
                f"‖y_q − y‖/‖y‖ of the logits.\n\n")
        text = head + "\n".join(equalize_table(range(a.seeds), a.qwix)) + "\n"
        print(text)
        if a.out:
            with open(a.out, "w") as fh:
                fh.write(text)
        return
    seeds = range(a.seeds)
    how = measure_qwix if a.qwix else measure
    what = "Qwix w8a8 error" if a.qwix else "int8 error"
    lines = [f"| model | {what}, unfolded weights | {what}, folded weights | "
             "folded/unfolded | sites folded |", "|---|---|---|---|---|"]
    lines.append("| ResNet-18 (BN), width 16, 32 px | " +
                 summarize([how(*cnn_case(s)) for s in seeds]) + " |")
    for kind in ("LayerNorm", "RMSNorm"):
        for spread in (0.1, 0.5, 1.0):
            lines.append(f"| block, {kind}, σ_γ = {spread} | " + summarize(
                [how(*block_case(kind, spread, s)) for s in seeds]) + " |")
    head = (f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"jax {jax.__version__} ({jax.default_backend()}), {a.seeds} seeds "
            "(median, range).\n\n")
    text = head + "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
