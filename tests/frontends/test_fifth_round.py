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
    from hlofold._cli import main
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
