"""``fold_stablehlo(..., params=, smooth=[inputs], alpha=)``: SmoothQuant's scales folded into
a module (issue 51, item 4), the rule of ``fold_params(..., smooth=)`` read from the module.

After the fold a norm's γ is in the layers it feeds, so the module's norm output gets a
``·(1/s)`` multiply (where the norm's γ was) and the layers' input rows ``·s``; a layer before
a gated product (``up``) gets ``1/s`` in its output channels. The module computes its outputs
(rel ≤ 1e-5); the scale put at each norm is the γ the jaxpr path writes (the same SmoothQuant
scales, measured on the same calibration inputs); what is not smoothed is said (channels
split over heads are not followed on StableHLO: v → o stays)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import hlofold
from hlofold._base.reasons import KINDS
from hlofold import examples
from benchmarks.quantization import smooth_case
from hlofold._ir.stablehlo.ir import StableHLOError
from tests.quant.jaxpr.test_equalize import rel
from tests.helpers.pair_programs import decoder_program

EXACT = 1e-5


def _smoothed(f, p, x, calib, **kw):
    leaves, tree = jax.tree.flatten(p)
    g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:len(leaves)]), *a[len(leaves):]))
    exp = jax.export.export(g)(*leaves, *x)
    got, rep, prep = hlofold.fold_stablehlo(
        exp, params={i: np.asarray(a) for i, a in enumerate(leaves)}, smooth=calib, **kw)
    ref, out = g(*leaves, *x), got.call(*x, *prep)
    for r, o in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        assert rel(r, o) <= EXACT, (rel(r, o), str(rep))
    assert all(e.kind == "smoothed" for e in rep.smoothed) and not rep.equalized
    assert all(n.kind in KINDS for n in rep.not_smoothed), str(rep)    # each with its kind
    return rep, prep, exp


def _norm_scales_match(prep, written, names):
    """Each norm's ``·(1/s)`` (a prepared vector) is the γ the jaxpr path writes there."""
    vectors = [np.asarray(a) for a in prep if np.ndim(a) == 1]
    for name in names:
        want = np.asarray(written[name] if isinstance(name, str) else written[name[0]][
            name[1]][name[2]])
        assert any(v.shape == want.shape and np.allclose(v, want, rtol=1e-4, atol=1e-6)
                   for v in vectors), name


def test_decoder_norms_and_gated_product_on_stablehlo():
    f, p, x, calib = smooth_case("decoder", 0)
    rep, prep, _ = _smoothed(f, p, x, calib)
    norms = [e for e in rep.smoothed if e.first.startswith("the norm output")]
    layers = [e for e in rep.smoothed if not e.first.startswith("the norm output")]
    # per layer both norms (q, k, v; gate and up) and the final norm (the head); per layer
    # up -> down and v -> o (through the heads: reshape, transpose, probs @ v, merged back)
    assert sorted(len(e.seconds) for e in norms) == [1, 2, 2, 3, 3], str(rep)
    assert len(layers) == 4 and all(len(e.seconds) == 1 for e in layers), str(rep)
    assert not any("reshape" in n.reason for n in rep.not_smoothed), str(rep)
    assert any("split over axes" in n.reason for n in rep.not_smoothed), str(rep)   # q, k
    assert max(e.scale_range[1] / e.scale_range[0] for e in norms) > 3    # massive channels
    written = hlofold.fold_params(f, p, *x, smooth=calib).params
    _norm_scales_match(prep, written, [("layers", 0, "attn_norm"), ("layers", 0, "mlp_norm"),
                                       ("layers", 1, "attn_norm"), ("layers", 1, "mlp_norm"),
                                       "final_norm"])
    # o's input rows carry v -> o's scales: the kernel the jaxpr path writes, to rounding
    for layer in (0, 1):
        want = np.asarray(written["layers"][layer]["o"])
        assert any(np.shape(a) == want.shape and np.allclose(a, want, rtol=1e-4, atol=1e-6)
                   for a in prep), layer


