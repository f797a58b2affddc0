"""Residual streams equalized as one (``fold_params(..., equalize=True)`` and
``fold_stablehlo(..., equalize=True)``; :mod:`hlofold._quant.core.streams`): the layers writing a
ResNet or MobileNetV2 stage's stream (the stem or a projecting shortcut, the blocks' last
convolutions) and those reading it (the blocks' first convolutions, a projecting shortcut,
the head) share one scale per channel. Every stream keeps the outputs (rel ≤ 1e-5) on both
paths, which find the same streams and equalize them to the same spreads; what a stream
cannot pass leaves it, with the reason, on both paths."""
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
from tests.quant.jaxpr.test_equalize import (IMG, equalized, per_tensor, rel, spread_bn,
                                          spread_keras)
from hlofold._ir.stablehlo.artifacts import module_callable
from tests.helpers.residual_programs import program
from tests.quant.stablehlo.test_equalize import _equalized, bit_for_bit


def _both(fn, params, x, records, streams):
    """Both paths: ``records`` equalized, ``streams`` of them with several writers, of the
    same shapes (the spreads after may differ: the module's fold also moves constants such
    as a mean's ``1/n`` into the head's kernel, which the tree cannot); both results."""
    jp = equalized(fn, params, x, pairs=records)
    _, rep, _, _ = _equalized(fn, params, x)
    for out in (jp, rep):
        assert len(out.equalized) == records, str(out)
        assert sum(bool(e.writers) for e in out.equalized) == streams, str(out)
    key = lambda e: (len(e.writers), len(e.seconds))                         # noqa: E731
    assert sorted(map(key, jp.equalized)) == sorted(map(key, rep.equalized)), (str(jp),
                                                                               str(rep))
    return jp, rep


