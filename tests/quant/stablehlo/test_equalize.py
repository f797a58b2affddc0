"""``fold_stablehlo(..., params=, equalize=True)``: cross-layer equalization on the StableHLO
path (issue 51, item 4), the rule of ``fold_params(..., equalize=True)`` read from a module.

The folded module computes the original outputs (rel ≤ 1e-5), finds the pairs the jaxpr path
finds (generated chains, Flax MobileNet-style nets), equalizes them to the same channel
spreads, so that per-tensor int8 of the prepared weights errs less; refusals say why; with
constants in the module, from the CLI, and on timm's RepVGG-A0 exported by PyTorch/XLA."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold._base.reasons import KINDS
from hlofold._ir.stablehlo.artifacts import input_specs, module_callable
from tests.quant.jaxpr.test_equalize import IMG, mobile, per_tensor, rel
from tests.helpers import DATA, assert_close, in_threads
from tests.helpers.pair_programs import program
from tests.helpers.residual_programs import program as residual_program
from tests.helpers.torch_weights import weight

EXACT = 1e-5


def _exported(fn, params, x):
    leaves, tree = jax.tree.flatten(params)
    g = jax.jit(lambda *a: fn(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    return jax.export.export(g)(*leaves, x), leaves, g(*leaves, x)


def _equalized(fn, params, x, **kw):
    exp, leaves, ref = _exported(fn, params, x)
    got, rep, prep = hlofold.fold_stablehlo(
        exp, params={i: np.asarray(a) for i, a in enumerate(leaves)}, equalize=True, **kw)
    out = got.call(x, *prep)
    for r, o in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        assert rel(r, o) <= EXACT, rel(r, o)
    assert all(n.kind in KINDS for n in rep.not_equalized), str(rep)   # each with its kind
    return got, rep, prep, ref


def _quantized(prep):
    """Every prepared kernel (ndim ≥ 2) in int8 with one scale per tensor."""
    def q(w):
        w64 = np.asarray(w, np.float64)
        if w64.ndim < 2:
            return w
        s = np.abs(w64).max() / 127 or 1.0
        return jnp.asarray(np.clip(np.round(w64 / s), -127, 127) * s, w.dtype)
    return [q(w) for w in prep]


@pytest.mark.parametrize("pool", [False, True])
def test_a_mobilenet_style_net_equalizes_as_on_the_jaxpr_path(pool):
    fn, params = mobile(pool=pool)
    x = IMG
    got, rep, prep, ref = _equalized(fn, params, x)
    on_jaxpr = hlofold.fold_params(fn, params, x, equalize=True)
    assert len(rep.equalized) == len(on_jaxpr.equalized) == 4, (str(rep), str(on_jaxpr))
    # the same rule and sweeps on the same folded values: the same spreads after (pairs in
    # program order on both paths)
    after = [e.spread_after for e in rep.equalized]
    want = [e.spread_after for e in on_jaxpr.equalized]
    np.testing.assert_allclose(after, want, rtol=1e-3)
    assert all(e.spread_after[0] < e.spread_before[0] for e in rep.equalized
               if e.spread_before[0] > 2), str(rep)       # (the wide ones come closer)
    assert [e.first for e in rep.equalized] == [
        f"the folded kernel of Net/{n}" for n in ("Conv_0", "Conv_1", "Conv_2", "Dense_0")]
    # per-tensor int8 of the prepared kernels: closer to the original than without
    plain, _, pplain = hlofold.fold_stablehlo(
        _exported(fn, params, x)[0],
        params={i: np.asarray(a) for i, a in enumerate(jax.tree.leaves(params))})
    err_eq = rel(ref, got.call(x, *_quantized(prep)))
    err_plain = rel(ref, plain.call(x, *_quantized(pplain)))
    assert err_eq < 0.85 * err_plain, (err_eq, err_plain)
    # ... and as much closer as on the jaxpr path (the same weights, quantized alike)
    assert abs(err_eq / rel(ref, fn(per_tensor(on_jaxpr.params), x)) - 1) < 1e-3
    assert "equalized: 4 layer pairs" in str(rep)
    assert len(rep.to_dict()["equalized"]) == 4


@pytest.mark.parametrize("seed", range(40))
def test_generated_chains_pair_as_on_the_jaxpr_path(seed):
    """The generated chains of the jaxpr path's differential test (passing and stopping
    ops between dense, grouped and depthwise convolutions) exported with their weights as
    arguments: the same pairs, the outputs within 1e-5 — but where the module's folded
    constants free a layer the tree ties (a kernel the program also returns; a constant
    added after a layer, folded into its bias)."""
    fn, p, x, expected, (layers, shared) = program(seed)
    _, rep, _, _ = _equalized(fn, p, x)
    # a constant added after a layer (x + 0.5) is part of its folded bias here, which the
    # parameter tree cannot scale: those layers pair here
    more = sum("add_const" in ops for _, ops in layers)      # (one stopping op at most)
    if shared or more:
        assert expected <= len(rep.equalized) <= expected + more + 2 * shared, str(rep)
    else:
        assert len(rep.equalized) == expected, (layers, str(rep))



@pytest.mark.parametrize("seed", range(16))
def test_generated_chains_with_an_activation_rounded_to_bfloat16_as_on_the_jaxpr_path(seed):
    """The jaxpr path's chains with an activation rounded to bfloat16 (``reduce_precision``
    or a cast there and back: ``stablehlo.reduce_precision`` / two converts) exported with
    their weights as arguments: the pairs of the jaxpr path (but for the folded constants
    above), the one through the rounding by powers of two, outputs within 1e-5."""
    fn, p, x, expected, (layers, shared) = program(seed, rounding=True)
    _, rep, _, _ = _equalized(fn, p, x)
    more = sum("add_const" in ops for _, ops in layers)
    if shared or more:
        assert expected <= len(rep.equalized) <= expected + more + 2 * shared, str(rep)
    else:
        assert len(rep.equalized) == expected, (fn.rounding, str(rep))
    want = hlofold.fold_params(fn, p, x, equalize=True)
    assert sum(e.powers_of_two for e in rep.equalized) >= \
        sum(e.powers_of_two for e in want.equalized), (fn.rounding, str(rep), str(want))

@pytest.mark.parametrize("act, why", [
    (lambda x: jax.nn.relu6(x), "not positively homogeneous"),
    (jnp.tanh, "stablehlo.tanh on the way is not positively homogeneous"),
    (lambda x: x + jnp.roll(x, 1, axis=-1), "read 2 times"),
])
def test_paths_that_do_not_commute_are_left_with_the_reason(act, why):
    fn, params = mobile(act=act)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 8, 3)), jnp.float32)
    _, rep, _, _ = _equalized(fn, params, x)
    # (the pointwise conv -> mean -> Dense and Dense -> relu -> Dense pairs stay)
    assert len(rep.equalized) == 2 and any(why in n.reason for n in rep.not_equalized), \
        str(rep)


def test_constants_in_the_module_and_the_cli(tmp_path):
    fn, params = mobile()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 8, 3)), jnp.float32)
    exp = jax.export.export(jax.jit(lambda x: fn(params, x)))(x)
    got, rep = hlofold.fold_stablehlo(exp, equalize=True)
    assert len(rep.equalized) == 4 and all(e.first.startswith("the folded kernel of Net/")
                                           for e in rep.equalized), str(rep)
    assert rel(fn(params, x), got.call(x)) <= EXACT
    src, out, rpt = tmp_path / "m.mlir", tmp_path / "o.mlir", tmp_path / "r.json"
    src.write_text(exp.mlir_module())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o", str(out),
                           "--equalize", "--report", str(rpt)], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "equalized: 4 layer pairs" in proc.stdout
    assert len(json.loads(rpt.read_text())["equalized"]) == 4
    assert rel(fn(params, x), module_callable(out.read_text())(x)[0]) <= EXACT
    proc = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o",
                           str(tmp_path / "x.mlir"), "--equalize", "--prepare",
                           str(tmp_path / "p.mlir"), "--per-call", "arg0"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "--equalize" in proc.stderr
    assert not (tmp_path / "x.mlir").exists()
    with pytest.raises(ValueError, match="equalize= needs the weights' values"):
        hlofold.fold_stablehlo(exp.mlir_module(), split=["arg0"], equalize=True)


@pytest.mark.slow
def test_timm_repvgg_from_pytorch_xla_equalizes_its_merged_chain():
    """RepVGG at inference is a plain chain conv → ReLU → conv: after the merge, every
    block pairs with the next one (the last with the head through the global pool)."""
    text = open(os.path.join(DATA, "repvgg_a0_torch_xla.mlir")).read()
    names = json.load(open(os.path.join(DATA, "repvgg_a0_torch_xla.json")))["args"]
    io = np.load(os.path.join(DATA, "repvgg_a0_torch_xla_io.npz"))
    weights = {f"arg{i}": weight(n, sp.shape)
               for i, (n, sp) in enumerate(zip(names, input_specs(text))) if n != "input"}
    full = [weights.get(f"arg{i}", io["x"]) for i in range(len(names))]
    ref = module_callable(text)(*full)[0]
    apply, rep, prepared = hlofold.fold_stablehlo(text, params=weights, equalize=True)
    assert len(rep.equalized) == 22, str(rep)
    assert_close(ref, module_callable(apply)(io["x"], *prepared)[0], depth=40)
    assert rel(ref, module_callable(apply)(io["x"], *prepared)[0]) <= EXACT


def bit_for_bit(fn, params, x):
    """Equalized on both paths with every scale a power of two, the outputs the plain
    fold's bit for bit; ``(fold_params' result, fold_stablehlo's report)``."""
    eq = hlofold.fold_params(fn, params, x, equalize=True)
    assert eq.equalized and all(e.powers_of_two for e in eq.equalized), str(eq)
    np.testing.assert_array_equal(fn(hlofold.fold_params(fn, params, x).params, x),
                                  fn(eq.params, x))
    exp, leaves, _ = _exported(fn, params, x)
    bound = {i: np.asarray(a) for i, a in enumerate(leaves)}
    got, rep, prep = hlofold.fold_stablehlo(exp, params=bound, equalize=True)
    plain, _, pplain = hlofold.fold_stablehlo(exp, params=bound)
    assert rep.equalized and all(e.powers_of_two for e in rep.equalized), str(rep)
    np.testing.assert_array_equal(got.call(x, *prep), plain.call(x, *pplain))
    return eq, rep


