"""Fifth adversarial round (issue 50): the decorator, the CLI and the StableHLO entry points
as a hostile user drives them. Each test fails on the code before the round."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
from tests.helpers import assert_close
from tests.helpers.conv_bn import conv_bn, conv_bn_params


def _conv_bn():
    p = jax.tree.map(jnp.asarray, conv_bn_params(np.random.default_rng(0), 4))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 6, 4)), jnp.float32)
    return p, x, jax.jit(conv_bn)(p, x)


@pytest.mark.parametrize("how", ["auto", "device", "freeze"])
@pytest.mark.parametrize("first", ["jit", "scan"])
def test_a_folded_function_first_called_under_a_trace_caches_no_tracer(how, first):
    """Item 5: the first call of a folded function happens inside the user's ``jax.jit``
    (the guide's own pattern) or ``lax.scan``, its parameters closed over: what it prepares
    then is cached for later calls, so it must be values, not the trace's tracers."""
    p, x, ref = _conv_bn()
    ff = hlofold.fold(conv_bn, freeze=0) if how == "freeze" else \
        hlofold.fold(conv_bn, prepare=how)
    if first == "jit":
        assert_close(ref, jax.jit(lambda x: ff(p, x))(x))
    else:
        out = jax.lax.scan(lambda h, _: (ff(p, h), None), x, None, length=1)[0]
        assert_close(ref, out)
    assert_close(ref, ff(p, x))                                     # plain, later
    assert_close(2 * ref, jax.jit(lambda x: 2 * ff(p, x))(x))       # under another jit
    assert_close(ref, ff(p, x))                                     # the steady path
    assert ff.report(p, x).num_folded == 1


# ------------------------------------------------------------------ the CLI's files


@pytest.fixture
def module_files(tmp_path):
    p, x, _ = _conv_bn()
    m = tmp_path / "m.mlir"
    m.write_text(jax.jit(conv_bn).lower(p, x).as_text())
    w = tmp_path / "w.npz"
    np.savez(w, **{f"arg{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(p))})
    return tmp_path, m, w


def _cli(*argv):
    from hlofold._front.cli import main
    return main([str(a) for a in argv])


@pytest.mark.parametrize("argv, clash", [
    (["fold", "{m}", "-o", "{d}/o.mlir", "--params", "{w}", "--prepared-out", "{d}/o.mlir"],
     "--prepared-out"),
    (["fold", "{m}", "-o", "{d}/o.mlir", "--report", "{m}"], "--report"),
    (["fold", "{d}/link.mlir", "-o", "{m}"], "-o"),
    (["fold", "{m}", "-o", "{d}/o.mlir", "--params", "{w}", "--prepared-out", "{w}"],
     "--prepared-out"),
    (["verify", "{m}", "{m}", "--json", "{m}"], "--json"),
])
def test_outputs_that_collide_are_refused_before_anything_is_written(module_files, argv,
                                                                     clash, capsys):
    """Item 7: an output naming the input (through a link too) or another output."""
    d, m, w = module_files
    (d / "link.mlir").symlink_to(m)
    before = {f: f.read_bytes() for f in d.iterdir() if f.is_file()}
    rc = _cli(*[a.format(m=m, w=w, d=d) for a in argv])
    assert rc == 2 and f"{clash} " in capsys.readouterr().err
    assert {f: f.read_bytes() for f in d.iterdir() if f.is_file()} == before
    assert not (d / "o.mlir").exists()


def test_a_failing_write_leaves_no_output_and_modes_follow_the_umask(module_files,
                                                                     monkeypatch, capsys):
    """Item 8: every output is written to a temporary beside it and renamed at the end, all
    or none; a new file gets the umask's mode, a replaced one keeps its own."""
    import os
    d, m, w = module_files
    real = os.replace

    def failing(src, dst):
        if str(dst).endswith("o.mlir"):
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)
    monkeypatch.setattr(os, "replace", failing)
    (d / "r.json").write_text("an older report")
    rc = _cli("fold", m, "-o", d / "o.mlir", "--report", d / "r.json", "--params", w,
              "--prepared-out", d / "p.npz")
    assert rc == 2 and "No space left" in capsys.readouterr().err
    monkeypatch.setattr(os, "replace", real)
    assert not (d / "o.mlir").exists() and not (d / "p.npz").exists()
    assert (d / "r.json").read_text() == "an older report"      # put back
    for f in d.iterdir():
        assert not f.name.startswith(".hlofold-"), f          # no temporary left
    old = d / "r.json"
    old.write_text("{}")
    old.chmod(0o640)
    mask = os.umask(0o022)
    try:
        assert _cli("fold", m, "-o", d / "n.mlir", "--report", old) == 0
    finally:
        os.umask(mask)
    assert (old.stat().st_mode & 0o777) == 0o640
    assert ((d / "n.mlir").stat().st_mode & 0o777) == 0o644


@pytest.mark.parametrize("backend, why", [("gpu", "not present on this machine"),
                                          ("nosuch", "not a backend hlofold knows")])
def test_backends_not_here_are_usage_errors(module_files, backend, why, capsys):
    """Item 18: ``--backends`` naming a backend not here, or none hlofold knows: exit 2."""
    if backend == "gpu" and any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is here")
    d, m, _ = module_files
    assert _cli("fold", m, "-o", d / "o.mlir", "--verify", "--backends", backend) == 2
    assert why in capsys.readouterr().err
    assert _cli("verify", m, m, "--backends", backend) == 2
    assert not (d / "o.mlir").exists()


def test_a_directory_given_as_input_says_so(module_files, capsys):
    d, _, _ = module_files
    (d / "dir").mkdir()
    assert _cli("fold", d / "dir", "-o", d / "o.mlir") == 2
    assert "is a directory" in capsys.readouterr().err


# ------------------------------------------------------------------ safety nets (items 2, 3)

@pytest.fixture
def wrong_by(monkeypatch):
    """``wrong_by(scale_fn)``: every collapsed scale ``s`` a fold computes becomes
    ``scale_fn(s)`` (a wrong fold, as ``test_verify`` simulates one)."""
    import hlofold._base.algebra
    import hlofold._fold.jaxpr.emit
    import hlofold._fold.jaxpr.plan
    import hlofold._fold.stablehlo.emit
    import hlofold._fold.stablehlo.fold
    real = hlofold._base.algebra.collapse

    def install(scale_fn, in_graph_factor=None):
        """(``in_graph_factor``: the StableHLO in-graph scale, an op, multiplied by it)"""
        def wrong(*args, **kwargs):
            s, t = real(*args, **kwargs)
            if "xp" in kwargs and in_graph_factor is not None:     # a value in the graph
                return kwargs["xp"].mul(s, in_graph_factor), t
            return (scale_fn(np.asarray(s)) if "xp" not in kwargs else s), t
        for module in (hlofold._fold.jaxpr.plan, hlofold._fold.jaxpr.emit, hlofold._fold.stablehlo.fold,
                       hlofold._fold.stablehlo.emit):
            monkeypatch.setattr(module, "collapse", wrong)
    return install


def _with_a_bf16_dot(p, x):
    """A float32 conv → BN output, and beside it an unrelated bf16 matmul output."""
    t = x.reshape(x.shape[0], -1)[:, :8].astype(jnp.bfloat16)
    return conv_bn(p, x), t @ jnp.ones((8, 8), jnp.bfloat16)


def test_one_bf16_output_does_not_loosen_a_float32_outputs_check(wrong_by):
    """Item 2: the tolerance of each output is from the precision of its own computation:
    a float32 conv → BN whose fold is 10 % wrong fails verify=True, hlofold.verify and
    fold_params' check although the program also computes a bf16 output."""
    p, x, _ = _conv_bn()
    ref = jax.jit(_with_a_bf16_dot)(p, x)
    wrong_by(lambda s: s * 1.1)
    ff = hlofold.fold(_with_a_bf16_dot, verify=True)
    with pytest.warns(RuntimeWarning, match="differs from the original on output 0 .*1 of 2"):
        out = ff(p, x)
    assert_close(ref, out)                         # the original program ran instead
    bad = hlofold.fold(_with_a_bf16_dot, freeze=0)
    rep = hlofold.verify(jax.jit(_with_a_bf16_dot), lambda p, x: bad(p, x), p, x,
                         backends=["cpu"], raise_on_failure=False)
    assert not rep.passed and [r.output for r in rep.rows if not r.passed] == [0]
    with pytest.raises(RuntimeError, match="change the model's outputs"):
        hlofold.fold_params(_with_a_bf16_dot, p, x)


def test_a_wrong_fold_in_one_small_channel_fails_the_check(wrong_by):
    """Item 3: a bf16 model with one channel of small γ whose folded scale has the wrong
    sign: that channel is ~200 % off while the whole output's error stays under the cap;
    every output is compared slice by slice too."""
    p, x, _ = _conv_bn()
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    p["gamma"] = p["gamma"].at[1].set(0.04)
    xb = x.astype(jnp.bfloat16)
    ref = jax.jit(conv_bn)(p, xb)

    def flip(s):
        s = s.copy()
        s[..., 1] = -s[..., 1]
        return s
    wrong_by(flip)
    ff = hlofold.fold(conv_bn, verify=True)
    with pytest.warns(RuntimeWarning, match="slice 1 of axis 3"):
        out = ff(p, xb)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    whole = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    chan = float(jnp.max(jnp.abs(ref[..., 1].astype(jnp.float32))))
    assert chan < whole / 8                        # the whole-output check alone passes it


def test_on_a_newer_jax_every_entry_point_checks_its_fold(wrong_by, monkeypatch, tmp_path,
                                                           capsys):
    """Item 4: on a JAX newer than the window a fold that is wrong (simulated: every scale
    1.5x) never comes back silently: ``fold_jaxpr``, ``lower``/``export(freeze=0)`` return
    the program as given (its report says why), ``fold_stablehlo(params=)``/``split=``
    raise a ``CompatError`` (their results take other arguments), the CLI exits 3."""
    import warnings

    import hlofold._compat as C
    from hlofold._compat import lookup
    from hlofold._ir.stablehlo.artifacts import module_callable
    p, x, ref = _conv_bn()
    text = jax.jit(conv_bn).lower(p, x).as_text()
    closed = jax.make_jaxpr(lambda x: conv_bn(p, x))(x)
    monkeypatch.setattr(lookup, "UNTESTED", True)
    wrong_by(lambda s: s * 1.5, in_graph_factor=1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        new, rep = hlofold.fold_jaxpr(closed)
        assert new is closed and "differed from it on random inputs" in rep.running
        assert_close(ref, module_callable(hlofold.lower(conv_bn, p, x, freeze=0))(x))
        exp = hlofold.export(conv_bn, p, x, freeze=0)
        assert_close(ref, exp.call(x))
        leaves = {i: np.asarray(a) for i, a in enumerate(jax.tree.leaves(p))}
        with pytest.raises(C.CompatError, match="the fold differs from the module given"):
            hlofold.fold_stablehlo(text, params=leaves)
        with pytest.raises(C.CompatError, match="the fold differs from the module given"):
            hlofold.fold_stablehlo(text, split=["arg5"])
        # the plain fold of a module with its weights as constants: the one given, said
        consts = jax.jit(lambda x: conv_bn(p, x)).lower(x).as_text()
        same, srep = hlofold.fold_stablehlo(consts)
        assert same == consts and "differed from it on this untested JAX" in srep.running
        (tmp_path / "m.mlir").write_text(text)
        np.savez(tmp_path / "w.npz", **{f"arg{i}": a for i, a in leaves.items()})
        assert _cli("fold", tmp_path / "m.mlir", "-o", tmp_path / "o.mlir", "--params",
                    tmp_path / "w.npz", "--prepared-out", tmp_path / "p.npz") == 3
        assert "the fold differs from the module given" in capsys.readouterr().err
        assert not (tmp_path / "o.mlir").exists() and not (tmp_path / "p.npz").exists()


def test_unsigned_inputs_verify_and_fold(tmp_path):
    """Item 15: uint32/uint16 inputs: ``hlofold.verify`` and the CLI's ``--verify`` run them
    (they raised 'unsupported element type ui32' and exited 2 as if the input were bad)."""
    p, x, _ = _conv_bn()

    def f(x, idx, u16):
        return conv_bn(p, x)[..., idx[0] % 4] + u16.astype(jnp.float32).sum(), idx * 2
    args = (x, jnp.array([3], jnp.uint32), jnp.array([1, 2], jnp.uint16))
    text = jax.jit(f).lower(*args).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1
    assert hlofold.verify(text, folded, *args, backends=["cpu"]).passed
    (tmp_path / "m.mlir").write_text(text)
    assert _cli("fold", tmp_path / "m.mlir", "-o", tmp_path / "o.mlir", "--verify") == 0


def test_an_artifact_newer_than_the_bindings_is_written_for_the_newest_they_write(tmp_path):
    """Item 17: a portable artifact targeting a StableHLO newer than these bindings write
    (read, as it uses nothing newer) is folded and written for their newest version, said
    in the report (it failed to serialize: CLI exit 4)."""
    from hlofold import _compat as C
    ir, stablehlo, _ = C.mlir()
    p, x, _ = _conv_bn()
    text = jax.jit(lambda x: conv_bn(p, x)).lower(x).as_text()
    with C.mlir_context():
        cur = stablehlo.get_current_version()
        art = bytes(stablehlo.serialize_portable_artifact(ir.Module.parse(text), cur))
    newer = "9" + cur[1:] if not cur.startswith("9") else "99" + cur[2:]
    art = art.replace(f"StableHLO_v{cur}".encode(), f"StableHLO_v{newer}".encode())
    out, rep = hlofold.fold_stablehlo(art)
    assert rep.num_folded == 1 and out[5:].startswith(f"StableHLO_v{cur}".encode())
    assert f"the artifact targets {newer}" in " ".join(rep.compat)
    (tmp_path / "m.bc").write_bytes(art)
    assert _cli("fold", tmp_path / "m.bc", "-o", tmp_path / "o.bc") == 0


def test_on_a_newer_jax_hlofolds_own_limits_are_not_named_as_jaxs(monkeypatch):
    """Item 16: a CUDA-only export, a TPU-only one and one taking a ``jax.random.key`` fold
    on a newer JAX as on a tested one; the check that cannot run them here says so — never
    'JAX ... changed what hlofold reads'."""
    from hlofold._compat import lookup
    p, x, _ = _conv_bn()
    monkeypatch.setattr(lookup, "UNTESTED", True)
    exports = [jax.export.export(jax.jit(lambda x: conv_bn(p, x)), platforms=[pl])(x)
               for pl in ("cuda", "tpu")]

    def keyed(key, x):
        return conv_bn(p, x), jax.random.uniform(key, ())
    exports.append(jax.export.export(jax.jit(keyed))(jax.random.key(0), x))
    for exp in exports:
        new, rep = hlofold.fold_stablehlo(exp)
        notes = " ".join([rep.running or ""] + rep.compat)
        assert rep.num_folded == 1, (exp.platforms, str(rep))
        assert "changed what hlofold reads" not in notes and "JAX 0.12" not in (
            rep.running or ""), notes


def _stack_forms():
    from jax import lax
    rng = np.random.default_rng(0)
    L = 3
    p = {"k": jnp.asarray(rng.standard_normal((L, 8, 8)) * .3, jnp.float32),
         "s": jnp.asarray(rng.uniform(.5, 2, (L, 8)), jnp.float32),
         "t": jnp.asarray(rng.standard_normal((L, 8)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)

    def fori_from_1(p, x):
        return lax.fori_loop(1, 3, lambda i, h: jnp.tanh(h @ p["k"][i] * p["s"][i] +
                                                         p["t"][i]), x)

    def scan_and_counter(p, x):
        def body(c, k):
            i, h = c
            return (i + 1, jnp.tanh(h @ k * p["s"][i] + p["t"][i])), None
        return lax.scan(body, (0, x), p["k"])[0][1]

    def nested(p, x):
        q = jax.tree.map(lambda a: a.reshape((1,) + a.shape), p)
        return lax.scan(lambda h, qq: (lax.scan(
            lambda h, r: (jnp.tanh(h @ r[0] * r[1] + r[2]), None), h,
            (qq["k"], qq["s"], qq["t"]))[0], None), x, q)[0]
    return p, x, fori_from_1, scan_and_counter, nested


def test_plain_stacks_fold_on_the_jaxpr_path_and_refusals_say_why():
    """Item 12: ``freeze=0`` of a ``fori_loop(1, 3)`` over 3-row stacks, of a scan over the
    kernels reading the BatchNorm at a carried counter, and of nested scans fold (they were
    refused as 'traced under an enclosing transformation'); ``fold_params`` writes the
    fori_loop form's rows 1 and 2 (row 0 as it was), and says of the nested stack what it
    is."""
    p, x, fori_from_1, scan_and_counter, nested = _stack_forms()
    for f in (fori_from_1, scan_and_counter, nested):
        ff = hlofold.fold(f, freeze=0, fold_costly=True)
        assert_close(jax.jit(f)(p, x), ff(p, x))
        rep = ff.report(p, x)
        assert rep.num_folded == 1 and not rep.refused, (f.__name__, str(rep))
    wb = hlofold.fold_params(fori_from_1, p, x)
    assert len(wb.changes) == 1, str(wb)
    np.testing.assert_array_equal(np.asarray(wb.params["k"][0]), np.asarray(p["k"][0]))
    np.testing.assert_allclose(np.asarray(wb.params["s"][1:]), 1)
    assert_close(fori_from_1(p, x), fori_from_1(wb.params, x))
    wb = hlofold.fold_params(nested, p, x)
    (site,) = wb.report.refused
    assert "a stack inside a stack" in site.reason and "traced" not in site.reason
    assert_close(nested(p, x), nested(wb.params, x))


def test_stablehlo_constants_fold_where_the_jaxpr_path_folds_them():
    """Item 13: weights closed over as constants (``@main`` takes only ``x``) that the
    StableHLO path called 'module arguments, use params=': a ``@jax.jit`` block called per
    layer (one private function, a call per layer), int8 and fp8 kernels converted to float
    where they are read; and ``params=`` binds an fp8 weight. (The scanned forms —
    ``unroll``, ``fori_loop(1, L)``, counters by 2, ``(i + 1) % L`` — are in
    ``tests/parity/test_stack_generated.py``.)"""
    from jax import lax

    from hlofold._ir.stablehlo.artifacts import module_callable
    from tests.helpers.conv_bn import bn
    rng = np.random.default_rng(0)
    ps = [jax.tree.map(jnp.asarray, conv_bn_params(rng, 4)) for _ in range(3)]
    block = jax.jit(lambda p, x: jax.nn.relu(conv_bn(p, x)))

    def per_layer(x):
        for p in ps:
            x = block(p, x)
        return x
    p = ps[0]

    def quantized(kind):
        k = jnp.asarray(np.clip(np.round(np.asarray(p["k"]) * 40), -127, 127), jnp.int8) \
            if kind == "int8" else jnp.asarray(p["k"], jnp.float8_e4m3fn)

        def f(x):
            y = lax.conv_general_dilated(x, k.astype(jnp.float32) * 0.025, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return bn(y, p["mean"], p["var"], p["gamma"], p["beta"])
        return f
    _, x, _ = _conv_bn()
    for f in (per_layer, quantized("int8"), quantized("fp8")):
        text = jax.jit(f).lower(x).as_text()
        folded, rep = hlofold.fold_stablehlo(text)
        _, jrep = hlofold.fold_jaxpr(jax.make_jaxpr(f)(x))
        assert rep.num_folded == jrep.num_folded >= 1 and not rep.refused, str(rep)
        out = module_callable(folded)(x)
        assert_close(f(x), out[0] if isinstance(out, (list, tuple)) else out)
    k8 = jnp.asarray(p["k"], jnp.float8_e4m3fn)

    def g(k, x):
        y = lax.conv_general_dilated(x, k.astype(jnp.float32), (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return bn(y, p["mean"], p["var"], p["gamma"], p["beta"])
    exp = jax.export.export(jax.jit(g))(k8, x)
    new, rep, prepared = hlofold.fold_stablehlo(exp, params={0: np.asarray(k8)})
    assert rep.num_folded == 1
    assert_close(g(k8, x), new.call(x, *prepared))


def test_a_sharding_constraint_between_conv_and_bn_is_passed_on_every_stablehlo_path():
    """Item 14: ``sdy.sharding_constraint`` between a conv and its BN ('chain ends at
    sdy.sharding_constraint' on every StableHLO path): passed as the jaxpr path passes
    ``sharding_constraint``, kept on the folded conv's output."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from hlofold._ir.stablehlo.artifacts import module_callable
    from tests.helpers.conv_bn import bn, conv
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    p, x, _ = _conv_bn()

    def f(p, x):
        y = jax.lax.with_sharding_constraint(conv(x, p["k"]), NamedSharding(mesh, P("d")))
        return bn(y, p["mean"], p["var"], p["gamma"], p["beta"])
    text = jax.jit(lambda x: f(p, x)).lower(x).as_text()
    assert "sdy.sharding_constraint" in text
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1 and "sdy.sharding_constraint" in folded
    assert "rsqrt" not in folded
    assert_close(f(p, x), module_callable(folded)(x)[0])
    args = jax.jit(f).lower(p, x).as_text()
    leaves = {f"arg{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(p))}
    apply, rep2, prepared = hlofold.fold_stablehlo(args, params=leaves)
    assert rep2.num_folded == 1 and "sdy.sharding_constraint" in apply
    assert_close(f(p, x), module_callable(apply)(x, *prepared)[0])
    apply, rep3, prepare = hlofold.fold_stablehlo(args, split=["arg5"])
    *made, ok = module_callable(prepare)(*leaves.values())
    assert rep3.num_folded == 1 and bool(ok)
    assert_close(f(p, x), module_callable(apply)(x, *made)[0])


def test_params_never_folds_in_the_graph():
    """Item 10: with ``params=`` a site whose weights are not all known on the host (here:
    the kernel bound, the BatchNorm left an argument) is left as it is — it was folded in
    the graph, behind a run-time guard, recomputing K·s on every call (2.1-2.8x slower than
    the module given)."""
    from hlofold._ir.stablehlo.artifacts import module_callable
    p, x, ref = _conv_bn()
    text = jax.jit(conv_bn).lower(p, x).as_text()        # beta, gamma, k, mean, var, x
    apply, rep, prepared = hlofold.fold_stablehlo(text, params={"arg2": np.asarray(p["k"])})
    assert rep.num_folded == 0 and len(rep.refused) == 1, str(rep)
    assert "is_finite" not in apply and "hlofold_guard" not in apply
    leaves = jax.tree.leaves(p)
    assert_close(ref, module_callable(apply)(leaves[0], leaves[1], leaves[3], leaves[4], x,
                                             *prepared)[0])


def test_a_scanned_stack_is_as_deep_as_its_layers_unrolled():
    """Also seen: the tolerance counted a scanned stack as depth 1 where the same layers
    unrolled count 3; both paths now count the scan's length (a counted while's trips)."""
    from jax import lax

    from hlofold._fold.jaxpr.accumulation import output_profiles
    from hlofold._fold.stablehlo.checked import artifact_profiles
    k = jnp.ones((3, 4, 4))
    x = jnp.ones((2, 4))

    def scanned(x):
        return lax.scan(lambda h, kk: (jnp.tanh(h @ kk), None), x, k)[0]

    def unrolled(x):
        for i in range(3):
            x = jnp.tanh(x @ k[i])
        return x
    profiles = {(f.__name__, path): prof
                for f in (scanned, unrolled)
                for path, prof in (("jaxpr", output_profiles(jax.make_jaxpr(f)(x).jaxpr)),
                                   ("stablehlo", artifact_profiles(
                                       jax.jit(f).lower(x).as_text())))}
    assert {p[0][:2] for p in profiles.values()} == {(4, 3)}, profiles


def test_fold_params_checks_the_float_outputs_not_an_argmax():
    """Also seen: an integer output (an argmax over exact ties) may flip within rounding
    (942 of 2,304 rows); fold_params' check compares the float outputs the integers come
    from, it does not raise 'please report this' — and still raises where a float output
    differs."""
    from hlofold._front import writeback as W
    p, x, _ = _conv_bn()

    def f(p, x):
        y = conv_bn(p, x)
        return y, jnp.argmax(y, axis=-1)
    closed = jax.make_jaxpr(f)(p, x)
    y, idx = f(p, x)
    W._check((y, idx), (y, (idx + 1) % 4), closed)       # a flipped integer: fine
    with pytest.raises(RuntimeError, match="change the model's outputs"):
        W._check((y, idx), (y * 1.1, idx), closed)


@pytest.mark.parametrize("per_call", [["arg5", "arg2"], ["arg5", "arg3"], ["arg0", "arg5"]])
def test_split_naming_a_weight_per_call_is_an_error_not_a_crash(per_call, tmp_path, capsys):
    """Item 6: ``split=`` naming a kernel or a BatchNorm vector per call made the split
    print a module it had left invalid (a segfault, exit 139); now a clear error before
    anything is printed (the CLI: exit 2, nothing written)."""
    from hlofold._ir.stablehlo.ir import StableHLOError
    p, x, _ = _conv_bn()
    text = jax.jit(conv_bn).lower(p, x).as_text()          # beta, gamma, k, mean, var, x
    with pytest.raises(StableHLOError, match="computed from the per-call arguments"):
        hlofold.fold_stablehlo(text, split=per_call)
    (tmp_path / "m.mlir").write_text(text)
    assert _cli("fold", tmp_path / "m.mlir", "-o", tmp_path / "o.mlir", "--prepare",
                tmp_path / "p.mlir", "--per-call", ",".join(per_call)) == 2
    assert "per-call arguments" in capsys.readouterr().err
    assert not (tmp_path / "o.mlir").exists() and not (tmp_path / "p.mlir").exists()


def test_a_scale_computed_from_the_activations_under_split_is_an_error():
    """Item 6, the other form: ``conv(x, K) * x.mean(...)`` with the kernel named per call."""
    from jax import lax

    from hlofold._ir.stablehlo.ir import StableHLOError
    p, x, _ = _conv_bn()

    def g(x, k):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y * x.mean((0, 1, 2))
    text = jax.jit(g).lower(x, p["k"]).as_text()
    with pytest.raises(StableHLOError, match="per-call arguments"):
        hlofold.fold_stablehlo(text, split=["arg1"])


def test_params_naming_one_argument_twice_is_an_error():
    """Item 11: ``params={"arg0": K, 0: 2*K}`` was accepted, the last value winning."""
    from hlofold._ir.stablehlo.ir import StableHLOError
    p, x, _ = _conv_bn()
    text = jax.jit(conv_bn).lower(p, x).as_text()
    k = np.asarray(p["k"])
    with pytest.raises(StableHLOError, match="names argument 2 twice"):
        hlofold.fold_stablehlo(text, params={"arg2": k, 2: 2 * k})
    exp = jax.export.export(jax.jit(conv_bn))(p, x)
    with pytest.raises(StableHLOError, match="names argument 2 twice"):
        hlofold.fold_stablehlo(exp, params={"arg2": k, "%arg2": 2 * k})
