"""Trees holding PRNG keys (issue 69, item 7): Flax NNX state from a model built with
``rngs=`` holds key arrays (an extended dtype NumPy cannot hold: ``np.asarray`` raises), and
MaxText's scanned layers carry stacked keys. Key leaves, and any extended dtype, pass through
untouched on every path: ``fold`` (with ``freeze=`` too), ``fold_params`` (plain and with every
rewrite), ``fold_stablehlo(Exported, params=)`` (a key bound as its bits)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlofold
from benchmarks.quantization import smooth_case


def _case():
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)      # noqa: E731

    def f(p, x):
        y = lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jax.nn.relu((y - p["m"]) * lax.rsqrt(p["v"] + 1e-3) * p["g"] + p["b"])
        y = lax.conv_general_dilated(y, p["k2"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y, jax.random.uniform(p["rngs"]["dropout"], (2,)), p["stack"]
    p = {"k": w(3, 3, 3, 8), "m": w(8), "v": jnp.asarray(rng.random(8) + .5, jnp.float32),
         "g": w(8), "b": w(8), "k2": w(1, 1, 8, 4),
         "rngs": {"dropout": jax.random.key(0)}, "stack": jax.random.split(jax.random.key(1), 3)}
    return f, p, w(2, 6, 6, 3)


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("freeze", [(), 0])
def test_fold_with_key_leaves(freeze):
    f, p, x = _case()
    folded = hlofold.fold(f, freeze=freeze)                 # (raised: PRNGKey to NumPy)
    _same(folded(p, x), jax.jit(f)(p, x))
    assert folded.report(p, x).num_folded >= 1


def test_steady_calls_cost_what_jits_do_with_key_leaves(monkeypatch):
    """Item 8: a key array builds its aval anew on each read (~15 µs); a steady call of
    ``fold(f)`` read each key leaf's on every call (an NNX ViT holding 6 keys: 1.3–1.45×
    ``jax.jit``'s 0.27 ms). A leaf passed again is the same immutable array: its type is not
    read again; a new key of the same type, or of another shape, is still told apart."""
    f, p, x = _case()
    x = x.at[0, 0, 0, 0].set(1.0)
    p = dict(p, k2=jnp.zeros((1, 1, 8, 4)) + p["k2"])        # (not folded: a per-call input)
    folded, jitted = hlofold.fold(f), jax.jit(f)
    for _ in range(2):
        _same(folded(p, x), jitted(p, x))
    assert folded._fast is not None and folded._fast.avals is not None
    cls, reads = type(p["stack"]), []
    prop = cls.__dict__["aval"]
    monkeypatch.setattr(cls, "aval", property(lambda self: reads.append(1) or prop.fget(self)))

    def count(g, *a):
        del reads[:]
        jax.block_until_ready(g(*a))
        return len(reads)
    assert count(folded, p, x) <= count(jitted, p, x)          # (was: +2, one per key)
    _same(folded(p, x), jitted(p, x))
    new_key = dict(p, rngs={"dropout": jax.random.key(7)})      # same type, new object
    assert count(folded, new_key, x) <= count(jitted, new_key, x) + 1
    _same(folded(new_key, x), jitted(new_key, x))
    monkeypatch.undo()
    longer = dict(p, stack=jax.random.split(jax.random.key(1), 5))   # another type
    _same(folded(longer, x), jitted(longer, x))
    assert [o.shape for o in jax.tree.leaves(folded(longer, x))] == \
        [o.shape for o in jax.tree.leaves(jitted(longer, x))]


def test_the_fast_path_keeps_no_input_alive():
    """The steady-state checks refer to the per-call inputs weakly: an input batch (or key)
    the caller drops is freed, as after a ``jax.jit`` call."""
    import gc
    import weakref
    f, p, x = _case()
    folded = hlofold.fold(f)
    for _ in range(2):
        folded(p, x)
    assert folded._fast is not None
    ref, key = weakref.ref(x), weakref.ref(p["rngs"]["dropout"])
    del x, p
    gc.collect()
    assert ref() is None and key() is None


@pytest.mark.parametrize("kw", [{}, {"equalize": True}, {"smooth": "calib"}])
def test_fold_params_passes_key_leaves_through(kw):
    f, p, x = _case()
    kw = {"smooth": [x, x * 2]} if kw.get("smooth") else kw
    out = hlofold.fold_params(f, p, x, **kw)
    assert out.changes and ((out.equalized + out.smoothed) or not kw), str(out)
    assert out.params["rngs"]["dropout"] is p["rngs"]["dropout"]
    assert out.params["stack"] is p["stack"]
    _same(f(out.params, x), f(p, x))


def test_rotation_with_a_key_leaf():
    f, p, x, _ = smooth_case("decoder", 0)
    pk = dict(p, rngs=jax.random.key(3))
    out = hlofold.fold_params(lambda q, t: f({k: v for k, v in q.items() if k != "rngs"}, t),
                              pk, *x, rotate=True)
    assert out.rotation.reason is None and out.params["rngs"] is pk["rngs"], str(out)


@pytest.mark.parametrize("equalize", [False, True])
def test_fold_stablehlo_binds_a_key_as_its_bits(equalize):
    """(``equalize=``: the rewrite's check on random inputs cannot draw a key input, and the
    report says the rewrite was not checked.)"""
    f, p, x = _case()
    leaves, tree = jax.tree.flatten(p)
    g = jax.jit(lambda *a: f(jax.tree.unflatten(tree, a[:-1]), a[-1]))
    exp = jax.export.export(g)(*leaves, x)
    apply, rep, prepared = hlofold.fold_stablehlo(   # (raised: PRNGKey to NumPy)
        exp, params={i: a for i, a in enumerate(leaves)}, equalize=equalize)
    assert rep.num_folded >= 1 and bool(rep.equalized) == equalize, str(rep)
    assert any("not checked on random inputs" in c for c in rep.compat) == equalize
    _same(apply.call(x, *prepared), g(*leaves, x))


def _scanned(keys_in_tree: bool):
    """A scanned stack (conv+BN per layer, as MaxText's ``scan_layers``) whose scan also
    carries one PRNG key per layer: a closure constant, or leaves of the tree."""
    L, C = 3, 8
    r = np.random.default_rng(2)
    p = {"k": r.standard_normal((L, C, C)), "g": r.uniform(0.5, 1.5, (L, C)),
         "b": r.standard_normal((L, C)), "m": r.standard_normal((L, C)),
         "v": r.uniform(0.5, 1.5, (L, C))}
    p = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
    keys = jax.random.split(jax.random.key(0), L)

    def run(p, x, keys):
        def body(h, w):
            w, key = w
            y = (h @ w["k"] - w["m"]) * w["g"] * lax.rsqrt(w["v"] + 1e-5) + w["b"]
            return jax.nn.relu(y) + 0.0 * jax.random.uniform(key, y.shape), None
        return lax.scan(body, x, (p, keys))[0]
    x = jnp.asarray(r.standard_normal((4, C)), jnp.float32)
    if keys_in_tree:
        return (lambda q, x: run(q["p"], x, q["keys"])), {"p": p, "keys": keys}, x
    return (lambda p, x: run(p, x, keys)), p, x


@pytest.mark.parametrize("keys_in_tree", [False, True])
def test_a_scanned_stack_carrying_keys_folds_per_layer(keys_in_tree):
    """The stacked keys are read as no weight (``np.asarray`` of a key array had raised
    from the stack fold): every entry point folds the stack's layers."""
    f, p, x = _scanned(keys_in_tree)
    ref = jax.jit(f)(p, x)
    for ff in (hlofold.fold(f), hlofold.fold(f, freeze=0)):
        assert ff.report(p, x).num_folded == 1, str(ff.report(p, x))
        np.testing.assert_allclose(ff(p, x), ref, rtol=1e-5, atol=1e-5)
    out = hlofold.fold_params(f, p, x)
    assert len(out.changes) == 1 and out.changes[0].site.layers == 3, str(out)
    np.testing.assert_allclose(f(out.params, x), ref, rtol=1e-5, atol=1e-5)
