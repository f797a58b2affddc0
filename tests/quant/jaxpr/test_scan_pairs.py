"""Equalization and smoothing inside scanned layer stacks (issue 51, item 2: "scanned stacks
included"): a pair of a ``lax.scan`` body over stacked leaves is one pair per layer, each
with its own scales — the stacked rows equal what the same layers unrolled (each with
leaves of its own) get, the outputs stay within 1e-5, and a pair that cannot take per-layer
scales is left with the reason."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from benchmarks.quantization import smooth_case
from hlofold import examples
from tests.quant.jaxpr.test_equalize import rel
from tests.helpers.pair_programs import scanned_decoder_program

EXACT = 1e-5
PER_LAYER = "each of its {} layers its own scales"


def _exact(f, p, out, *x):
    for a, b in zip(jax.tree.leaves(f(p, *x)), jax.tree.leaves(f(out.params, *x))):
        assert rel(a, b) <= EXACT, (rel(a, b), str(out))


def _rows_match(stacked, per_layer, order=None):
    """Row l of every stacked leaf equals layer l's own leaf (as the unrolled model's
    rewrite left it), to rounding."""
    for i, lp in enumerate(per_layer):
        row = jax.tree.map(lambda a: np.asarray(a)[i], stacked)
        for a, b in zip(jax.tree.leaves(row), jax.tree.leaves(lp)):
            np.testing.assert_allclose(a, np.asarray(b), rtol=2e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_generated_scanned_decoders(seed):
    """Random decoder layers (decoder_program's: readers, heads, multi-head v/o, β, ops that
    stop a path) stacked 1–3 deep, forward or reversed, unrolled by 1, 2 or whole: smoothing
    and equalizing the scan gives every layer the rows the unrolled layers get."""
    rng = np.random.default_rng(seed)
    layers, reverse = int(rng.integers(1, 4)), bool(rng.integers(2))
    unroll = [1, 2, True][int(rng.integers(3))]
    scanned, sp, unrolled, up, x, calib, per_layer = scanned_decoder_program(
        seed, layers, reverse, unroll)
    out = hlofold.fold_params(scanned, sp, x, smooth=calib)
    ref = hlofold.fold_params(unrolled, up, x, smooth=calib)
    assert len(out.smoothed) == per_layer + 1, str(out)            # (+ the final norm)
    assert len(ref.smoothed) == per_layer * layers + 1, str(ref)
    inside = [e for e in out.smoothed if PER_LAYER.format(layers) in e.location]
    assert len(inside) == per_layer, str(out)
    assert all(np.isfinite(e.scale_range).all() for e in inside)
    _exact(scanned, sp, out, x)
    _rows_match(out.params["layers"], ref.params["layers"])
    eq = hlofold.fold_params(scanned, sp, x, equalize=True)
    eq_ref = hlofold.fold_params(unrolled, up, x, equalize=True)
    assert len(eq_ref.equalized) == layers * sum(
        PER_LAYER.format(layers) in e.location for e in eq.equalized) + sum(
        "scanned" not in e.location for e in eq.equalized), (str(eq), str(eq_ref))
    _exact(scanned, sp, eq, x)
    _rows_match(eq.params["layers"], eq_ref.params["layers"])


def test_builtin_scanned_decoder():
    """The MaxText-style built-in decoder (one scan over stacked layers, DenseGeneral q/k/v
    and o): smoothed as its unrolled form is — both norms, v -> o, up -> down per layer,
    and the final norm — exactly, every stacked leaf the unrolled rewrite's layers."""
    f0, p, x, calib = smooth_case("decoder", 0)          # (3 massive residual channels)
    sp = examples.stack_decoder(p)
    flat = hlofold.fold_params(f0, p, *x, smooth=calib)
    out = hlofold.fold_params(examples.scanned_decoder_apply, sp, *x, smooth=calib)
    assert len(flat.smoothed) == 2 * 4 + 1 and len(out.smoothed) == 4 + 1, str(out)
    firsts = sorted(e.first for e in out.smoothed)
    assert firsts == ["['final_norm']"] + [f"['layers']['{n}']"
                                            for n in ("attn_norm", "mlp_norm", "up", "v")]
    f = examples.scanned_decoder_apply
    _exact(f, sp, out, *x)
    same = examples.stack_decoder(flat.params)["layers"]     # the unrolled rewrite, stacked
    for n, a in same.items():
        np.testing.assert_allclose(out.params["layers"][n], a, rtol=2e-5, atol=1e-7)


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(32)(nn.RMSNorm()(x))
        return x + nn.Dense(16, use_bias=False)(nn.relu(h)), None