@pytest.mark.parametrize("seed", range(30))
def test_generated_residual_stages_on_both_paths(seed):
    fn, p, x, records, streams = program(seed)
    _both(fn, p, x, records, streams)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generated_residual_stages_from_the_cli(tmp_path, seed):
    """The module with its weights as constants, through ``hlofold fold --equalize``: the
    same streams in the JSON report, the outputs kept."""
    fn, p, x, records, streams = program(seed)
    src, out, rpt = tmp_path / "m.mlir", tmp_path / "o.mlir", tmp_path / "r.json"
    src.write_text(jax.export.export(jax.jit(lambda x: fn(p, x)))(x).mlir_module())
    proc = subprocess.run([sys.executable, "-m", "hlofold", "fold", str(src), "-o", str(out),
                           "--equalize", "--report", str(rpt)], capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(rpt.read_text())["equalized"]
    assert (len(got), sum(bool(e["writers"]) for e in got)) == (records, streams), got
    for r, o in zip(jax.tree.leaves(fn(p, x)), module_callable(out.read_text())(x)):
        assert rel(r, o) <= 1e-5, rel(r, o)


def _resnet(relu_after=True, project=True, tail=None):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            bn = lambda: nn.BatchNorm(use_running_average=True)        # noqa: E731
            x = nn.relu(bn()(nn.Conv(8, (3, 3), use_bias=False, name="stem")(x)))
            for i, width in enumerate((8, 8, 16) if project else (8, 8)):
                h = nn.relu(bn()(nn.Conv(width, (3, 3), use_bias=False,
                                         name=f"conv1_{i}")(x)))
                h = bn()(nn.Conv(width, (3, 3), use_bias=False, name=f"conv2_{i}")(h))
                if width != x.shape[-1]:
                    x = bn()(nn.Conv(width, (1, 1), use_bias=False, name=f"proj_{i}")(x))
                x = x + h
                x = nn.relu(x) if relu_after else x
                if tail is not None and i == 0:
                    x = tail(x)
            return nn.Dense(5, name="head")(x.mean((1, 2)))
    m = Net()
    return m.apply, spread_bn(m.init(jax.random.key(3), IMG))


@pytest.mark.slow
def test_flax_resnet_stages_equalize_as_one_on_both_paths():
    fn, v = _resnet()
    # conv1_i -> conv2_i (3 pairs); the stem's stream (stem, conv2_0, conv2_1 writing; conv1_0,
    # conv1_1, conv1_2, proj_2 reading); the last stage's (proj_2, conv2_2; the head)
    jp, rep = _both(fn, v, IMG, 5, 2)
    streams = {e.first.split("'")[3]: e for e in jp.equalized if e.writers}
    first = streams["stem"]
    assert sorted(w.split("'")[3] for w in first.writers) == ["conv2_0", "conv2_1"]
    assert sorted(s.split("'")[3] for s in first.seconds) == [
        "conv1_0", "conv1_1", "conv1_2", "proj_2"]
    # the BatchNorms' biases after the writers are divided with them
    assert len(first.biases) >= 3, first.biases
    for out in (str(jp), str(rep)):
        assert "a residual stream, written by" in out, out
    assert any(e["writers"] for e in rep.to_dict()["equalized"])
    # per-tensor int8 of the equalized weights errs less than of the folded ones
    folded = hlofold.fold_params(fn, v, IMG)
    ref = fn(v, IMG)
    err_eq = rel(ref, fn(per_tensor(jp.params), IMG))
    err_fold = rel(ref, fn(per_tensor(folded.params), IMG))
    assert err_eq < 0.9 * err_fold, (err_eq, err_fold)


def test_flax_linear_bottleneck_stream_without_relu():
    fn, v = _resnet(relu_after=False, project=False)
    _both(fn, v, IMG, 3, 1)


def test_flax_mobilenetv2_style_inverted_residuals():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            bn = lambda: nn.BatchNorm(use_running_average=True)        # noqa: E731
            x = bn()(nn.Conv(8, (3, 3), use_bias=False)(x))
            for _ in range(2):      # expand 1×1, depthwise 3×3, project 1×1; x + it
                h = nn.relu(bn()(nn.Conv(24, (1, 1), use_bias=False)(x)))
                h = nn.relu(bn()(nn.Conv(24, (3, 3), feature_group_count=24,
                                         use_bias=False)(h)))
                x = x + bn()(nn.Conv(8, (1, 1), use_bias=False)(h))
            return nn.Dense(5)(nn.relu(x.mean((1, 2))))
    m = Net()
    v = spread_bn(m.init(jax.random.key(4), IMG))
    # expand -> depthwise, depthwise -> project (2 blocks); the stream: the stem and both
    # projects writing, both expands and the head reading
    jp, _ = _both(m.apply, v, IMG, 5, 1)
    s = next(e for e in jp.equalized if e.writers)
    assert len(s.writers) == 2 and len(s.seconds) == 3, str(jp)


@pytest.mark.parametrize("tail, why", [
    (jnp.tanh, "not positively homogeneous"),
    (lambda x: x * x, "a product of two values of the stream"),
    (lambda x: jnp.minimum(x, 6.0), "not positively homogeneous"),
    # the stream added to itself with its channels moved to the width axis (8 = 8)
    (lambda x: x + jnp.swapaxes(x, 2, 3), "its channels reach an add along two different"),
])
def test_what_a_stream_cannot_pass_leaves_it_on_both_paths(tail, why):
    fn, v = _resnet(project=False, tail=tail)
    jp = equalized(fn, v, IMG, pairs=2)             # (conv1_i -> conv2_i only)
    _, rep, _, _ = _equalized(fn, v, IMG)
    for out in (jp, rep):
        assert len(out.equalized) == 2 and not any(e.writers for e in out.equalized)
        left = [n.reason for n in out.not_equalized if "stem" in n.kernel]
        assert left and "residual stream" in left[0] and why in left[0], str(out)


def test_leaky_relu_on_the_stream_passes_on_both_paths():
    fn, v = _resnet(project=False, tail=lambda x: jax.nn.leaky_relu(x, 0.1))
    _both(fn, v, IMG, 3, 1)


def test_a_stream_returned_or_fed_by_the_input_is_left_on_both_paths():
    import flax.linen as nn

    class Net(nn.Module):
        out: bool

        @nn.compact
        def __call__(self, x):
            y = nn.relu(nn.Conv(3, (3, 3), name="c0")(x))
            if not self.out:       # (x + c1(y): the input added into the stream)
                z = x + nn.Conv(3, (3, 3), name="c1")(y)
                return nn.Dense(5)(z.mean((1, 2)))
            h = nn.relu(nn.Conv(3, (3, 3), name="c1")(y))
            z = y + nn.Conv(3, (3, 3), name="c2")(h)
            return nn.Dense(5)(z.mean((1, 2))), z
    for out, why in ((True, "the stream is a program output"),
                     (False, "a program input is added into the stream")):
        m = Net(out)
        v = spread_bn(m.init(jax.random.key(5), IMG))
        jp = equalized(m.apply, v, IMG, pairs=1)
        _, rep, _, _ = _equalized(m.apply, v, IMG)
        for res in (jp, rep):
            assert not any(e.writers for e in res.equalized), str(res)
            assert any(why in n.reason for n in res.not_equalized), str(res)


# ------------------------------------------------------------------ other libraries

@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
def test_haiku_resnet18_stages_on_both_paths():
    import haiku as hk

    def net(x, is_training):
        return hk.nets.ResNet18(10)(x, is_training=is_training)
    t = hk.without_apply_rng(hk.transform_with_state(net))
    params, state = spread_bn(t.init(jax.random.key(0), IMG, True))
    rng = np.random.default_rng(1)           # (Haiku starts the logits at zero)
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.asarray(rng.standard_normal(a.shape), a.dtype)
        if "logits" in jax.tree_util.keystr(p) else a, params)
    f = lambda ps, x: t.apply(ps[0], ps[1], x, False)[0]     # noqa: E731
    # 8 blocks' conv_0 -> conv_1 pairs; 4 stages' streams (the first from the stem's
    # max-pooled output; the others from a projecting block)
    jp, _ = _both(f, (params, state), IMG, 12, 4)
    assert [len(e.writers) for e in jp.equalized if e.writers] == [2, 2, 2, 2], str(jp)


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
def test_keras_mobilenetv2_streams_on_both_paths():
    """Keras' MobileNetV2: ReLU6 in every block leaves its pairs, but the linear
    bottlenecks' streams carry no activation and are equalized."""
    import keras
    keras.utils.set_random_seed(0)        # (its weights the same in every run)
    m = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                       classes=10)
    ws = spread_keras(m)
    f = lambda ws, x: m.stateless_call(ws[0], ws[1], x)[0]      # noqa: E731
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 32, 3)), jnp.float32)
    jp, _ = _both(f, ws, x, 7, 5)
    assert any("relu6" in n.reason for n in jp.not_equalized), str(jp)


