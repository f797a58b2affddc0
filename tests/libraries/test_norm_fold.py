"""LayerNorm/RMSNorm scales folded forward into the projections that read them (issue 12).

Each library's own layers build a pre-norm transformer block (norm → Q/K/V → attention → out,
norm → gate/up → down): γ (and β) of each norm fold into every linear consumer, the per-token
``rsqrt`` stays in the graph, and outputs match the unfolded program. The same blocks lowered
to StableHLO fold the same norms (issue 11: one forward walk for both paths).
"""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold._ir.stablehlo.artifacts import module_callable
from hlofold._base.reasons import reason_kind
from tests.helpers import (assert_close, assert_nothing_left_behind, fold_both, fold_checked,
                           lower_with_constants,
                           fold_jaxpr_checked, max_err, walk_eqns)
from tests.helpers.blocks import D, F, H, RNG, X, attention, decoder, flax_linen_block, perturb

def check_block(f, params, *, folds, freeze=True, written=None):
    """Both ways hlofold is called: params as inputs (the cost rule leaves every norm site:
    the per-token factor's pass stays; with ``fold_costly=True`` prepared) and frozen; and
    the folded weights written back into the library's own tree (``written`` sites, default
    all)."""
    left = hlofold.fold(f).report(params, X)
    assert left.num_folded == 0 and left.counts().get("left") == folds, str(left)
    assert all(s.cost["passes_removed"] == 0 and s.cost["held_bytes"] > 0
               for s in left.sites if s.status == "left")
    ff, rep, _, _ = fold_checked(f, params, X, folds=folds, fold_costly=True)
    wb = hlofold.fold_params(f, params, X)
    assert len(wb.changes) == (folds if written is None else written), str(wb)
    assert_close(f(params, X), f(wb.params, X))
    forward = [s for s in rep.folded]
    assert all(s.pattern == "affine_dot" and "mul" in s.absorbed for s in forward), str(rep)
    assert all(s.file and s.file.endswith(".py") for s in forward)
    if freeze:
        fold_checked(f, params, X, folds=folds, freeze=0)
    check_stablehlo(f, params, X, rep)
    return rep


def check_stablehlo(f, params, x, rep):
    """The block's lowering folds on StableHLO as its jaxpr did (``rep``): weights as
    module arguments (in the graph, guarded) and as constants; the same norm sites with the
    same notes (per-token factors kept, consumers), and the unfolded module's outputs; with
    constants, fewer multiplies than the original (the kept ``x·r`` once per norm)."""
    leaves, tree = jax.tree.flatten(params)
    flat = lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1])
    ref = np.asarray(f(params, x))
    want = [s.note for s in rep.folded]     # per-token factors, consumers: the same words
    for args, lowered, in_graph in [
            ((*leaves, x), lower_with_constants(jax.jit(flat), *leaves, x), True),
            ((x,), lower_with_constants(jax.jit(lambda x: f(params, x)), x), False)]:
        text = lowered.as_text()
        folded, srep = hlofold.fold_stablehlo(text, in_graph=in_graph)
        assert_nothing_left_behind(text, folded)
        forward = [s for s in srep.folded if s.pattern == "stablehlo_affine_dot"]
        if not in_graph:     # x·r written once per norm, not per projection: no more work
            assert folded.count("stablehlo.multiply") < text.count("stablehlo.multiply")
        assert [s.note for s in forward] == want, (str(rep), str(srep))
        assert len(srep.folded) == len(rep.folded), (str(rep), str(srep))
        assert_close(ref, np.asarray(jax.tree.leaves(module_callable(folded)(*args))[0]))


# ---------------------------------------------------------------- the libraries' own layers