@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_flax_block_on_stablehlo(norm):
    f, p, x, calib = smooth_case(norm, 1)
    rep, _, _ = _smoothed(f, p, x, calib)
    # q, k, v after the first norm; gate and up after the second; up -> down; v -> o
    # through the heads — the pairs of fold_params(smooth=) (tests/quant/jaxpr/test_smooth.py)
    assert sorted(len(e.seconds) for e in rep.smoothed) == [1, 1, 2, 3], str(rep)


@pytest.mark.parametrize("seed", range(24))
def test_generated_decoders_on_stablehlo(seed):
    """The jaxpr path's generated decoder layers (v -> o through the heads among them, or
    stopped on the way): the same pairs but one difference, asserted — a constant added
    after v or up (``up + 0.5``) is part of its folded bias here (a literal the parameter
    tree cannot scale), so v -> o, up -> down pair here."""
    fn, p, x, calib, expected = decoder_program(seed)
    stop_v, stop_up = fn.stops
    rep, _, _ = _smoothed(fn, p, (x,), calib)
    want = expected + (stop_up == "add_const") + (stop_v == "add_const")
    assert len(rep.smoothed) == want, (expected, fn.stops, str(rep))
    if stop_v is None:
        assert not any("split over axes" in n.reason and "dot_general" not in n.reason
                       for n in rep.not_smoothed), str(rep)


@pytest.mark.parametrize("bias", [True, False])
def test_multi_head_kernels_on_stablehlo(bias):
    """Flax DenseGeneral q/k/v (d, heads, head_dim) and an output projection contracting
    (heads, head_dim): v -> o pairs over the two axes (its (heads, head_dim) bias divided),
    as on the jaxpr path, and writes the o kernel and v bias fold_params writes."""
    from tests.helpers.blocks import flax_multi_head_block
    f, v, x, calib = flax_multi_head_block(bias)
    rep, prep, _ = _smoothed(f, v, (x,), calib)
    assert sorted(len(e.seconds) for e in rep.smoothed) == [1, 3], str(rep)
    assert len(next(e for e in rep.smoothed if len(e.seconds) == 1).biases) == bias
    written = hlofold.fold_params(f, v, x, smooth=calib).params["params"]
    wants = [written["DenseGeneral_3"]["kernel"]] + \
        ([written["DenseGeneral_2"]["bias"]] if bias else [])
    for want in map(np.asarray, wants):      # (the folded bias is flat: (heads·head_dim,))
        assert any(np.size(a) == want.size and np.ndim(a) in (1, want.ndim) and
                   np.allclose(np.ravel(a), want.ravel(), rtol=1e-4, atol=1e-6)
                   for a in prep), (want.shape, str(rep))


@pytest.mark.parametrize("repeat", [1, 2, 4])
def test_grouped_query_attention_on_stablehlo(repeat):
    """As on the jaxpr path: v -> o pairs through the repeat of the kv heads (one kv head
    too), with the scales fold_params(smooth=) takes and the o kernel it writes."""
    from tests.helpers.blocks import gqa_block
    f, p, x, calib = gqa_block(repeat)
    rep, prep, _ = _smoothed(f, p, (x,), calib)
    want = hlofold.fold_params(f, p, x, smooth=calib)
    assert len(rep.smoothed) == len(want.smoothed) == 1, str(rep)
    assert rep.smoothed[0].scale_range == pytest.approx(want.smoothed[0].scale_range,
                                                         rel=1e-5)
    o = np.asarray(want.params["o"])
    assert any(np.shape(a) == o.shape and np.allclose(a, o, rtol=1e-4, atol=1e-6)
               for a in prep)