def test_bfloat16_streams_are_bit_exact_on_both_paths():
    """bfloat16 weights: every scale a power of two, the outputs the fold's bit for bit."""
    fn, v = _resnet()
    eq, rep = bit_for_bit(fn, jax.tree.map(lambda a: a.astype(jnp.bfloat16), v),
                          IMG.astype(jnp.bfloat16))
    assert sum(bool(e.writers) for e in eq.equalized) == 2
    assert sum(bool(e.writers) for e in rep.equalized) == 2


def test_a_stream_rounded_to_bfloat16_on_the_way_gets_powers_of_two_on_both_paths():
    """float32 weights, but the stream cast to bfloat16 and back between blocks: scaled by
    arbitrary scales it would round differently, so its scales are powers of two and the
    outputs are the fold's bit for bit."""
    fn, v = _resnet(project=False,
                    tail=lambda x: x.astype(jnp.bfloat16).astype(jnp.float32))
    eq, rep = bit_for_bit(fn, v, IMG)
    assert sum(bool(e.writers) for e in eq.equalized) == 1
    assert sum(bool(e.writers) for e in rep.equalized) == 1


@pytest.mark.parametrize("sweeps", [1, None])
def test_sweeps_stopped_before_the_scales_settle_are_said_on_both_paths(monkeypatch, sweeps):
    """Chains and streams coupled in cycles take several sweeps to settle; where the bound
    stops them first, both reports say so (exact either way); where they settle, they do not."""
    from hlofold._quant.core import equalize as core
    if sweeps is not None:
        monkeypatch.setattr(core, "SWEEPS", sweeps)
    fn, v = _resnet()
    jp, rep = _both(fn, v, IMG, 5, 2)
    for out in (jp, rep):
        said = [e for e in out.equalized if not e.settled]
        if sweeps is None:
            assert not said and "not settled" not in str(out), str(out)
            assert all(1 < e.sweeps < core.SWEEPS for e in out.equalized), str(out)
            continue
        assert len(said) == len(out.equalized), str(out)
        assert all(e.sweeps == 1 and e.moving > core.SETTLED for e in said)
        assert str(out).count("; not settled after 1 sweeps (its scales still moving") == 5, \
            str(out)
    if sweeps is not None:        # (the StableHLO report's JSON, as the CLI writes it)
        assert {e["settled"] for e in json.loads(json.dumps(rep.to_dict()))["equalized"]} \
            == {False}


