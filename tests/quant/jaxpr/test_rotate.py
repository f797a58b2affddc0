"""``fold_params(..., rotate=True)``: the residual stream of a pre-norm decoder rotated by an
orthogonal Q once its norms' γ are folded (issue 51, item 3) — the embedding E·Q, the layers
writing into the stream W·Q, those reading it Qᵀ·W, LayerNorm's β·Q; for LayerNorm a Q with
Q·1 = 1, so the mean it takes out is the same — the same outputs (rel ≤ 1e-4), outliers
spread (w8a8 errs less), on Flax, Haiku, Equinox and Keras and on generated decoders; a γ not
folded, a tied embedding, what does not commute with Q refused with the reason."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from benchmarks.quantization import smooth_case, wxa8
from hlofold import examples
from tests.quant.jaxpr.test_equalize import rel

EXACT = 1e-4


def rotated(f, p, x, **kw):
    out = hlofold.fold_params(f, p, *x, rotate=True, **kw)
    assert out.rotation is not None and out.rotation.reason is None, str(out)
    for r, o in zip(jax.tree.leaves(f(p, *x)), jax.tree.leaves(f(out.params, *x))):
        assert rel(r, o) <= EXACT, rel(r, o)
    return out


def test_builtin_decoder():
    f, p, x, calib = smooth_case("decoder", 0)
    before = jax.tree.map(np.array, p)
    out = rotated(f, p, x)
    rot = out.rotation
    assert (rot.width, rot.kind, rot.embedding) == (128, "randomized Hadamard", "['embed']")
    assert len(rot.readers) == 11 and len(rot.writers) == 4      # q k v gate up ×2, head; o down ×2
    assert "['head']" in rot.readers and "['layers'][1]['down']" in rot.writers
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(p)):
        np.testing.assert_array_equal(a, np.asarray(b))            # nothing given is changed
    ref = f(p, *x)
    assert rel(ref, wxa8(f, out.params, *x)) < 0.75 * rel(ref, wxa8(f, p, *x))
    both = rotated(f, p, x, smooth=calib)                           # then smoothing
    assert len(both.smoothed) >= 7


@pytest.mark.parametrize("layers,d,seed", [(1, 32, 0), (3, 64, 1), (2, 48, 2), (2, 96, 3)])
def test_widths_and_depths(layers, d, seed):
    """Powers of two get a Hadamard matrix, other widths a random orthogonal one."""
    p = examples.init_decoder(layers, d=d, vocab=64, seed=seed)
    t = jnp.asarray(np.random.default_rng(seed).integers(0, 64, (2, 7)))
    out = rotated(lambda p, t: examples.decoder_apply(p, t, head_dim=16), p, (t,), seed=seed)
    assert out.rotation.kind == ("randomized Hadamard" if d & (d - 1) == 0
                                 else "random orthogonal (QR)")
    assert len(out.rotation.writers) == 2 * layers


def _not_rotated(f, p, x, why):
    out = hlofold.fold_params(f, p, *x, rotate=True)
    assert out.rotation.reason is not None and why in out.rotation.reason, str(out)
    for r, o in zip(jax.tree.leaves(f(p, *x)), jax.tree.leaves(f(out.params, *x))):
        assert rel(r, o) <= 1e-5
    return out


def _tiny(norm):
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa
    p = {"embed": w(16, 8), "g": jnp.asarray(1 + rng.random(8), jnp.float32), "w": w(8, 8),
         "o": w(8, 8), "gf": jnp.asarray(1 + rng.random(8), jnp.float32), "head": w(8, 16)}

    def f(p, t):
        x = p["embed"][t]
        x = x + norm(x, p["g"]) @ p["w"] @ p["o"]
        return norm(x, p["gf"]) @ p["head"]
    return f, p, (jnp.asarray([[1, 2, 3]]),)


def test_tiny_rms_decoder_rotates():
    def rms(x, g):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g
    out = rotated(*_tiny(rms))
    assert sorted(out.rotation.readers) == ["['head']", "['w']"]
    assert out.rotation.writers == ["['o']"]


@pytest.mark.parametrize("square", ["pow", "integer_pow", "square"])
def test_rms_written_with_a_power_rotates(square):
    """Keras' RMSNorm squares with ``ops.power(x, 2)`` (``pow`` by a literal 2; keras_hub's
    Llama): read as the square it is; ``x ** 3`` is not."""
    sq = {"pow": lambda x: jax.lax.pow(x, 2.0), "integer_pow": lambda x: x ** 2,
          "square": jnp.square}[square]

    def rms(x, g):
        return x * jax.lax.rsqrt(sq(x).mean(-1, keepdims=True) + 1e-6) * g
    rotated(*_tiny(rms))
    _not_rotated(*_tiny(lambda x, g: x * jax.lax.rsqrt(jnp.abs(jax.lax.pow(x, 3.0)).mean(
        -1, keepdims=True) + 1e-6) * g), "reads the residual stream")


def test_layernorm_rotates_keeping_the_mean():
    """LayerNorm's centering commutes with a Q that keeps the all-ones direction."""
    def ln(x, g):
        c = x - x.mean(-1, keepdims=True)
        return c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-6) * g
    out = rotated(*_tiny(ln))
    assert out.rotation.kind.endswith("keep the all-ones direction (LayerNorm's mean)")
    rms = rotated(*_tiny(lambda x, g: x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) +
                                                            1e-6) * g))
    assert rms.rotation.kind == "randomized Hadamard"     # RMSNorm: Q as it was