@pytest.mark.parametrize("rewrite", ["smooth", "equalize"])
def test_sharding_constraints_between_layers_are_passed_on_stablehlo(rewrite):
    """``sdy.sharding_constraint`` between layers (and after a norm): the pairs of the same
    module without constraints, with the same scales; the module exact."""
    from tests.helpers.blocks import constrained_block
    got = []
    for constrain in (True, False):
        f, p, x, calib = constrained_block(constrain)
        leaves, tree = jax.tree.flatten(p)
        g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
        exp = jax.export.export(g)(*leaves, x)
        assert ("sdy.sharding_constraint" in exp.mlir_module()) == constrain
        kw = {"smooth": [[c] for c in calib]} if rewrite == "smooth" else {"equalize": True}
        new, rep, prep = hlofold.fold_stablehlo(
            exp, params={i: np.asarray(a) for i, a in enumerate(leaves)}, **kw)
        assert rel(g(*leaves, x), new.call(x, *prep)) <= EXACT, str(rep)
        got.append(sorted((len(e.seconds), *e.scale_range)
                          for e in (rep.smoothed if rewrite == "smooth" else rep.equalized)))
    assert len(got[0]) == (3 if rewrite == "smooth" else 2), got
    assert np.allclose(got[0], got[1], rtol=1e-6), got


def test_repeated_kv_channels_reaching_a_bias_are_left_on_stablehlo():
    """As on the jaxpr path: a per-(head, head_dim) bias after the repeat leaves v -> o,
    with the reason."""
    from tests.helpers.blocks import repeated_kv_bias_block
    f, p, x = repeated_kv_bias_block()
    rep, _, _ = _smoothed(f, p, (x,), [[x], [2 * x]])
    assert rep.smoothed == [], str(rep)
    assert any("repeated over an axis" in n.reason for n in rep.not_smoothed), str(rep)


def test_bad_calibration_inputs_and_split_are_errors():
    f, p, x, calib = smooth_case("RMSNorm", 0)
    leaves, tree = jax.tree.flatten(p)
    g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    exp = jax.export.export(g)(*leaves, *x)
    params = {i: np.asarray(a) for i, a in enumerate(leaves)}
    with pytest.raises(ValueError, match="at least one calibration input"):
        hlofold.fold_stablehlo(exp, params=params, smooth=[])
    with pytest.raises(TypeError, match="smooth= takes a list of calibration inputs"):
        hlofold.fold_stablehlo(exp, params=params, smooth=True)     # (raised from a loop)
    with pytest.raises(StableHLOError, match="calibration input has 2 arrays"):
        hlofold.fold_stablehlo(exp, params=params, smooth=[(x[0], x[0])])
    with pytest.raises(ValueError, match="alpha= must be a number from 0 to 1"):
        hlofold.fold_stablehlo(exp, params=params, smooth=calib, alpha=2.0)
    with pytest.raises(ValueError, match="smooth= needs the weights' values"):
        hlofold.fold_stablehlo(exp.mlir_module(), split=[f"arg{len(leaves)}"],
                               smooth=[x])
    # the module's weights as constants: smoothed in place, calibrated the same way
    const = jax.export.export(jax.jit(lambda x: f(p, x)))(*x)
    got, rep = hlofold.fold_stablehlo(const, smooth=calib)
    assert len(rep.smoothed) == 4 and rel(f(p, *x), got.call(*x)) <= EXACT
    assert {e.alpha for e in rep.smoothed} == {0.5}


def _cli_case(tmp_path):
    """The Flax RMSNorm block exported with its weights as arguments, written with its
    weights and calibration inputs: ``(run(*flags), g, leaves, x, calib, paths)``."""
    import os
    import subprocess
    import sys
    f, p, x, calib = smooth_case("RMSNorm", 0)
    leaves, tree = jax.tree.flatten(p)
    g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    n = len(leaves)
    src, out, w, c, prep = (tmp_path / k for k in ("m.mlir", "o.mlir", "w.npz", "c.npz",
                                                    "p.npz"))
    src.write_text(jax.export.export(g)(*leaves, *x).mlir_module())
    np.savez(w, **{f"arg{i}": np.asarray(a) for i, a in enumerate(leaves)})
    np.savez(c, **{f"arg{n}": np.stack([np.asarray(k[0]) for k in calib])})
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = lambda *extra: subprocess.run(                                  # noqa: E731
        [sys.executable, "-m", "hlofold", "fold", str(src), "-o", str(out), "--params",
         str(w), "--prepared-out", str(prep), *extra], capture_output=True, text=True, env=env)
    return run, g, leaves, x, calib, (out, c, prep)