@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_flax_linen(kind):
    import flax.linen as nn
    f, params = flax_linen_block(getattr(nn, kind))
    # the K projection has no bias: LayerNorm's β·W_k has no slot, so β stays in front as
    # β/γ (tests/front/test_front_shift.py) and all five are written
    rep = check_block(f, params, folds=5, written=5)
    scale_names = [n for s in rep.folded for n in s.params if "scale" in n]
    assert scale_names, "the report names the norm parameters"


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_flax_nnx(kind):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, r):
            self.n1, self.n2 = getattr(nnx, kind)(D, rngs=r), getattr(nnx, kind)(D, rngs=r)
            self.q, self.k, self.v, self.o = (nnx.Linear(D, D, rngs=r) for _ in range(4))
            self.g, self.u = nnx.Linear(D, F, rngs=r), nnx.Linear(D, F, rngs=r)
            self.d = nnx.Linear(F, D, rngs=r)

        def __call__(self, x):
            h = self.n1(x)
            x = x + self.o(attention(self.q(h), self.k(h), self.v(h)))
            h = self.n2(x)
            return x + self.d(jax.nn.silu(self.g(h)) * self.u(h))

    graph, state = nnx.split(Block(nnx.Rngs(0)))
    check_block(lambda s, x: nnx.merge(graph, s)(x), perturb(state), folds=5)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_haiku(kind):
    import haiku as hk

    def block(x):
        norm = (lambda: hk.LayerNorm(-1, True, True)) if kind == "LayerNorm" else \
            (lambda: hk.RMSNorm(-1))
        h = norm()(x)
        x = x + hk.Linear(D)(attention(hk.Linear(D)(h), hk.Linear(D)(h), hk.Linear(D)(h)))
        h = norm()(x)
        return x + hk.Linear(D)(jax.nn.silu(hk.Linear(F)(h)) * hk.Linear(F)(h))

    t = hk.without_apply_rng(hk.transform(block))
    check_block(t.apply, perturb(t.init(jax.random.key(0), X)), folds=5)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_equinox(kind):
    import equinox as eqx
    keys = iter(jax.random.split(jax.random.key(0), 8))

    class Block(eqx.Module):
        n1: eqx.Module
        n2: eqx.Module
        lin: list

        def __call__(self, x):                      # x: (T, D), tokens vmapped
            tok = lambda layer, a: jax.vmap(layer)(a)
            q, k, v, o, g, u, d = self.lin
            h = tok(self.n1, x)
            a = attention(tok(q, h)[None], tok(k, h)[None], tok(v, h)[None])[0]
            x = x + tok(o, a)
            h = tok(self.n2, x)
            return x + tok(d, jax.nn.silu(tok(g, h)) * tok(u, h))

    norm = getattr(eqx.nn, kind)
    dims = [(D, D)] * 4 + [(D, F), (D, F), (F, D)]
    model = perturb(Block(norm(D), norm(D),
                          [eqx.nn.Linear(i, o, key=next(keys)) for i, o in dims]))
    params, static = eqx.partition(model, eqx.is_array)
    f = lambda p, x: jax.vmap(eqx.combine(p, static))(x)
    check_block(f, params, folds=5)


@pytest.mark.parametrize("kind", ["LayerNormalization", "RMSNormalization", "rms_scaling"])
def test_keras(kind):
    import keras
    from keras import layers

    def norm():
        if kind == "rms_scaling":
            return layers.LayerNormalization(rms_scaling=True)
        return getattr(layers, kind)()

    inp = keras.Input((5, D))
    h = norm()(inp)
    q, k, v = (layers.Dense(D)(h) for _ in range(3))
    x = inp + layers.Dense(D)(layers.Lambda(lambda a: attention(*a))([q, k, v]))
    check_keras_mlp(inp, x, norm)


def check_keras_mlp(inp, x, norm):
    """The block's second half (norm → gate/up → down, residual), its weights made
    trained-looking, checked as every block is (:func:`check_block`, 5 folds)."""
    import keras
    from keras import layers, ops
    h = norm()(x)
    y = x + layers.Dense(D)(ops.silu(layers.Dense(F)(h)) * layers.Dense(F)(h))
    model = keras.Model(inp, y)
    for w in model.weights:
        w.assign(perturb(np.asarray(w.value)))
    weights = [w.value for w in model.trainable_variables]
    check_block(lambda w, x: model.stateless_call(w, [], x)[0], weights, folds=5)


# ---------------------------------------------------------------- decoder stacks, by hand