class _Stack(nn.Module):
    reverse: bool = False
    scanned: bool = True
    remat: bool = False             # each layer nn.remat (a checkpoint), as MaxText's are

    @nn.compact
    def __call__(self, x):
        layer = nn.remat(_Layer) if self.remat else _Layer
        if self.scanned:
            x, _ = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=3, reverse=self.reverse)(name="stack")(x, None)
        else:
            for i in (2, 1, 0) if self.reverse else (0, 1, 2):
                x, _ = layer(name=f"L{i}")(x, None)
        return nn.Dense(5)(x)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("rewrite", ["smooth", "equalize"])
@pytest.mark.parametrize("remat", [False, True])
def test_flax_nn_scan(reverse, rewrite, remat):
    """Flax linen ``nn.scan`` over RMSNorm → Dense → ReLU → Dense layers: per layer, the
    norm's γ with Dense_0 (smoothing) and Dense_0 with Dense_1 (both), as the same layers
    unrolled get them; Dense_1 → the residual is left with its reason. With each layer
    ``nn.remat`` (a ``checkpoint`` in the scan's body, and around each unrolled layer) the
    same: a checkpoint is read as if inlined."""
    rng = np.random.default_rng(0)
    m, flat = _Stack(reverse, remat=remat), _Stack(reverse, scanned=False, remat=remat)
    x = jnp.ones((2, 16))
    v = m.init(jax.random.key(0), x)
    v = jax.tree.map(lambda a: a * jnp.asarray(10 ** rng.uniform(-1, 1, a.shape), a.dtype), v)
    stack = v["params"]["stack"]
    fv = {"params": {"Dense_0": v["params"]["Dense_0"],
                     **{f"L{i}": jax.tree.map(lambda a, i=i: a[i], stack) for i in range(3)}}}
    xs = [jnp.asarray(rng.standard_normal((4, 16)) * np.r_[20, 20, np.ones(14)], jnp.float32)
          for _ in range(3)]
    kw = {"smooth": xs} if rewrite == "smooth" else {"equalize": True}
    out = hlofold.fold_params(m.apply, v, xs[0], **kw)
    ref = hlofold.fold_params(flat.apply, fv, xs[0], **kw)
    n = 2 if rewrite == "smooth" else 1
    assert len(out.equalized + out.smoothed) == n and \
        len(ref.equalized + ref.smoothed) == 3 * n, str(out)
    assert all("stack" in e.first and PER_LAYER.format(3) in e.location
               for e in (out.equalized + out.smoothed))
    assert any("Dense_1" in e.kernel and "residual" in e.reason and "scanned stack" in
               e.location for e in (out.not_equalized + out.not_smoothed)), str(out)
    _exact(m.apply, v, out, xs[1])
    _rows_match(out.params["params"]["stack"],
                [ref.params["params"][f"L{i}"] for i in range(3)])


def _norm_dense(x, g, k1, k2):
    h = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g
    return x + jax.nn.relu(h @ k1) @ k2


def _stack_case(seed=0, layers=3, d=8):
    rng = np.random.default_rng(seed)
    p = {"g": jnp.asarray(10 ** rng.uniform(-1, 1, (layers, d)), jnp.float32),
         "k1": jnp.asarray(rng.standard_normal((layers, d, 12)), jnp.float32),
         "k2": jnp.asarray(rng.standard_normal((layers, 12, d)), jnp.float32)}
    xs = [jnp.asarray(rng.standard_normal((3, d)) * np.r_[30, np.ones(d - 1)], jnp.float32)
          for _ in range(3)]
    return p, xs


def test_a_weight_shared_by_every_layer_leaves_the_pair():
    """γ one vector for every layer (a scan constant) beside per-layer kernels: the norm
    cannot take a per-layer scale, so γ → k1 is left with the reason; k1 → k2 (both
    stacked) is still smoothed per layer."""
    p, xs = _stack_case()
    p = {**p, "g": p["g"][0]}

    def f(p, x):
        return lax.scan(lambda h, k: (_norm_dense(h, p["g"], *k), None), x,
                        (p["k1"], p["k2"]))[0]
    out = hlofold.fold_params(f, p, xs[0], smooth=xs)
    assert [e.first for e in out.smoothed] == ["['k1']"], str(out)
    assert any(e.kernel == "['g']" and "one value for every scanned layer" in e.reason
               for e in out.not_smoothed), str(out)
    _exact(f, p, out, xs[1])