@pytest.mark.slow
def test_the_cli_smooths_with_calibration_inputs(tmp_path):
    from hlofold._ir.stablehlo.artifacts import module_callable
    run, g, leaves, x, calib, (out, c, prep) = _cli_case(tmp_path)
    n = len(leaves)
    proc = run("--smooth", str(c), "--alpha", "0.5")
    assert proc.returncode == 0, proc.stderr
    assert "smoothed: 4 layer pairs" in proc.stdout
    with np.load(prep) as z:
        prepared = [z[k] for k in sorted(z.files, key=lambda k: int(k[3:]))]
    assert rel(g(*leaves, *x), module_callable(out.read_text())(*x, *prepared)[0]) <= EXACT
    np.savez(c, **{"arg0": np.stack([np.asarray(k[0]) for k in calib])})   # a weight's name
    out.unlink()
    proc = run("--smooth", str(c))
    assert proc.returncode == 2 and f"give the per-call arguments arg{n}" in proc.stderr
    assert not out.exists()
    proc = run("--smooth", str(c), "--alpha", "1.5")
    assert proc.returncode == 2
    assert "expected a number from 0 to 1 or search:wNaM (search:w4a8), got '1.5'" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def _scale_ranges_match(rep, want, unroll: int = 1):
    """The per-layer pairs of a scanned stack; one layer an iteration (``unroll``), for each
    pair ``fold_params(smooth=)`` smooths there, one with its scales in the same range —
    where the first side adds no bias (a norm's β: the jaxpr path measures the norm's output
    after it, this one before, where the fold left the norm; both exact, the scales not the
    same)."""
    got = [e for e in rep.smoothed if "scanned stack" in e.location]
    exp = [e for e in want.smoothed if "scanned stack" in e.location]
    if unroll == 1:
        for e in (e for e in exp if not e.biases):
            assert any(len(g.seconds) == len(e.seconds) and
                       g.scale_range == pytest.approx(e.scale_range, rel=1e-4)
                       for g in got), (e, str(rep))
    return got


@pytest.mark.slow
def test_builtin_scanned_decoder_smooths_each_layer_as_on_the_jaxpr_path():
    """The built-in decoder as one scan over stacked layers (a counted ``while`` on
    StableHLO): each layer smoothed with its own scales from its own activations — the
    calibration runs the module up to the loop, then each layer's body from what the one
    before returned — the pairs, scales and channel spreads of ``fold_params(smooth=)`` on
    the same scan, each layer's norm scale the γ row it writes; the outputs exact."""
    f0, p, x, calib = smooth_case("decoder", 0)
    sp = examples.stack_decoder(p)
    rep, prep, _ = _smoothed(examples.scanned_decoder_apply, sp, x, calib)
    want = hlofold.fold_params(examples.scanned_decoder_apply, sp, *x, smooth=calib)
    got = _scale_ranges_match(rep, want)
    assert len(got) == 4 and len(rep.smoothed) == len(want.smoothed) == 5, str(rep)
    assert all("each of its 2 layers its own scales" in e.location for e in got)
    assert not any("inside this loop" in n.reason for n in rep.not_smoothed), str(rep)
    layers = [sorted((e for e in r.smoothed if not e.first.startswith(("the norm", "['"))
                     or "norm" not in e.first), key=lambda e: e.spread_before)
              for r in (rep, want)]
    for a, b in zip(*layers):               # (v -> o, up -> down: the same kernels)
        assert a.spread_after == pytest.approx(b.spread_after, rel=1e-4)
    for name in ("attn_norm", "mlp_norm"):        # (2, d): each layer's 1/s, stacked
        w = np.asarray(want.params["layers"][name])
        assert any(np.shape(a) == w.shape and np.allclose(a, w, rtol=1e-4, atol=1e-6)
                   for a in prep), name


