"""@hlofold.fold: pytrees, statics, freeze, the prepare/apply split and its cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from hlofold import examples
from hlofold._front.dispatch import CHURN_LIMIT
from tests.helpers import assert_close, assert_no_scaling_after_convs, primitives

P = examples.init_resnet(10, width=8, seed=1)
X = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 32, 3)), jnp.float32)
NBN = examples.count_bn(P)
REF = jax.jit(examples.resnet_apply)(P, X)


def test_plain_and_jitted_inputs():
    for f in (examples.resnet_apply, jax.jit(examples.resnet_apply)):
        ff = hlofold.fold(f)
        assert_close(REF, ff(P, X))
        rep = ff.report(P, X)
        # every BN; the mean-pool's 1/(H·W) in front of the head's Dense is left by the cost
        # rule (it is computed in the reduction's loop: folding removes no pass, and would
        # hold a copy of the head's weights); frozen, it folds (test_freeze_by_number_and_name)
        assert rep.num_folded == NBN and rep.counts()["left"] == 1, str(rep)
        assert [s.pattern for s in rep.folded].count("conv_affine") == NBN
        left = next(s for s in rep.sites if s.status == "left")
        assert left.pattern == "affine_dot" and "reduce_sum" in left.reason
        assert left.cost == {"passes_removed": 0, "ops_removed": 2 * 64, "held_bytes": 64 * 10 * 4,
                             "rescaled": 0}
        assert {s.rescale for s in rep.folded} == {"prepared"}
        assert any("['stem']['bn']['mean']" in n for n in rep.folded[0].params)
        assert_no_scaling_after_convs(ff.jaxpr(P, X))


def test_apply_part_has_no_kernel_rescale_and_cache_is_used(monkeypatch):
    import hlofold._front.api as api
    ff = hlofold.fold(examples.resnet_apply)
    sp = ff.split(P, X)
    # the per-call part multiplies nothing: conv -> add -> relu ... (the head is a dot)
    assert "mul" not in primitives(sp.apply_jaxpr)
    assert "rsqrt" not in primitives(sp.apply_jaxpr)
    assert any("['mean']" in n for n in sp.prepared_from)
    assert sp.per_call[-1] == "x"
    prepared = sp.prepare(P, X)
    # folded kernels and biases are inputs of the apply program, not constants in its HLO
    # (the head's weight and bias are per-call inputs: left by the cost rule)
    assert len(prepared) == len(sp.apply_jaxpr.jaxpr.invars) - 3
    assert all(np.ndim(c) == 0 for c in sp.apply_jaxpr.consts)
    assert_close(REF, sp.apply(prepared, P, X))

    calls = []
    real = api.fold_with_values
    monkeypatch.setattr(api, "fold_with_values", lambda *a, **k: calls.append(1) or real(*a, **k))
    ff = hlofold.fold(examples.resnet_apply)
    ff(P, X), ff(P, X), ff(P, X * 2)
    assert len(calls) == 1, "prepared values are reused while the params are the same arrays"
    P2 = jax.tree.map(lambda a: a * 1.01, P)
    assert_close(jax.jit(examples.resnet_apply)(P2, X), ff(P2, X))
    assert len(calls) == 2, "new parameter arrays are prepared again"
    prog = ff._program_for((P, X), {})[0]
    assert len(prog.executables._entries) == 1, "same fold structure: no second compile"


def test_parameters_changing_every_call_run_the_original_program(monkeypatch):
    """Preparing costs O(|K|) on the host: parameters that change on every call (a training
    loop evaluating each step) switch the signature to the original program."""
    import hlofold._front.api as api
    calls = []
    real = api.fold_with_values
    monkeypatch.setattr(api, "fold_with_values", lambda *a, **k: calls.append(1) or real(*a, **k))
    ff = hlofold.fold(examples.resnet_apply)
    for k in range(8):
        pk = jax.tree.map(lambda a: a * (1 + 0.01 * k), P)
        assert_close(jax.jit(examples.resnet_apply)(pk, X), ff(pk, X))
    assert len(calls) == 1 + CHURN_LIMIT, "then no more preparing"
    prog = ff._program_for((P, X), {})[0]
    assert prog.churned
    # the report and repr say that calls run the original program, and why
    rep = ff.report(P, X)
    assert rep.running and "original program" in rep.running and "NOTE: calls run" in str(rep)
    assert rep.to_dict()["running"] == rep.running
    assert "1 of 1 input signatures run the original program" in repr(ff)
    # stable parameters keep their prepared values (no churn)
    fs = hlofold.fold(examples.resnet_apply)
    for _ in range(3):
        P1 = jax.tree.map(lambda a: a * 1.0, P)
        for _ in range(3):
            fs(P1, X)
    assert not fs._program_for((P, X), {})[0].churned
    assert fs.report(P, X).running is None and "NOTE" not in str(fs.report(P, X))
    assert repr(fs) == "<hlofold.fold of 'resnet_apply'>"


def test_steady_state_fast_path_checks_what_jit_checks():
    ff = hlofold.fold(examples.resnet_apply)
    ff(P, X)
    assert ff._fast is not None
    assert_close(REF, ff(P, X))
    X2 = X[:1]                                       # another shape: the full path
    assert_close(jax.jit(examples.resnet_apply)(P, X2), ff(P, X2))
    assert_close(REF, ff(P, X))
    P2 = dict(P, stem=jax.tree.map(lambda a: a + 0.5, P["stem"]))    # another parameter
    assert_close(jax.jit(examples.resnet_apply)(P2, X), ff(P2, X))
    assert_close(REF, ff(P, np.asarray(X)))          # a NumPy input of the same type
    key = hlofold._front.dispatch.leaf_key
    assert key(X) != key(X.astype(jnp.bfloat16)) != key(jnp.float32(1.0)), \
        "the per-call check tells dtypes and weak types apart"
    Pc = jax.tree.map(jnp.copy, P)
    ff = hlofold.fold(examples.resnet_apply)
    ff(Pc, X), ff(Pc, X)
    Pc["stem"]["conv"].delete()
    with pytest.raises(RuntimeError, match="deleted or donated"):
        ff(Pc, X)




def test_fast_path_tells_every_structure_change_apart():
    """The steady call checks the structure while it walks the arguments (flatten_up_to,
    which stops at the recorded leaves' places): what it lets through there — a subtree or
    None where a leaf was — and a container of another type with the same leaves must each
    take the full path and give what ``jax.jit`` gives."""
    @jax.tree_util.register_pytree_node_class
    class Wrapped:                 # a node that looks like the array it holds
        def __init__(self, a):
            self.a, self.shape, self.dtype = a, a.shape, a.dtype
            self.aval = getattr(a, "aval", None)

        def tree_flatten(self):
            return (self.a,), None

        @classmethod
        def tree_unflatten(cls, _, children):
            return cls(*children)

    def g(p, x):
        y = x[0] if isinstance(x, tuple) else x
        y = y.a * 2 if isinstance(y, Wrapped) else y
        for a, s in zip(p["w"], p["s"]):
            y = jnp.tanh(y * a + s)
        return y
    w, s = (jnp.arange(1.0, 4.0), jnp.arange(2.0, 5.0)), (jnp.ones(3), jnp.zeros(3))
    for x in (jnp.linspace(-1, 1, 3), np.linspace(-1, 1, 3, dtype=np.float32)):
        fg, jg = hlofold.fold(g), jax.jit(g)     # NumPy x: checked by leaf_key, not aval
        p = {"w": w, "s": s}
        assert_close(jg(p, x), fg(p, x))
        assert_close(jg(p, x), fg(p, x))
        assert fg._fast is not None
        for q, xx in [({"w": list(w), "s": s}, x),                # list for tuple
                      ({"w": (w[0], (w[1],)), "s": s}, x),        # a subtree at a leaf
                      ({"w": (w[0], None), "s": s}, x),           # None at a leaf
                      (p, (x,)), (p, None), (p, Wrapped(x))]:     # the input, wrapped
            fg(p, x)                                              # the fast path, primed
            try:
                want = jg(q, xx)
            except Exception as e:                                # noqa: BLE001
                with pytest.raises(type(e)):
                    fg(q, xx)
                continue
            assert_close(want, fg(q, xx))
    assert_close(jg(p, x), fg(p, x))
def test_numpy_params_are_not_cached_by_identity():
    pn = jax.tree.map(np.array, P)
    ff = hlofold.fold(examples.resnet_apply)
    assert_close(REF, ff(pn, X))
    pn["stem"]["bn"]["mean"] += 1.0          # mutate in place: must be seen
    ref2 = jax.jit(examples.resnet_apply)(pn, X)
    assert_close(ref2, ff(pn, X))


def test_freeze_by_number_and_name():
    for freeze in (0, "params"):
        ff = hlofold.fold(examples.resnet_apply, freeze=freeze)
        assert_close(REF, ff(P, X))
        rep = ff.report(P, X)
        assert rep.num_folded == NBN + 1 and {s.rescale for s in rep.folded} == {"constant"}
        assert any("['stem']['bn']['var']" in n for n in rep.folded[0].params)
        prims = primitives(ff.jaxpr(P, X))
        assert "rsqrt" not in prims and "mul" not in prims
    with pytest.raises(ValueError, match="freeze argname 'nope'"):
        hlofold.fold(examples.resnet_apply, freeze="nope")
    with pytest.raises(ValueError, match="argnum 5 is out of range"):
        hlofold.fold(examples.resnet_apply, freeze=5)


def test_refreeze_on_new_arrays():
    ff = hlofold.fold(examples.resnet_apply, freeze=0)
    ff(P, X)
    P2 = jax.tree.map(lambda a: a * 0.9, P)
    assert_close(jax.jit(examples.resnet_apply)(P2, X), ff(P2, X))


def test_static_argnums_of_jitted_input_and_pytree_io():
    def f(params, batch, *, mode):
        y = examples.resnet_apply(params, batch["img"])
        return {"logits": y, "twice": y * 2} if mode == "dict" else (y,)

    jf = jax.jit(f, static_argnames="mode")
    ff = hlofold.fold(jf)
    out = ff(P, {"img": X}, mode="dict")
    assert set(out) == {"logits", "twice"}
    assert_close(REF, out["logits"])
    out2 = ff(P, {"img": X}, mode="tuple")
    assert isinstance(out2, tuple) and len(out2) == 1
    assert len(ff._programs) == 2                      # one program per static value

    g = jax.jit(lambda n, params, x: examples.resnet_apply(params, x) * n, static_argnums=0)
    fg = hlofold.fold(g)
    assert_close(REF * 3, fg(3, P, X))


def test_inside_enclosing_jit_and_vmap():
    """Under the user's jit the parameters are tracers: by default the sites stay unfolded
    (the rescale would run every call) and the traced report says why; in_graph=True
    rescales in the graph, guarded."""
    ff = hlofold.fold(examples.resnet_apply)
    outer = jax.jit(lambda p, x: ff(p, x) + 1)
    assert_close(REF + 1, outer(P, X))
    rep = ff.traced_report(P, X)
    assert rep.num_folded == 0 and rep.num_refused == NBN and rep.counts()["left"] == 1, str(rep)
    assert all("prepare outside your jit" in s.reason for s in rep.refused)
    assert ff.report(P, X).num_folded == NBN        # direct calls fold (prepare step)
    jaxpr = jax.make_jaxpr(lambda p, x: ff(p, x))(P, X)
    assert primitives(jaxpr) == primitives(jax.make_jaxpr(examples.resnet_apply)(P, X))
    v = jax.vmap(lambda x: ff(P, x[None])[0])(X)
    assert_close(REF, v)

    fg = hlofold.fold(examples.resnet_apply, in_graph=True)
    assert_close(REF + 1, jax.jit(lambda p, x: fg(p, x) + 1)(P, X))
    rep = fg.traced_report(P, X)
    assert rep.num_folded == NBN and all(s.guarded for s in rep.folded), str(rep)
    assert [s.cost["rescaled"] for s in rep.sites if s.status == "left"] == [64 * 10]
    jaxpr = jax.make_jaxpr(lambda p, x: fg(p, x))(P, X)
    assert_no_scaling_after_convs(jaxpr)            # in-graph rescale on the kernel only
    assert primitives(jaxpr).count("cond") == NBN   # one run-time guard per site


def test_split_folds_everything_under_the_users_jit():
    """The documented way to fold every site under your own jit: prepare outside it."""
    ff = hlofold.fold(examples.resnet_apply)
    sp = ff.split(P, X)
    prepared = sp.prepare(P, X)
    apply = jax.jit(lambda pr, x: sp.apply(pr, P, x))
    assert_close(REF, apply(prepared, X))
    jaxpr = jax.make_jaxpr(lambda pr, x: sp.apply(pr, P, x))(prepared, X)
    assert_no_scaling_after_convs(jaxpr)
    assert "cond" not in primitives(jaxpr) and "rsqrt" not in primitives(jaxpr)


def test_lower_gives_folded_stablehlo():
    ff = hlofold.fold(examples.resnet_apply, freeze=0)
    text = ff.lower(P, X).as_text()
    assert text.count("stablehlo.convolution") == 12
    assert "rsqrt" not in text
    unfolded = jax.jit(examples.resnet_apply).lower(P, X).as_text()
    assert "rsqrt" in unfolded
    compiled = ff.lower(P, X).compile()
    assert_close(REF, compiled(X)[0] if isinstance(compiled(X), list) else compiled(X))


def test_nothing_to_fold_passes_through():
    f = hlofold.fold(lambda x: jnp.sin(x) * 2)
    np.testing.assert_allclose(f(X), jnp.sin(X) * 2)
    assert f.report(X).sites == []


def test_non_finite_input_params_refuse_their_site():
    bad = jax.tree.map(lambda a: a, P)
    bad["stem"]["bn"]["var"] = bad["stem"]["bn"]["var"].at[0].set(-1e-5)  # var + eps = 0
    ref = jax.jit(examples.resnet_apply)(bad, X)
    ff = hlofold.fold(examples.resnet_apply)
    out = ff(bad, X)
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(out))
    assert_close(np.nan_to_num(ref), np.nan_to_num(out))
    rep = ff.report(bad, X)
    assert rep.sites[0].status == "refused" and "not finite" in rep.sites[0].reason
    assert rep.num_folded == NBN - 1, "the other sites still fold"
    # a split made with good parameters does not take ones that fold differently
    with pytest.raises(ValueError, match="fold differently.*not finite"):
        ff.split(P, X).prepare(bad, X)
    # frozen: the site is refused at transform time instead, and the result is the same
    fz = hlofold.fold(examples.resnet_apply, freeze=0)
    rep = fz.report(bad, X)
    assert rep.sites[0].status == "refused" and "not finite" in rep.sites[0].reason
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(fz(bad, X)))


def test_persistent_compilation_cache_is_shared_across_parameter_values(tmp_path):
    """The apply program carries no weights (they are its arguments), so JAX's persistent
    compilation cache, keyed by the HLO, serves a second process with other parameter
    values, frozen or not: it adds no entry."""
    import subprocess
    import sys
    script = """
import sys, jax, hlofold
from hlofold import examples
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
p = examples.init_resnet(10, width=8, seed=int(sys.argv[2]))
x = jax.numpy.ones((1, 16, 16, 3))
hlofold.fold(examples.resnet_apply)(p, x).block_until_ready()
hlofold.fold(examples.resnet_apply, freeze=0)(p, x).block_until_ready()
"""
    cache = tmp_path / "cache"
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu"}

    def run(seed):
        r = subprocess.run([sys.executable, "-c", script, str(cache), str(seed)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return sorted(f.name for f in cache.iterdir())
    first = run(1)
    assert first, "the folded programs were cached"
    assert run(2) == first, "other parameter values: the same executables, no new entry"


def test_a_decoder_whose_sites_are_all_left_runs_jits_own_program():
    """The cost rule leaves every norm of a Llama-style decoder (issue 29): ``fold(f)`` then
    lowers to the StableHLO ``jax.jit(f)`` lowers to, op for op (only the module's name and
    the result's label differ), so its steady calls cost what jit's cost."""
    import re
    p = examples.init_decoder(2, d=64, ffn=128, vocab=256)
    tokens = jnp.zeros((1, 8), jnp.int32)
    g = hlofold.fold(examples.decoder_apply)
    rep = g.report(p, tokens)
    assert rep.num_folded == 0 and rep.counts()["left"] == 11, str(rep)

    def text(lowered):
        t = lowered.as_text()
        t = re.sub(r"module @\w+", "module", t)
        return re.sub(r'jax.result_info = "[^"]*"', "", t)
    assert text(g.lower(p, tokens)) == text(jax.jit(examples.decoder_apply).lower(p, tokens))
    assert_close(jax.jit(examples.decoder_apply)(p, tokens), g(p, tokens))