def _two_convs(between, seed):
    """``conv(between(relu(conv(x, k0))), k1)``, k0's channels spread over two decades."""
    from jax import lax
    rng = np.random.default_rng(seed)

    def conv(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    p = {"k0": jnp.asarray(rng.standard_normal((3, 3, 3, 8)) * 10 ** rng.uniform(-1, 1, 8),
                           jnp.float32),
         "k1": jnp.asarray(rng.standard_normal((3, 3, 8, 4)), jnp.float32)}

    def f(p, x):
        return conv(between(jax.nn.relu(conv(x, p["k0"]))), p["k1"]).mean((1, 2))
    return f, p, rng


def test_a_cast_to_an_integer_between_layers_stops_the_pair_on_both_paths():
    """``y.astype(int32).astype(float32)`` rounds: a scale moved across it changes the
    outputs. Before, the jaxpr path passed every cast, and fold_params' own check raised
    "please report this"; now both paths leave the pair, with the reason."""
    f, p, rng = _two_convs(lambda y: y.astype(jnp.int32).astype(jnp.float32), 0)
    x = jnp.asarray(rng.standard_normal((2, 6, 6, 3)) * 3, jnp.float32)
    out = hlofold.fold_params(f, p, x, equalize=True)
    assert not out.equalized and any("int32 (not a float)" in n.reason
                                     for n in out.not_equalized), str(out)
    np.testing.assert_array_equal(f(p, x), f(out.params, x))
    _, rep, _, _ = _equalized(f, p, x)
    assert not rep.equalized and any("not floating point" in n.reason
                                     for n in rep.not_equalized), str(rep)


def test_a_bfloat16_round_trip_between_layers_makes_the_scales_powers_of_two():
    """``y.astype(bfloat16).astype(float32)`` between float32 layers rounds: arbitrary scales
    would round it differently (found this stop: fold_params' own check raised "please
    report this", fold_stablehlo changed the outputs by a bfloat16 ulp). Both paths now read
    the types on the way: powers of two, the fold's outputs bit for bit."""
    f, p, rng = _two_convs(lambda y: y.astype(jnp.bfloat16).astype(jnp.float32), 1)
    x = jnp.asarray(rng.standard_normal((2, 6, 6, 3)), jnp.float32)
    out, rep = bit_for_bit(f, p, x)
    assert len(out.equalized) == len(rep.equalized) == 1


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
def test_equalize_and_smooth_from_ten_threads_as_from_one():
    """Folds in several threads follow private calls at the same time (a jitted block per
    layer, ``jax.nn.relu``), rewrite scanned stacks' loops layer by layer and walk residual
    streams: each thread
    keeps its own record of the arguments a call passes, and every thread gets the
    single-threaded pairs and prepared weights."""
    from hlofold import examples
    from hlofold._quant.stablehlo import pair_rules
    from benchmarks.quantization import smooth_case

    @jax.jit
    def block(x, w, b):
        return jax.nn.relu(x @ w + b)
    rng = np.random.default_rng(0)
    p = [(jnp.asarray(rng.standard_normal((16, 16)) * (1 + 3 * rng.random(16)), jnp.float32),
          jnp.asarray(rng.standard_normal(16), jnp.float32)) for _ in range(4)]
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    chain = _exported(lambda p, x: block(block(block(x, *p[0]), *p[1]), *p[2]) @ p[3][0],
                      p, x)
    f, dp, dx, calib = smooth_case("decoder", 0)
    dec = _exported(f, dp, dx[0])
    scan = _exported(examples.scanned_decoder_apply, examples.stack_decoder(dp), dx[0])
    rfn, rp, rx, _, _ = residual_program(1)          # (two residual streams)
    res = _exported(rfn, rp, rx)
    jobs = [(chain, dict(equalize=True)), (dec, dict(smooth=calib)),    # (and a scanned
            (scan, dict(smooth=calib)), (scan, dict(equalize=True)),   # stack's loop)
            (res, dict(equalize=True))]

    def run(job):
        (exp, leaves, _), kw = job
        _, rep, prep = hlofold.fold_stablehlo(
            exp, params={i: np.asarray(a) for i, a in enumerate(leaves)}, **kw)
        done = rep.equalized + rep.smoothed
        return (len(done), sum(bool(e.writers) for e in done)), [np.asarray(a) for a in prep]
    want = [run(j) for j in jobs]
    assert [n for (n, _), _ in want[:4]] == [3, want[1][0][0], 5, 2] and want[1][0][0] > 5
    assert want[4][0] == (4, 2)
    got, seen = [], []

    def work(k):
        seen.append(id(pair_rules.passed()))
        got.append((k % 5, run(jobs[k % 5])))
    in_threads(work, 10, 1e-5)
    assert len(set(seen)) == 10 and len(got) == 10         # (one record per thread)
    for k, (n, prep) in got:
        assert n == want[k][0] and all(np.array_equal(a, b) for a, b in zip(prep, want[k][1]))


@pytest.mark.parametrize("seed", [*range(4), *(pytest.param(s, marks=pytest.mark.slow)
                                                for s in range(4, 8))])
def test_generated_scanned_stacks_equalize_per_layer_as_on_the_jaxpr_path(seed):
    """decoder_program's layer scanned 1–4 deep (forward or reversed; unrolled by 2: two
    layers an iteration): the loop's layers are equalized one by one — the pairs of
    fold_params(..., equalize=True) on the same scan — and the module stays exact. (The
    spreads may differ: where fold_params cannot write a fold back — no bias leaf for a
    norm's β — the kernels it equalizes are not the folded ones StableHLO equalizes.)"""
    from tests.helpers.pair_programs import scanned_decoder_program
    rng = np.random.default_rng(seed)
    layers, unroll = [(1, 1), (2, 1), (3, 1), (4, 2)][seed % 4]
    fn, sp, _, _, x, _, _ = scanned_decoder_program(seed, layers, bool(rng.integers(2)),
                                                    unroll)
    got, rep, prep, ref = _equalized(fn, sp, x)
    want = hlofold.fold_params(fn, sp, x, equalize=True)
    stacked = [e for e in want.equalized if "scanned stack" in e.location]
    inside = [e for e in rep.equalized if "scanned stack" in e.location]
    # (one difference, asserted as for the unscanned decoders: a constant added after v or
    # up is part of its folded bias here, so v -> o, up -> down pair here)
    more = sum(s == "add_const" for s in fn.stops)
    assert len(inside) == (len(stacked) + more) * unroll, (str(rep), str(want))
    assert not any("inside this loop" in n.reason for n in rep.not_equalized), str(rep)


def test_scanned_cnn_stack_folds_then_equalizes_per_layer():
    """conv → BN → ReLU → conv → BN plus the input, per layer of a scan over stacked kernels
    and statistics: the fold restacks the folded kernels, then each layer's conv1 → conv2 is
    equalized, as fold_params does."""
    from tests.quant.jaxpr.test_scan_pairs import cnn_stack
    scanned, p, x = cnn_stack()
    got, rep, prep, ref = _equalized(scanned, p, x)
    want = hlofold.fold_params(scanned, p, x, equalize=True)
    assert len(rep.equalized) == len(want.equalized) == 1, str(rep)
    assert "each of its 3 layers" in rep.equalized[0].location
    assert rep.equalized[0].spread_after == pytest.approx(want.equalized[0].spread_after,
                                                          rel=1e-4)


def test_builtin_scanned_decoder_equalizes_as_on_the_jaxpr_path():
    """The built-in scanned decoder (DenseGeneral q/k/v/o over stacked layers): v -> o and
    up -> down in each layer, with the channel spreads fold_params reaches on the scan."""
    from benchmarks.quantization import smooth_case
    from hlofold import examples
    _, p, x, _ = smooth_case("decoder", 0)
    sp = examples.stack_decoder(p)
    got, rep, prep, ref = _equalized(examples.scanned_decoder_apply, sp, *x)
    want = hlofold.fold_params(examples.scanned_decoder_apply, sp, *x, equalize=True)
    assert len(rep.equalized) == len(want.equalized) == 2, str(rep)
    for a, b in zip(sorted(rep.equalized, key=lambda e: e.spread_before),
                    sorted(want.equalized, key=lambda e: e.spread_before)):
        assert "each of its 2 layers its own scales" in a.location
        assert a.spread_before == pytest.approx(b.spread_before, rel=1e-4)
        assert a.spread_after == pytest.approx(b.spread_after, rel=1e-4)


def test_a_loop_that_is_not_counted_is_left_with_the_reason():
    """Layers in a ``while_loop`` whose trip count is an input (not a counted loop over
    known stacks): not equalized, and the report says so, on both paths; the outputs stay
    exact."""
    from tests.helpers.blocks import uncounted_loop
    f, p, x = uncounted_loop()
    got, rep, prep, ref = _equalized(f, p, x)
    assert rep.equalized == [], str(rep)
    assert any("inside this loop" in n.reason for n in rep.not_equalized), str(rep)
    out = hlofold.fold_params(f, p, x, equalize=True)          # (the jaxpr path: the same)
    assert out.equalized == [] and any("inside this while loop" in n.reason
                                       for n in out.not_equalized), str(out)


def test_scanned_stack_with_constants_from_the_cli(tmp_path):
    """The CLI on a module whose scanned stack's weights are constants (``jax.export`` of the
    model with its parameters closed over): the loop's pairs equalized per layer."""
    from tests.quant.jaxpr.test_scan_pairs import cnn_stack
    scanned, p, x = cnn_stack()
    exp = jax.export.export(jax.jit(lambda x: scanned(p, x)))(x)
    src, out, rpt = tmp_path / "m.mlir", tmp_path / "o.mlir", tmp_path / "r.json"
    src.write_text(exp.mlir_module())
    proc = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o", str(out),
                           "--equalize", "--report", str(rpt)], capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    eq = json.loads(rpt.read_text())["equalized"]
    assert len(eq) == 1 and "each of its 3 layers its own scales" in eq[0]["location"], eq
    assert rel(scanned(p, x), module_callable(out.read_text())(x)[0]) <= EXACT


def test_layers_in_regions_the_pairs_are_not_read_in_are_said():
    """The same program exported: the ``checkpoint`` is gone (its two layers pair at the
    top level, as they run), the ``cond`` is a ``stablehlo.case`` whose layer is said."""
    from tests.helpers.blocks import nested_layers_block
    f, p, x = nested_layers_block()
    got, rep, prep, ref = _equalized(f, p, x)
    said = {n.kernel: n.reason for n in rep.not_equalized}
    assert "1 convolution/dot op(s) inside this stablehlo.case are not paired" in \
        said.get("the layers of a stablehlo.case", ""), str(rep)
    assert len(rep.equalized) >= 1, str(rep)