@pytest.mark.slow
@pytest.mark.parametrize("seed", [*range(2), *(pytest.param(s, marks=pytest.mark.slow)
                                                for s in range(2, 8))])
def test_generated_scanned_stacks_smooth_per_layer_as_on_the_jaxpr_path(seed):
    """decoder_program's layer scanned 1–4 deep (forward or reversed; unrolled by 2: two
    layers an iteration): each layer smoothed from its own activations, the pairs (and, one
    layer an iteration, the scales) of fold_params(smooth=) on the same scan; exact."""
    from tests.helpers.pair_programs import scanned_decoder_program
    rng = np.random.default_rng(seed)
    layers, unroll = [(1, 1), (2, 1), (3, 1), (4, 2)][seed % 4]
    fn, sp, _, _, x, calib, _ = scanned_decoder_program(seed, layers, bool(rng.integers(2)),
                                                        unroll)
    rep, _, _ = _smoothed(fn, sp, (x,), calib)
    want = hlofold.fold_params(fn, sp, x, smooth=calib)
    more = sum(s == "add_const" for s in fn.stops)     # (a folded bias here: see above)
    exp = [e for e in want.smoothed if "scanned stack" in e.location]
    got = _scale_ranges_match(rep, want, unroll)
    assert len(got) == (len(exp) + more) * unroll, (str(rep), str(want))
    assert not any("inside this loop" in n.reason for n in rep.not_smoothed), str(rep)


def test_a_loop_that_is_not_counted_is_not_smoothed_on_either_path():
    """Layers in a ``while_loop`` whose trip count is an input: left, with the reason, on
    both paths; the outputs exact."""
    from tests.helpers.blocks import uncounted_loop
    f, p, x = uncounted_loop()
    rep, _, _ = _smoothed(f, p, (x,), [[x], [2 * x]])
    assert rep.smoothed == [], str(rep)
    assert any("inside this loop" in n.reason for n in rep.not_smoothed), str(rep)
    out = hlofold.fold_params(f, p, x, smooth=[x, 2 * x])
    assert out.smoothed == [] and any("inside this while loop" in n.reason
                                       for n in out.not_smoothed), str(out)


def test_scanned_cnn_stack_smoothed_from_the_cli(tmp_path):
    """The CLI on a module whose scanned stack's weights are constants: conv1 → ReLU →
    conv2 of each layer smoothed from that layer's activations (``--smooth`` inputs), as
    fold_params(smooth=) does; the output module exact."""
    import json
    import os
    import subprocess
    import sys
    from hlofold._ir.stablehlo.artifacts import module_callable
    from tests.quant.jaxpr.test_scan_pairs import cnn_stack
    scanned, p, x = cnn_stack()
    exp = jax.export.export(jax.jit(lambda x: scanned(p, x)))(x)
    src, out, rpt, c = (tmp_path / k for k in ("m.mlir", "o.mlir", "r.json", "c.npz"))
    src.write_text(exp.mlir_module())
    calib = [np.asarray(x), np.asarray(x) * 3 + 1]
    np.savez(c, arg0=np.stack(calib))
    proc = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o", str(out),
                           "--smooth", str(c), "--report", str(rpt)], capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    sm = json.loads(rpt.read_text())["smoothed"]
    want = hlofold.fold_params(scanned, p, x, smooth=calib)
    assert len(sm) == len(want.smoothed) == 1, (sm, str(want))
    assert "each of its 3 layers its own scales" in sm[0]["location"], sm
    assert sm[0]["scale_range"] == pytest.approx(list(want.smoothed[0].scale_range),
                                                 rel=1e-4)
    assert rel(scanned(p, x), module_callable(out.read_text())(x)[0]) <= EXACT