def test_a_weight_read_outside_the_scan_too_leaves_the_pair():
    p, xs = _stack_case()

    def f(p, x):
        y = lax.scan(lambda h, k: (_norm_dense(h, *k), None), x, (p["g"], p["k1"], p["k2"]))[0]
        return y, p["k1"].sum()
    out = hlofold.fold_params(f, p, xs[0], smooth=xs)
    assert [e.first for e in out.smoothed] == [], str(out)
    assert {e.kernel for e in out.not_smoothed if "outside the scan" in e.reason} == \
        {"['g']", "['k1']"}, str(out)
    _exact(f, p, out, xs[1])


def test_weights_shared_by_every_layer_take_one_scale():
    """A weight-tied stack (every leaf a scan constant: the same layer applied three
    times): its pairs take one scale for all layers, from every layer's activations."""
    p, xs = _stack_case()
    p = {k: v[0] for k, v in p.items()}

    def f(p, x):
        return lax.scan(lambda h, _: (_norm_dense(h, p["g"], p["k1"], p["k2"]), None), x,
                        None, length=3)[0]
    out = hlofold.fold_params(f, p, xs[0], smooth=xs)
    assert sorted(e.first for e in out.smoothed) == ["['g']", "['k1']"], str(out)
    assert all("one scale for every layer" in e.location for e in out.smoothed)
    _exact(f, p, out, xs[1])


def cnn_stack(L: int = 3, c: int = 4):
    """conv → BatchNorm → ReLU → conv → BatchNorm, plus the input, per layer of a scan over
    stacked kernels and BN statistics: ``(scanned, params, x)``, and ``scanned.layer``."""
    rng = np.random.default_rng(3)

    def conv(h, k):
        return lax.conv_general_dilated(h, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def bn(y, q):
        return (y - q["m"]) * lax.rsqrt(q["v"] + 1e-5) * q["g"] + q["b"]

    def layer(h, lp):
        y = jax.nn.relu(bn(conv(h, lp["k1"]), lp["bn1"]))
        return h + bn(conv(y, lp["k2"]), lp["bn2"])

    def bnp():
        return {"g": 10 ** rng.uniform(-1, 1, (L, c)), "b": rng.standard_normal((L, c)),
                "m": rng.standard_normal((L, c)), "v": np.exp(rng.standard_normal((L, c)))}
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), {
        "k1": rng.standard_normal((L, 3, 3, c, c)) * 10 ** rng.uniform(-1, 1, (L, 1, 1, 1, c)),
        "k2": rng.standard_normal((L, 3, 3, c, c)), "bn1": bnp(), "bn2": bnp()})
    x = jnp.asarray(rng.standard_normal((2, 6, 6, c)), jnp.float32)

    def scanned(p, x):
        return lax.scan(lambda h, lp: (layer(h, lp), None), x, p)[0]
    scanned.layer = layer
    return scanned, p, x


def test_cnn_stack_folds_then_equalizes_per_layer():
    """The stack of :func:`cnn_stack`: fold_params folds every layer's BNs into its stacked
    kernels and biases, then equalizes conv1 → conv2 per layer, as the unrolled stack."""
    L = 3
    scanned, p, x = cnn_stack(L)

    def unrolled(ps, x):
        for lp in ps:
            x = scanned.layer(x, lp)
        return x
    per = [jax.tree.map(lambda a, i=i: a[i], p) for i in range(L)]
    out = hlofold.fold_params(scanned, p, x, equalize=True)
    ref = hlofold.fold_params(unrolled, per, x, equalize=True)
    assert len(out.equalized) == 1 and len(ref.equalized) == L, (str(out), str(ref))
    assert len(out.changes) == 2 and len(ref.changes) == 2 * L      # (both BNs folded)
    assert out.equalized[0].first == "['k1']" and out.equalized[0].seconds == ["['k2']"]
    assert out.equalized[0].biases == [b[3:] for b in ref.equalized[0].biases] == \
        ["['bn1']['m']", "['bn1']['b']"]      # (μ subtracted and β: both scaled with k1)
    _exact(scanned, p, out, x)
    _rows_match(out.params, ref.params)


def test_rows_read_at_a_counter_are_left_with_the_reason():
    """The fori_loop form (MaxText's ``params[k][i]``: a loop constant read at the counter):
    not paired, and the report says why and what form pairs."""
    p, xs = _stack_case()

    def f(p, x):
        return lax.fori_loop(0, 3, lambda i, h: _norm_dense(h, p["g"][i], p["k1"][i],
                                                            p["k2"][i]), x)
    out = hlofold.fold_params(f, p, xs[0], smooth=xs)
    assert out.smoothed == [], str(out)
    assert {e.kernel for e in out.not_smoothed if "loop's counter" in e.reason} == \
        {"['g']", "['k1']", "['k2']"}, str(out)
    _exact(f, p, out, xs[1])