@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["llama", "gemma"])
def test_decoder_stack(spelling):
    f, p = decoder(spelling)
    tokens = jnp.asarray(RNG.integers(0, 32, (2, 5)), jnp.int32)
    assert hlofold.fold(f).report(p, tokens).counts().get("left") == 11   # the cost rule
    ff, rep, _, _ = fold_checked(f, p, tokens, folds=11, fold_costly=True)
    ff, rep, _, _ = fold_checked(f, p, tokens, folds=11, freeze=0)
    check_stablehlo(f, p, tokens, rep)
    folded = ff.jaxpr(p, tokens)
    # the norms' scales are gone: no multiply by a (D,) vector is left
    muls = [e for e, _ in walk_eqns(folded) if e.primitive.name == "mul"
            and any(getattr(v, "aval", None) is not None and v.aval.shape == (D,)
                    for v in e.invars)]
    assert muls == [], "a norm scale is still multiplied in the folded program"
    head = [s for s in rep.folded if "embed" in (s.kernel or "")]
    assert len(head) == 1 and "final" in " ".join(head[0].params), str(rep)


# ---------------------------------------------------------------- refusals

def test_non_linear_consumer_refuses_every_consumer():
    g = jnp.asarray(1 + 0.3 * RNG.standard_normal(D), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((D, D)), jnp.float32)

    def f(x, g, w):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g
        return h @ w, h @ (2 * w), jnp.tanh(h)

    _, rep = fold_jaxpr_checked(f, X, g, w, folds=0)
    refused = [s for s in rep.refused if s.pattern == "affine_dot"]
    assert len(refused) == 2
    assert all("tanh" in s.reason and "linear" in s.reason for s in refused), str(rep)
    (_, srep, _, _), = same_on_stablehlo(f, X, g, w)
    refused = [s for s in srep.refused if s.pattern == "stablehlo_affine_dot"]
    assert len(refused) == 2 and srep.num_folded == 0
    assert all("tanh" in s.reason and "linear" in s.reason for s in refused), str(srep)


def test_shift_before_a_per_token_factor_stays():
    """``(x + β₀)·r`` with ``r`` per token: β₀·r is per token and per channel, not a
    per-input-feature shift, so the chain stops at the token factor (γ still folds)."""
    b0 = jnp.asarray(RNG.standard_normal(D), jnp.float32)
    g = jnp.asarray(1 + 0.3 * RNG.standard_normal(D), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((D, D)), jnp.float32)

    def f(x, b0, g, w):
        y = x + b0
        return (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6) * g) @ w

    new, rep = fold_jaxpr_checked(f, X, b0, g, w, folds=1, in_graph="prepared")
    assert rep.folded[0].absorbed == ["mul"]
    assert "add" in [e.primitive.name for e, _ in walk_eqns(new)]
    (_, srep, _, folded), = same_on_stablehlo(f, X, b0, g, w)
    assert srep.folded[0].absorbed == ["multiply"] and "stablehlo.add" in folded


def test_per_token_statistic_is_not_a_parameter():
    """Unbatched (one token): the variance is a scalar, shaped like a per-channel scalar
    operand; it is a statistic of the activations and stays in the graph."""
    g = jnp.asarray(1 + 0.3 * RNG.standard_normal(D), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((D, D)), jnp.float32)

    def f(x, g, w):
        return (x * jax.lax.rsqrt(jnp.mean(x * x) + 1e-6) * g) @ w

    new, rep = fold_jaxpr_checked(f, X[0, 0], g, w, folds=1, in_graph="prepared")
    assert rep.folded[0].absorbed == ["mul"] and "per-token" in rep.folded[0].note
    assert "rsqrt" in [e.primitive.name for e, _ in walk_eqns(new)]
    (_, srep, _, folded), = same_on_stablehlo(f, X[0, 0], g, w)
    assert srep.folded[0].absorbed == ["multiply"] and "per-token" in srep.folded[0].note
    assert "stablehlo.rsqrt" in folded


def same_on_stablehlo(f, *args):
    """``f`` folded on both paths: the same decision and note per site, the same reason
    kind for each refusal, the unfolded outputs; returns the StableHLO result."""
    results, ref, _ = fold_both(f, *args)
    (_, rj, _, _), (_, rs, _, _) = results
    assert [(s.status, s.note, reason_kind(s.reason) if s.reason else None)
            for s in rj.sites if s.pattern == "affine_dot"] == \
        [(s.status, s.note, reason_kind(s.reason) if s.reason else None)
         for s in rs.sites if s.pattern == "stablehlo_affine_dot"], (str(rj), str(rs))
    for _, rep, out, _ in results:
        assert max_err(ref, out) <= 1e-5 * float(np.abs(ref).max()), str(rep)
    return results[1:]