@pytest.mark.parametrize("d", [1, 2, 8, 12, 64, 256])
def test_a_rotation_keeping_the_ones_is_orthogonal_and_commutes_with_centering(d):
    from hlofold._quant.core.rotation import orthogonal
    q = orthogonal(d, seed=d, keep_ones=True)[0].dense()
    np.testing.assert_allclose(q @ q.T, np.eye(d), atol=1e-12)
    np.testing.assert_allclose(q @ np.ones(d), np.ones(d), atol=1e-12)
    np.testing.assert_allclose(np.ones(d) @ q, np.ones(d), atol=1e-12)
    x = np.random.default_rng(d).standard_normal((5, d))
    center = lambda y: y - y.mean(-1, keepdims=True)             # noqa: E731
    np.testing.assert_allclose(center(x @ q), center(x) @ q, atol=1e-12)
    if d >= 8:                                  # a massive channel is spread, not kept
        assert np.abs(q).max() < 0.9
    if d & (d - 1) == 0:            # the butterflies compute diag(±1)·H/√d's product
        plain = orthogonal(d, seed=d)[0]
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        np.testing.assert_allclose(np.abs(plain.dense()) * np.sqrt(d), 1.0, atol=1e-12)
        np.testing.assert_allclose(np.abs(plain.dense() @ h.T) / np.sqrt(d), np.eye(d), atol=1e-12)
        np.testing.assert_allclose(x @ plain, x @ plain.dense(), atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("lib", ["flax", "haiku", "equinox", "keras"])
@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_library_decoders_rotate(lib, norm):
    """Each library's own embedding, norms and dense layers (Flax: causal multi-head
    attention, the benchmark's decoder with 3 massive channels ×30)."""
    from tests.helpers import norm_decoders
    if lib == "flax":
        from benchmarks.quant_decoders import flax_decoder
        f, p, x, _ = flax_decoder(norm, 0)
        x = x[0]
    else:
        f, p, x = getattr(norm_decoders, f"{lib}_decoder")(norm)
    out = rotated(f, p, (x,))
    rot = out.rotation
    assert rot.kind.endswith("(LayerNorm's mean)") == (norm == "LayerNorm"), rot.kind
    has_beta = norm == "LayerNorm" or lib == "equinox"       # (Equinox's RMSNorm has a β)
    n_norms = 5 if lib == "flax" else 2
    assert len(rot.offsets) == (n_norms if has_beta else 0), str(out)
    if lib == "flax":
        ref = f(p, x)
        assert rel(ref, wxa8(f, out.params, x)) < 0.75 * rel(ref, wxa8(f, p, x))


@pytest.mark.parametrize("seed", range(30))
def test_generated_decoders_rotate_exactly(seed):
    """Generated decoders mixing the libraries' norm spellings, kernel-first reads,
    transposed writes, squeezed and scaled embeddings: rotated, the same outputs, the
    layers found as built, Q keeping the ones exactly where a norm centers."""
    from tests.helpers.rotate_programs import program
    fn, p, t, want = program(seed)
    rot = rotated(fn, p, (t,)).rotation
    assert (len(rot.readers), len(rot.writers), len(rot.offsets)) == \
        (want["readers"], want["writers"], want["offsets"]), (want, str(rot))
    assert rot.kind.endswith("(LayerNorm's mean)") == want["keep_ones"], (want, rot.kind)


@pytest.mark.parametrize("what", ["max_centered", "channel_shift", "shared_reader",
                                  "per_channel_mul", "token_sum", "scan_ys", "scan_xs",
                                  "rounded", "stored_bf16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_what_does_not_commute_with_q_is_refused(what, seed):
    from tests.helpers.rotate_programs import breaking
    fn, p, t, why = breaking(seed, what)
    _not_rotated(fn, p, (t,), why)


def test_unfolded_gamma_refused():
    def rms(x, g):
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g
        return h + 0 * jnp.tanh(h)            # a non-layer reader: γ cannot be folded
    _not_rotated(*_tiny(rms), "reads the normalized stream")


def test_tied_embedding_refused():
    from tests.helpers.blocks import decoder
    f, p = decoder("llama")
    _not_rotated(f, p, (jnp.asarray([[1, 2, 3]]),), "tied")


def test_a_cast_of_the_stream_to_an_integer_is_refused():
    """Rotating across ``astype(int32)`` would round rotated values: refused, said."""
    def rms(x, g):
        x = x.astype(jnp.int32).astype(jnp.float32)
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g
    f, p, t = _tiny(rms)
    p = dict(p, embed=p["embed"] * 100)              # (values an integer cast keeps)
    _not_rotated(f, p, t, "(not a float)")


def test_scanned_decoder_rotates_as_unrolled():
    """One ``lax.scan`` over the stacked layers (MaxText's form): the carry is the stream,
    one Q for every layer; each stacked row is what the unrolled decoder's layer gets."""
    p = examples.init_decoder(3, d=64, vocab=128, seed=0)
    t = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 7)))
    unrolled = rotated(examples.decoder_apply, p, (t,))
    sp = examples.stack_decoder(p)
    scanned = rotated(examples.scanned_decoder_apply, sp, (t,))
    assert (len(scanned.rotation.readers), len(scanned.rotation.writers)) == (6, 2)
    for a, b in zip(jax.tree.leaves(examples.stack_decoder(unrolled.params)),
                    jax.tree.leaves(scanned.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_flax_nn_scan_decoder_rotates(norm):
    from tests.helpers.norm_decoders import flax_scanned_decoder
    f, p, x = flax_scanned_decoder(norm)
    rot = rotated(f, p, (x,)).rotation
    assert rot.kind.endswith("(LayerNorm's mean)") == (norm == "LayerNorm"), rot.kind
    assert any("ScanBlock" in r for r in rot.readers), rot.readers


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
def test_rotation_and_a_searched_smoothing_from_many_threads():
    """``fold_params(rotate=True, smooth=, alpha="search:w4a8")`` called from eight threads
    at once, on two models and two seeds (the threads switching every microsecond): each
    gets, bit for bit, what the same call alone returns — nothing in the walk, the search's
    kept rows or its compiled products is shared between calls — and every tree is exact."""
    from tests.helpers import in_threads
    cases = [smooth_case("decoder", s) for s in (0, 1)]
    kw = lambda k: dict(rotate=True, smooth=cases[k % 2][3], alpha="search:w4a8",  # noqa: E731
                        seed=k // 2 % 2)
    alone = [hlofold.fold_params(*cases[k % 2][:2], *cases[k % 2][2], **kw(k)) for k in range(4)]
    got: dict = {}

    def work(k):
        f, p, x, _ = cases[k % 2]
        got[k] = hlofold.fold_params(f, p, *x, **kw(k))
    in_threads(work, 8)
    for k, out in got.items():
        want = alone[k % 4]
        assert out.rotation.reason is None and str(out) == str(want)
        for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(out.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        f, p, x, _ = cases[k % 2]
        assert rel(f(p, *x), f(out.params, *x)) <= EXACT