@pytest.mark.slow
def test_fold_params_equalizes_streams_from_eight_threads_as_from_one():
    """``fold_params(..., equalize=True)`` called from several threads at once (one model
    function shared, as a server shares it): each gets the single-threaded streams and the
    same new parameters, bit for bit."""
    from tests.helpers import in_threads
    fn, v = _resnet()
    gfn, gp, gx, _, _ = program(1)
    jobs = [(fn, v, IMG), (gfn, gp, gx)]

    def run(job):
        out = hlofold.fold_params(*job, equalize=True)
        return (len(out.equalized), sum(bool(e.writers) for e in out.equalized),
                [np.asarray(a) for a in jax.tree.leaves(out.params)])
    want = [run(j) for j in jobs]
    assert [w[:2] for w in want] == [(5, 2), (4, 2)]
    got = []
    in_threads(lambda k: got.append((k % 2, run(jobs[k % 2]))), 8, 1e-5)
    assert len(got) == 8
    for k, (n, s, leaves) in got:
        assert (n, s) == want[k][:2]
        assert all(np.array_equal(a, b) for a, b in zip(leaves, want[k][2]))


@pytest.mark.slow
def test_efficientnet_b0_exported_by_pytorch_xla_equalizes_its_streams():
    """A real exporter's module (torchvision's EfficientNet-B0 through PyTorch/XLA, weights
    as arguments, ``batch_norm_inference``): the MBConv blocks' skip adds make 5 streams (the
    project convolutions writing, the next expand convolutions reading); the SiLU pairs (a
    value read twice: ``x·sigmoid(x)``) and the squeeze-excite gates are left, saying why; the
    outputs kept."""
    from hlofold._ir.stablehlo.artifacts import module_callable
    from tests.fold.stablehlo.test_deep import effnet
    text, names, weights, x, _ = effnet()
    full = [weights[f"arg{i}"] if n != "input" else x for i, n in enumerate(names)]
    ref = module_callable(text)(*full)[0]
    apply, rep, prep = hlofold.fold_stablehlo(text, params=weights, equalize=True)
    assert rel(ref, module_callable(apply)(x, *prep)[0]) <= 1e-5
    streams = [e for e in rep.equalized if e.writers]
    assert (len(rep.equalized), len(streams)) == (7, 5), str(rep)
    assert sorted(len(e.writers) for e in streams) == [1, 1, 2, 2, 3], str(rep)
    assert all(e.settled and e.spread_after[0] <= e.spread_before[0] for e in streams)
    reasons = " ".join(n.reason for n in rep.not_equalized)
    assert "stablehlo.logistic on the way is not positively homogeneous" in reasons
    assert "read 2 times, not only by layers" in reasons


def test_the_benchmarks_rounding_draws_keep_the_float_model():
    """``benchmarks/quantization_full.py --draws``: each draw's factors leave the float model
    as it was (rel ≤ 1e-5) but change the weights (so their rounding), and the patch is undone
    after each fold."""
    from benchmarks import quantization_full as qf
    from hlofold._quant.jaxpr import rewrite as _equalize
    from hlofold._quant.core import equalize as core
    fn, v = _resnet()
    before = (_equalize.equalize, core.SWEEPS)
    plain = hlofold.fold_params(fn, v, IMG, equalize=True).params
    for sweeps in (None, 0):
        drawn = qf.drawn(fn, v, IMG, np.random.default_rng(0), sweeps)
        assert (_equalize.equalize, core.SWEEPS) == before
        assert rel(fn(v, IMG), fn(drawn, IMG)) <= 1e-5
        moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(plain),
                                                           jax.tree.leaves(drawn))]
        assert sum(moved) >= 10, sum(moved)