def test_fold_report_names_each_norm_site():
    f, p = decoder("llama", layers=1)
    tokens = jnp.zeros((1, 3), jnp.int32)
    rep = hlofold.fold(f, fold_costly=True).report(p, tokens)
    norms = sorted(n for s in rep.folded for n in s.params)
    assert norms == sorted(["p['layers'][0]['n1']"] * 3 + ["p['layers'][0]['n2']"] * 2 +
                           ["p['final']"]), str(rep)
    assert all(s.file.endswith("blocks.py") and s.line for s in rep.folded)


# ---------------------------------------------------------------- multi-head projections


def _multi_head_attention(q, k, v):
    """q, k, v: (batch, tokens, heads, head_dim), as DenseGeneral/EinsumDense give them."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def test_flax_dense_general_multi_head():
    """Issue 39 item 2: ``nn.DenseGeneral`` q/k/v with (d, heads, head_dim) kernels (MaxText's
    and keras_hub's layout). RMSNorm's γ was never folded (the root was refused: "the rhs has
    2 free dimensions"); it folds forward along the contracted axis into each kernel, on both
    paths, written back into the tree."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.RMSNorm()(x)
            q, k, v = (nn.DenseGeneral((H, D // H), use_bias=False)(h) for _ in range(3))
            x = x + nn.DenseGeneral(D, axis=(-2, -1))(_multi_head_attention(q, k, v))
            h = nn.RMSNorm()(x)
            return x + nn.Dense(D)(jax.nn.silu(nn.Dense(F)(h)) * nn.Dense(F)(h))

    m = Block()
    params = perturb(m.init(jax.random.key(0), X))
    rep = check_block(m.apply, params, folds=5)
    heads = [s for s in rep.folded if "DenseGeneral" in (s.kernel or "")]
    assert len(heads) == 3 and all("RMSNorm_0" in " ".join(s.params) for s in heads), str(rep)
    wb = hlofold.fold_params(m.apply, params, X)
    kernels = {c.kernel for c in wb.changes}
    assert sum("DenseGeneral" in k for k in kernels) == 3, str(wb)


def test_keras_einsum_dense_multi_head():
    import keras
    from keras import layers

    inp = keras.Input((5, D))
    h = layers.RMSNormalization()(inp)
    q, k, v = (layers.EinsumDense("btd,dhk->bthk", (None, H, D // H))(h) for _ in range(3))
    a = layers.Lambda(lambda t: _multi_head_attention(*t))([q, k, v])
    x = inp + layers.EinsumDense("bthk,hkd->btd", (None, D))(a)
    check_keras_mlp(inp, x, layers.RMSNormalization)


def test_a_shift_in_front_of_a_multi_head_projection_folds_on_both_paths():
    """Issue 39 item 2: LayerNorm's β in front of a (d, heads, head_dim) kernel adds β·W, a
    bias over the (heads, head_dim) block the root's channels are: it folds forward with γ,
    on both paths, outputs equal, no normalization arithmetic left but the per-token factor.
    A multi-output kernel whose output dimensions are not contiguous (no block) is refused
    with the reason, the same on both paths, and nothing changes."""
    rng = np.random.default_rng(3)
    g, b = (jnp.asarray(1 + 0.3 * rng.standard_normal(D), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal((D, H, D // H)), jnp.float32)
    w_split = jnp.asarray(rng.standard_normal((H, D, D // H)), jnp.float32)

    def ln(x):
        m, var = jnp.mean(x, -1, keepdims=True), jnp.var(x, -1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(var + 1e-6) * g + b

    results, ref, same = fold_both(lambda x: jnp.einsum("btd,dhk->bthk", ln(x), w), X)
    assert same == {"jaxpr": False, "stablehlo": False}, same
    for path, rep, out, _ in results:
        assert rep.num_folded == 1 and rep.num_refused == 0, (path, str(rep))
        assert max_err(ref, out) <= 1e-5 * float(np.max(np.abs(ref))), path
    results, ref, same = fold_both(lambda x: jnp.einsum("btd,hdk->bthk", ln(x), w_split), X)
    assert same == {"jaxpr": True, "stablehlo": True}, same      # the program as given
    for path, rep, out, _ in results:
        assert rep.num_folded == 0 and rep.num_refused == 1, (path, str(rep))
        assert [reason_kind(r.reason) for r in rep.refused] == ["root"], (path, str(rep))
        assert "several output dimensions that are not one block" in rep.refused[0].reason


def test_a_per_head_affine_after_a_multi_head_projection_folds_on_both_paths():
    """Issue 39 item 2: a per-(head, head_dim) scale and bias after ``x · W (d, heads,
    head_dim)`` (``DenseGeneral``'s output features) fold backward into W and one bias over
    the (heads, head_dim) block, on both paths (the block is the channels: ``Block``); a
    bias alone is already canonical; a scale per head only (broadcast over head_dim) folds
    too."""
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((D, H, D // H)) * 0.2, jnp.float32)
    s = jnp.asarray(rng.uniform(0.5, 1.5, (H, D // H)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((H, D // H)) * 0.1, jnp.float32)
    per_head = s[:, :1]            # (H, 1): made outside (a constant, not a slice in the graph)
    cases = [(lambda x: jnp.einsum("btd,dhk->bthk", x, w) * s + t, "folded"),
             (lambda x: jnp.einsum("btd,dhk->bthk", x, w) + t, "canonical"),
             (lambda x: jnp.einsum("btd,dhk->bthk", x, w) * per_head + t, "folded")]
    for f, status in cases:
        results, ref, same = fold_both(f, X)
        for path, rep, out, _ in results:
            assert [x.status for x in rep.sites] == [status], (path, str(rep))
            assert max_err(ref, out) <= 1e-5 * float(np.max(np.abs(ref))), path
        assert same == {"jaxpr": status != "folded", "stablehlo": status != "folded"}, same


def test_a_per_head_affine_writes_back_into_dense_general():
    """``fold_params`` on Flax ``nn.DenseGeneral((heads, head_dim))`` followed by a
    per-(head, head_dim) scale parameter: the kernel and the (heads, head_dim) bias are
    rewritten, the scale set to ones, the unchanged model gives the same outputs."""
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.DenseGeneral((H, D // H))(x)
            return y * self.param("s", lambda k: jnp.asarray(
                np.random.default_rng(5).uniform(0.5, 1.5, (H, D // H)), jnp.float32))
    m = M()
    v = m.init(jax.random.PRNGKey(0), X)
    res = hlofold.fold_params(m.apply, v, X)
    assert len(res.changes) == 1, str(res)
    assert float(jnp.max(jnp.abs(res.params["params"]["s"] - 1))) == 0.0
    assert max_err(m.apply(v, X), m.apply(res.params, X)) <= 1e-5


def test_flax_layernorm_into_multi_head_attention():
    """Flax ``nn.LayerNorm`` → ``nn.MultiHeadDotProductAttention`` (q/k/v are DenseGeneral
    with (heads, head_dim) kernels and biases: every Flax ViT): γ and β fold forward into
    q, k and v (``fold``, outputs equal). ``fold_params`` writes them too: the query is
    divided by √head_dim after its bias, a constant no leaf holds, which stays in the
    program (the kernel and bias written are those before it)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.MultiHeadDotProductAttention(num_heads=H)(nn.LayerNorm()(x))
    m = Block()
    v = m.init(jax.random.PRNGKey(0), X)
    v = jax.tree_util.tree_map_with_path(
        lambda p, a: a + 0.3 * jnp.asarray(np.random.default_rng(len(str(p))).standard_normal(
            a.shape), a.dtype) if "LayerNorm" in str(p) else a, v)
    ref = m.apply(v, X)
    f = hlofold.fold(m.apply, fold_costly=True)
    assert max_err(ref, f(v, X)) <= 1e-5 * float(np.max(np.abs(ref)))
    rep = f.report(v, X)
    assert rep.num_folded >= 3 and not [s for s in rep.refused if "MultiHead" in (s.name_stack or "")
                                        and "several output" in (s.reason or "")], str(rep)
    res = hlofold.fold_params(m.apply, v, X)
    assert max_err(ref, m.apply(res.params, X)) <= 1e-5 * float(np.max(np.abs(ref)))
    assert len(res.changes) == 3 and not res.report.refused, str(res)
    assert any("LayerNorm_0" in str(p) for c in res.changes for p in c.identity)
    ln = res.params["params"]["LayerNorm_0"]
    assert np.all(np.asarray(ln["scale"]) == 1) and np.all(np.asarray(ln["bias"]) == 0)
    (q,) = [s for s in res.report.folded if s.note and "by a constant" in s.note]
    assert "div" in q.note
