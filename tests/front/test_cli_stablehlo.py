"""`hlofold fold | verify | report` through the real entry point, in subprocesses."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlofold import examples
from tests.helpers import DATA

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}
BLOCK = os.path.join(DATA, "resnet_block_jax.mlir")


def hlofold(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hlofold", *args], capture_output=True,
                          text=True, timeout=300, env=ENV, cwd=cwd)


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_fold_text_with_report_and_verify(tmp_path):
    out, rep = tmp_path / "block_folded.mlir", tmp_path / "report.json"
    before = digest(BLOCK)
    r = hlofold("fold", "--in-graph", BLOCK, "-o", str(out), "--report", str(rep), "--verify")
    assert r.returncode == 0, r.stderr
    assert digest(BLOCK) == before                       # input never modified
    assert "hlofold verify: PASS" in r.stdout
    report = json.loads(rep.read_text())
    assert report["num_folded"] == 2
    text = out.read_text()
    assert "stablehlo.convolution" in text and "rsqrt" in text   # params are arguments
    assert list(tmp_path.iterdir()) == sorted([out, rep]) or set(tmp_path.iterdir()) == {
        out, rep}                                        # no temporary files left


@pytest.mark.slow
def test_fold_export_artifact_and_call(tmp_path):
    p = examples.init_resnet(10, width=8)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 32, 3)), jnp.float32)
    src, dst = tmp_path / "model.jaxexport", tmp_path / "model_folded.jaxexport"
    src.write_bytes(jax.export.export(jax.jit(examples.resnet_apply))(p, x).serialize())
    r = hlofold("fold", "--in-graph", str(src), "-o", str(dst), "--verify")
    assert r.returncode == 0, r.stderr
    assert "13 folded" in r.stdout    # 12 BatchNorms, and the pool's 1/HW into the head
    out = jax.export.deserialize(bytearray(dst.read_bytes())).call(p, x)
    ref = examples.resnet_apply(p, x)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    r = hlofold("verify", str(src), str(dst), "--json", str(tmp_path / "v.json"))
    assert r.returncode == 0 and "PASS" in r.stdout
    assert json.loads((tmp_path / "v.json").read_text())["passed"]


@pytest.mark.slow
def test_verify_with_inputs_and_a_wrong_module(tmp_path):
    src = os.path.join(DATA, "conv_bn_inference_nhwc_args.mlir")
    good = tmp_path / "good.mlir"
    assert hlofold("fold", "--in-graph", src, "-o", str(good)).returncode == 0
    bad = tmp_path / "bad.mlir"
    bad.write_text(good.read_text().replace("stablehlo.add %", "stablehlo.subtract %", 1))
    rng = np.random.default_rng(3)
    shapes = [(1, 8, 8, 3), (3, 3, 3, 4), (4,), (4,), (4,), (4,)]
    np.savez(tmp_path / "in.npz", *[rng.uniform(0.5, 1.5, s).astype(np.float32)
                                    for s in shapes])
    r = hlofold("verify", src, str(good), "--inputs", str(tmp_path / "in.npz"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = hlofold("verify", src, str(bad), "--inputs", str(tmp_path / "in.npz"))
    assert r.returncode == 1 and "FAIL" in r.stdout
    # --verify refuses to write a folded artifact that fails: simulate with a broken copy
    # of the input (the fold itself is right, so compare original vs a wrong "original")
    r = hlofold("verify", src, str(bad), "--inputs", str(tmp_path / "nope.npz"))
    assert r.returncode == 2 and "not a readable .npz" in r.stderr


def test_report_writes_nothing(tmp_path):
    r = hlofold("report", "--in-graph", os.path.join(DATA, "bn_feature_index_not_feature.mlir"), cwd=tmp_path)
    assert r.returncode == 0
    assert "refused" in r.stdout and "feature_index 1" in r.stdout
    assert list(tmp_path.iterdir()) == []
    r = hlofold("report", "--in-graph", BLOCK, "--json")
    assert json.loads(r.stdout)["num_folded"] == 2


def _bytecode(path):
    from hlofold import _compat as C
    ir = C.mlir()[0]
    with C.mlir_context():
        m = ir.Module.parse(open(path).read())
        buf = io.BytesIO()
        m.operation.write_bytecode(buf)
    return buf.getvalue()


BAD = {
    "empty": (b"", "empty input"),
    "random bytes": (bytes(range(256)) * 4, "unknown artifact"),
    "truncated bytecode": (None, "truncated or corrupt"),
    "MLIR, not StableHLO": (b"module {\n  func.func @main(%a: i32) -> i32 {\n"
                            b"    %0 = arith.addi %a, %a : i32\n    return %0 : i32\n  }\n}\n",
                            "dialects hlofold does not handle"),
    "unknown dialect": (b"module { func.func @main() { \"foo.bar\"() : () -> () return } }",
                        "unregistered dialect"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_and_writes_nothing(tmp_path, case):
    data, msg = BAD[case]
    if data is None:
        data = _bytecode(BLOCK)[:80]
    src = tmp_path / "input.bin"
    src.write_bytes(data)
    out = tmp_path / "out.mlir"
    for cmd in (["fold", str(src), "-o", str(out)], ["report", str(src)]):
        r = hlofold(*cmd)
        assert r.returncode == 2, (case, cmd, r.stdout, r.stderr)
        assert msg in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not out.exists()
    assert src.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input.bin"]


def test_missing_file_same_path_and_missing_folder(tmp_path):
    r = hlofold("fold", "--in-graph", str(tmp_path / "nope.mlir"), "-o", str(tmp_path / "o.mlir"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = hlofold("fold", "--in-graph", BLOCK, "-o", BLOCK)
    assert r.returncode == 2 and "is the same file as the input" in r.stderr
    r = hlofold("fold", "--in-graph", BLOCK, "-o", str(tmp_path / "missing" / "o.mlir"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = hlofold("verify", BLOCK)
    assert r.returncode == 2 and "usage" in r.stderr


def test_fold_verify_refuses_to_write_a_wrong_fold(tmp_path, monkeypatch, capsys):
    """In-process (to inject a wrong fold): --verify fails, exit 1, nothing written."""
    import hlofold._front.artifacts as A
    from hlofold._front import cli as _cli
    real = A.fold_stablehlo

    def broken(data, **kw):
        text, rep = real(data, **kw)
        return text.replace("stablehlo.add %", "stablehlo.subtract %", 1), rep
    monkeypatch.setattr(A, "fold_stablehlo", broken)
    out = tmp_path / "o.mlir"
    rc = _cli.main(["fold", os.path.join(DATA, "conv_bn_inference_nhwc_args.mlir"),
                    "-o", str(out), "--in-graph", "--verify", "--report",
                    str(tmp_path / "r.json")])
    assert rc == 1
    assert "verification failed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
