"""Fail closed on a JAX hlofold has not seen (issue 41).

Each simulated change runs in a process of its own (``tests/front/_compat_script.py``):
a newer version string; every internal ``hlofold._compat`` looks up made to look missing to
hlofold in turn (JAX itself keeps it); JAX 0.11's merged jaxpr classes; a renamed MLIR
binding. In each: import works, every entry point returns ``jax.jit``'s results, and where
the change switched a fold off, the report names it. In this process: jitted functions whose
settings cannot be read, and control-flow parameters of another shape (JAX 0.11's scan).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlofold
import hlofold._compat as C
from hlofold._compat import lookup
from tests.front import _compat_script as S
from tests.helpers import ROOT

TOL = 1e-4          # |Δ| against jax.jit's outputs (values of order 10; a fold rounds once)
JAXPR_ENTRIES = {"fold", "fold(jit, static)", "freeze", "fold_jaxpr", "fold_params", "scan"}
STABLEHLO_ENTRIES = {"fold_stablehlo", "export"}


def run_script(cfg: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "tests.front._compat_script",
                           json.dumps(cfg)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def check(out: dict, off: set[str], cause: str) -> None:
    """Every entry point agrees with jax.jit; those in ``off`` folded nothing and say
    ``cause``; the others folded."""
    assert not out["errors"], out["errors"]
    assert set(out["diff"]) >= JAXPR_ENTRIES - {"scan"} | STABLEHLO_ENTRIES, out["diff"]
    assert max(out["diff"].values()) < TOL and out["scan diff"] < TOL, out
    for name, n in out["folded"].items():
        if name in off:
            assert n == 0, (name, out)
            notes = " ".join(out["notes"][name])
            assert f"JAX {out['jax']} changed" in notes and cause in notes, (name, notes)
        else:
            assert n >= 1, (name, out)


def test_versions_newer_than_the_window_are_untested():
    assert lookup.version_tuple("0.12.0.1") == (0, 12, 0, 1)
    assert lookup.version_tuple("0.11.0.dev20260801") == (0, 11, 0)
    assert lookup.version_tuple("0.10.2rc1") == (0, 10, 2)
    for v in ("0.10.0", "0.10.2", "0.11.0", "0.11.2", "0.12.0", "0.12.0.1", C.TESTED[1]):
        assert not lookup.is_untested(v), v
    for v in ("0.12.2", "0.12.1.1", "0.13.0", "1.0", "0.12.2.dev20261201", "0.12.1.dev1",
              "0.12.1rc1"):
        assert lookup.is_untested(v), v
    assert not C.untested() and not C.CHANGED      # this suite runs inside the window


def test_a_newer_jax_warns_once_verifies_and_folds():
    out = run_script({"version": "0.12.2"})
    assert out["untested"] and out["verify_default"] is True
    assert len(out["warnings"]) == 1, out["warnings"]
    assert f"tested with {C.WINDOW}; this is jax 0.12.2" in out["warnings"][0]
    check(out, set(), "")


# the internals whose loss the README tier checks; the slow tier hides every one in turn
QUICK = {"jax._src.core:eval_jaxpr", "jax._src.source_info_util:user_frames",
         "jax._src.export._export:_module_to_bytecode"}


def _cases():
    for feature, paths in C.LOOKUPS:
        mark = () if paths[0] in QUICK else (pytest.mark.slow,)
        yield pytest.param(feature, paths, id=paths[0], marks=mark)


@pytest.mark.parametrize("feature, paths", list(_cases()))
def test_each_internal_missing_in_turn(feature, paths):
    # a whole module is hidden where it has a fallback (jaxlib's own path to the bindings,
    # which JAX itself imports: that one cannot be hidden from JAX)
    hide = [p for p in paths if ":" in p] or list(paths[:1])
    out = run_script({"hide": hide})
    if ":" not in paths[0] and len(paths) > 1:
        assert not out["changed"], out["changed"]      # the fallback path was used
        check(out, set(), "")
        return
    assert list(out["changed"]) == [paths[0]] and out["changed"][paths[0]][0] == feature
    off = {"jaxpr": JAXPR_ENTRIES, "stablehlo": STABLEHLO_ENTRIES,
           "export": {"export"}}.get(feature, set())
    check(out, off, paths[0].replace(":", "."))


def test_with_the_jaxpr_path_off_every_view_and_the_demo_run_the_original():
    """``jaxpr()``, ``lower()`` and ``split()`` of a folded function give the original's where
    this JAX switched folding off (as calls do), and ``hlofold demo`` says so and runs on,
    exit 0, no traceback."""
    out = run_script({"hide": ["jax._src.core:eval_jaxpr"], "demo": True})
    check(out, JAXPR_ENTRIES, "jax._src.core.eval_jaxpr")
    assert {"jaxpr()", "lower()", "split"} <= set(out["diff"]), out["diff"]
    assert out["demo rc"] == 0, out["demo"][-3000:]
    assert "Traceback" not in out["demo"]
    assert "NOTE: JAX" in out["demo"] and "changed jax._src.core.eval_jaxpr" in out["demo"]
    assert "jax.jit (deploy form, by hand)" in out["demo"]


def test_the_demo_folds_and_merges_on_this_jax():
    out = run_script({"demo": True})
    check(out, set(), "")
    assert {"jaxpr()", "lower()", "split"} <= set(out["diff"]), out["diff"]
    assert out["demo rc"] == 0, out["demo"][-3000:]
    assert "NOTE: JAX" not in out["demo"] and "4 sums merged" in out["demo"], out["demo"]
    assert "PASS" in out["demo"] and "FAIL" not in out["demo"]


def test_the_mlir_dialect_missing_everywhere_turns_the_stablehlo_path_off():
    out = run_script({"hide": ["jax.extend.mlir.dialects.stablehlo",
                               "jaxlib.mlir.dialects.stablehlo"]})
    check(out, STABLEHLO_ENTRIES, "jax.extend.mlir.dialects.stablehlo")


def test_a_renamed_mlir_binding_turns_the_stablehlo_path_off():
    out = run_script({"hide": ["jax.extend.mlir.ir:RankedTensorType"]})
    check(out, STABLEHLO_ENTRIES, "ir.RankedTensorType")


def test_merged_jaxpr_classes_are_read_as_such():
    """JAX 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (a jaxpr carries its constants): on
    such a JAX every entry point folds (the whole suite runs there); on 0.10 the classes are
    two."""
    assert C.MERGED == (lookup.version_tuple(jax.__version__) >= (0, 11))
    assert not C.CHANGED
    closed = jax.make_jaxpr(S.net)(*_inputs())
    assert C.is_closed(closed) and C.as_closed(closed) is closed
    assert C.is_open(C.hoist_consts(closed)[0])
    with pytest.raises(TypeError, match="expected a jaxpr"):
        C.as_closed(object())


@pytest.mark.skipif(C.MERGED, reason="this JAX's jaxpr classes are merged for real")
def test_one_class_without_constants_turns_the_jaxpr_path_off():
    """``ClosedJaxpr is Jaxpr`` on a JAX whose ``Jaxpr`` does not carry its constants (the
    0.11 merge without its meaning): the jaxpr path is off, the report says why."""
    out = run_script({"alias": {"jax.extend.core:ClosedJaxpr": "Jaxpr"}})
    check(out, JAXPR_ENTRIES, "ClosedJaxpr is Jaxpr, which does not carry its constants")


# ---------------------------------------------------------------- in this process


class _Jitted:
    """A jitted function whose settings this JAX hides (``_jit_info`` renamed)."""

    def __init__(self, f):
        self._jitted = jax.jit(f)

    def __call__(self, *a):
        return self._jitted(*a)

    def lower(self, *a):
        return self._jitted.lower(*a)

    def trace(self, *a):
        return self._jitted.trace(*a)

    def eval_shape(self, *a):
        return self._jitted.eval_shape(*a)


def _inputs():
    rng = np.random.default_rng(1)
    return S.params(rng), jnp.asarray(rng.normal(size=(2, 8, 8, 4)), jnp.float32)


def test_a_jitted_function_whose_settings_cannot_be_read_runs_as_given():
    p, x = _inputs()
    f = hlofold.fold(_Jitted(S.net))
    np.testing.assert_array_equal(f(p, x), jax.jit(S.net)(p, x))
    np.testing.assert_array_equal(jax.jit(f)(p, x), jax.jit(S.net)(p, x))
    rep = f.report(p, x)
    assert rep.num_folded == 0 and "jax.jit's wrapped functions" in rep.running
    assert "rsqrt" in hlofold.lower(f, p, x)        # the original's lowering


def _scan_as_in_jax_0_11(closed):
    """``closed`` with its scan's parameters in JAX 0.11's form (``ft_in``/``ft_out``
    in place of ``num_consts``/``num_carry``/``linear``), of a kind hlofold cannot read
    (on 0.10 no flat trees at all; on 0.11+ not three of them)."""
    eqns = []
    for e in closed.jaxpr.eqns:
        if e.primitive.name == "scan":
            p = {k: v for k, v in e.params.items() if k not in ("num_consts", "num_carry",
                                                                  "linear")}
            e = e.replace(params={**p, "ft_in": object(), "ft_out": object()})
        eqns.append(e)
    return C.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)


def test_a_scan_whose_parameters_changed_is_left_as_it_is():
    p, x = _inputs()
    closed = _scan_as_in_jax_0_11(jax.make_jaxpr(lambda x: S.looped(p, x))(x))
    new, rep = hlofold.fold_jaxpr(closed)
    scan = [e for e in new.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scan) == 1 and "ft_in" in scan[0].params
    assert scan[0].params["jaxpr"] is [e for e in closed.jaxpr.eqns
                                       if e.primitive.name == "scan"][0].params["jaxpr"]
    assert rep.num_folded == 0
    assert any("the parameters of scan (" in c and "flat trees" in c and
               "the scan at top is left as it is" in c for c in rep.compat), rep.compat
    assert "NOTE: JAX" in str(rep)


def test_the_decorator_leaves_a_scan_it_cannot_read_and_folds_the_rest(monkeypatch):
    def as_in_0_11(eqn):
        raise C.CompatError("the parameters of scan (expected num_consts, num_carry; found "
                            "ft_in, ft_out, jaxpr, length, reverse, unroll)", "jaxpr")
    monkeypatch.setattr(C, "scan_body", as_in_0_11)
    p, x = _inputs()

    def both(p, x):          # a conv → BN outside the scan, and one inside it
        return S.looped(p, S.net(p, x))
    f = hlofold.fold(both, freeze=0)
    np.testing.assert_allclose(f(p, x), jax.jit(both)(p, x), rtol=1e-5, atol=1e-5)
    rep = f.report(p, x)
    assert rep.num_folded == 1 and rep.running is None       # the one outside the scan
    assert any("the scan at top" in c for c in rep.compat), rep.compat


def test_the_cli_exits_3_with_one_line_where_a_mode_needs_what_jax_changed(tmp_path,
                                                                           monkeypatch,
                                                                           capsys):
    from hlofold._front import cli as _cli
    p, x = _inputs()
    src = tmp_path / "m.mlir"
    src.write_text(jax.jit(S.net).lower(p, x).as_text())
    np.savez(tmp_path / "w.npz", arg1=np.asarray(p["k"]))
    monkeypatch.setitem(lookup.CHANGED, "jax.extend.mlir.ir",
                        ("stablehlo", "jax.extend.mlir.ir (not found)"))
    out = tmp_path / "o.mlir"
    code = _cli.main(["fold", str(src), "-o", str(out), "--params", str(tmp_path / "w.npz"),
                      "--prepared-out", str(tmp_path / "p.npz")])
    err = capsys.readouterr().err
    assert code == 3 and not out.exists() and "Traceback" not in err
    assert "changed jax.extend.mlir.ir (not found)" in err and len(err.splitlines()) == 1
    # without --params the module is written as given, and the report says why
    assert _cli.main(["fold", str(src), "-o", str(out)]) == 0
    assert out.read_text() == src.read_text()
    assert "NOTE: calls run the module as given (JAX" in capsys.readouterr().out


def test_no_warning_inside_the_window():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lookup.warn_untested()


def test_on_a_newer_jax_fold_stablehlo_checks_its_fold_against_the_module(monkeypatch):
    monkeypatch.setattr(lookup, "UNTESTED", True)
    p, x = _inputs()
    text = jax.jit(lambda x: S.net(p, x)).lower(x).as_text()
    folded, rep = hlofold.fold_stablehlo(text)
    assert rep.num_folded == 1 and rep.running is None and "rsqrt" not in folded
    import hlofold._base.tolerance as T       # a fold the check finds wrong: the module as given
    monkeypatch.setattr(T, "mismatch", lambda *a: "max|Δ| too large (forced)")
    with pytest.warns(RuntimeWarning, match="differs from the one given"):
        again, rep = hlofold.fold_stablehlo(text)
    assert again == text and "the fold differed from it" in rep.running


def _broken_root(self, eqn):
    raise AttributeError("'ConvDimensionNumbers' object has no attribute 'lhs_spec'")


def test_on_a_newer_jax_any_failure_while_folding_runs_the_original(monkeypatch):
    """A newer JAX may change what hlofold reads in ways no check foresaw (here: the conv's
    dimension numbers): there, an error raised while folding fails closed on every path;
    on a tested JAX it is a bug of hlofold's and is raised."""
    from hlofold._fold.jaxpr.patterns import ConvAffinePattern
    import hlofold._front.artifacts as A
    monkeypatch.setattr(ConvAffinePattern, "inspect_root", _broken_root)
    p, x = _inputs()
    ref = jax.jit(S.net)(p, x)
    with pytest.raises(AttributeError):              # tested JAX: raised
        hlofold.fold(S.net)(p, x)
    monkeypatch.setattr(lookup, "UNTESTED", True)
    f = hlofold.fold(S.net)
    np.testing.assert_array_equal(f(p, x), ref)
    rep = f.report(p, x)
    assert rep.num_folded == 0 and "AttributeError while folding" in rep.running
    closed = jax.make_jaxpr(S.net)(p, x)
    new, rep = hlofold.fold_jaxpr(closed)
    assert new is closed and "lhs_spec" in rep.running
    fp = hlofold.fold_params(S.net, p, x)
    assert fp.params is p and not fp.changes and "AttributeError" in fp.report.running

    def broken(*a, **k):
        raise KeyError("dimension_numbers")
    monkeypatch.setattr(A, "fold_module_text", broken)
    text = jax.jit(lambda x: S.net(p, x)).lower(x).as_text()
    same, rep = hlofold.fold_stablehlo(text)
    assert same == text and "KeyError while folding" in rep.running
    with pytest.raises(hlofold.StableHLOError):      # bad input stays the caller's error
        hlofold.fold_stablehlo(b"neither text nor bytecode")
    monkeypatch.setattr(lookup, "UNTESTED", False)
    with pytest.raises(KeyError):
        hlofold.fold_stablehlo(text)


def test_a_folded_function_running_as_given_copies_and_pickles():
    import copy
    import pickle
    p, x = _inputs()
    f = hlofold.fold(_Jitted(S.net))
    np.testing.assert_array_equal(copy.deepcopy(f)(p, x), jax.jit(S.net)(p, x))
    err = C.CompatError("jax.jit's wrapped functions", "jaxpr")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.feature == "jaxpr"