@pytest.mark.parametrize("rewrite", ["smooth", "equalize"])
def test_bfloat16_weights_rewritten_bit_for_bit(rewrite):
    """The built-in decoder with bfloat16 weights, exported: its layers read the weights
    through converts (bf16 -> f32), which the pairs follow; every scale is a power of two,
    so the module computes what the fold alone computes, bit for bit (the jaxpr path's rule:
    tests/quant/jaxpr/test_low_precision.py)."""
    import jax.numpy as jnp
    f, p, x, calib = smooth_case("decoder", 0)
    leaves, tree = jax.tree.flatten(jax.tree.map(lambda a: a.astype(jnp.bfloat16), p))
    g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    exp = jax.export.export(g)(*leaves, *x)
    params = {i: np.asarray(a) for i, a in enumerate(leaves)}
    kw = {"smooth": calib} if rewrite == "smooth" else {"equalize": True}
    base, _, bprep = hlofold.fold_stablehlo(exp, params=params)
    got, rep, prep = hlofold.fold_stablehlo(exp, params=params, **kw)
    done, left = ((rep.smoothed, rep.not_smoothed) if rewrite == "smooth" else
                  (rep.equalized, rep.not_equalized))
    assert len(done) >= 4 and all(e.powers_of_two for e in done), str(rep)
    assert not any("floating point" in n.reason or "shared weight" in n.reason
                   for n in left), str(rep)
    np.testing.assert_array_equal(np.asarray(got.call(*x, *prep), np.float32),
                                  np.asarray(base.call(*x, *bprep), np.float32))


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
def test_searched_alpha_is_the_jaxpr_paths():
    """``alpha="search:w4a8"`` on the exported decoder: each pair takes the α the jaxpr path
    takes on the same calibration inputs (the search is the core's; each path reads its rows
    where the second layers read), the module exact; the built-in scanned decoder searched
    layer by layer the same way."""
    f, p, x, calib = smooth_case("decoder", 0)
    rep, _, _ = _smoothed(f, p, x, calib, alpha="search:w4a8")
    want = hlofold.fold_params(f, p, *x, smooth=calib, alpha="search:w4a8")
    assert {e.searched for e in rep.smoothed} == {"search:w4a8"}
    assert sorted(e.alpha or -1 for e in rep.smoothed) == \
        sorted(e.alpha or -1 for e in want.smoothed), (str(rep), str(want))
    sp = examples.stack_decoder(p)
    rep, _, _ = _smoothed(examples.scanned_decoder_apply, sp, x, calib, alpha="search:w4a8")
    got = [e for e in rep.smoothed if "scanned stack" in e.location]
    assert len(got) == 4 and all(e.searched == "search:w4a8" for e in got), str(rep)
    want = hlofold.fold_params(examples.scanned_decoder_apply, sp, *x, smooth=calib,
                               alpha="search:w4a8")
    key = lambda e: str(e.alpha)                                          # noqa: E731
    mine = [e for e in want.smoothed if "scanned stack" in e.location]
    assert sorted(map(key, got)) == sorted(map(key, mine)), (str(rep), str(want))


@pytest.mark.slow
def test_the_cli_searches_alpha(tmp_path):
    run, *_, (out, c, _) = _cli_case(tmp_path)
    proc = run("--smooth", str(c), "--alpha", "search:w4a8")
    assert proc.returncode == 0, proc.stderr
    assert "smoothed: 4 layer pairs" in proc.stdout and out.exists()
    out.unlink()
    proc = run("--smooth", str(c), "--alpha", "search")
    assert proc.returncode == 2 and "search:wNaM" in proc.stderr and not out.exists()
