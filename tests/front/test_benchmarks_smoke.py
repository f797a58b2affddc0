"""``python -m benchmarks.run --quick`` runs end to end and writes its JSON, Markdown and PNG.

A smoke test of the benchmark machinery (tiny networks, few rounds, cheap XLA code
generation): every model builds, every variant runs and agrees with the unfolded program, and
the HLO fusion counts are there. It says nothing about performance.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

pytest.importorskip("flax")
pytest.importorskip("matplotlib")

MODELS = ["resnet18", "resnet50", "mobilenetv2"]
VARIANTS = ["a", "b", "b'", "c", "d"]


@pytest.mark.slow
def test_quick_benchmark(tmp_path):
    # One test (not several sharing a fixture) so that pytest-xdist runs the benchmark once.
    proc, out, seconds = _quick_run(tmp_path)
    _check_outputs(proc, out)
    _check_every_variant_ran(proc, out)
    print(f"quick benchmark: {seconds:.0f} s")


def _quick_run(out):
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_FLAGS", None)   # --quick then uses its cheap code generation flags
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out),
                           "--name", "smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    return proc, out, time.perf_counter() - t0


def _check_outputs(proc, out):
    assert (out / "smoke.json").is_file(), proc.stderr[-3000:]
    assert (out / "smoke.md").is_file()
    assert (out / "smoke.png").stat().st_size > 1000
    result = json.loads((out / "smoke.json").read_text())
    assert result["config"]["quick"] is True
    m = result["machine"]
    for key in ("cpu_model", "sched_affinity_cpus", "device_kind", "jax", "jaxlib", "flax",
                "hlofold"):
        assert m.get(key) not in (None, ""), key
    assert [mk["key"] for mk in result["models"]] == MODELS
    md = (out / "smoke.md").read_text()
    assert "Quick (smoke) run" in md and "## Summary" in md and m["cpu_model"] in md
    for mk in result["models"]:
        assert mk["title"] in md
        assert mk["info"]["num_bn"] > 0 and mk["info"]["num_blocks"] > 0
        for b in mk["batches"]:
            assert "a" in b["latency_s"] and "d" in b["latency_s"]
            assert b["hlo"]["a"]["fusions_in_blocks"] > 0
            assert b["hlo"]["d"]["fusions_per_block"]
            assert b["fold"]["report_counts"].get("folded", 0) >= mk["info"]["num_bn"]


def _check_every_variant_ran(proc, out):
    result = json.loads((out / "smoke.json").read_text())
    failures = {(mk["key"], b["batch"]): b["errors"] for mk in result["models"]
                for b in mk["batches"] if b["errors"]}
    assert not failures and proc.returncode == 0, failures or proc.stderr[-3000:]
    for mk in result["models"]:
        for b in mk["batches"]:
            assert sorted(b["latency_s"]) == sorted(VARIANTS)
            for v in VARIANTS:
                # float32 rounding of a folded program, relative to the largest logit
                assert b["max_abs_diff_vs_a"][v] <= 1e-5 * b["max_abs_logit_a"] + 1e-6, (mk, v)
            for prog in ("a", "b_apply", "c", "d"):
                assert prog in b["hlo"] and prog in b["memory"]
            # folding removes the BN arithmetic: never more fusions than unfolded
            assert b["hlo"]["b_apply"]["fusions_in_blocks"] <= b["hlo"]["a"]["fusions_in_blocks"]


@pytest.mark.slow
def test_calls_quick(tmp_path):
    """``python -m benchmarks.calls --quick``: every way of calling measured side by side
    with doing nothing, in one run, written as JSON and Markdown with the machine stamped.
    It says nothing about performance (tiny networks, few rounds)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.calls", "--quick", "--out",
                           str(tmp_path), "--name", "calls"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "calls.json").read_text())
    assert res["machine"]["backend"] == "cpu" and res["machine"]["cpu_model"]
    for row in res["first_call"]:
        assert row["seconds"]["jit"]["n"] == row["seconds"]["fold"]["n"] >= 2
        assert row["fold_vs_jit"] > 0 and row["freeze_vs_jit"] > 0
    assert {r["batch"] for r in res["under_jit"]} == {1, 2}
    assert all(r["traced_sites_folded"] == 0 for r in res["under_jit"]), \
        "under the user's jit with traced parameters nothing is rescaled per call"
    assert all(r["same_program"] and r["same_cost"] for r in res["under_jit"]), \
        "jit(fold(f)) is jit(f): same StableHLO ops, same XLA cost (flops, bytes)"
    assert res["dispatch"]["fold_vs_jit"] > 0
    k = res["dispatch"]["nnx_keys"]          # a state holding PRNG keys: all dispatch
    assert k["keys"] == 6 and k["folded"] == 0 and k["seconds"]["fold"]["n"] == 3, k
    assert res["changing_params"]["second_half"]["fold"]["n"] >= 2
    assert len(res["artifacts"]) == 4          # params= and split=, TF module and export
    for r in res["artifacts"]:                   # the folded program does no more work
        c = r["cost"]
        assert c["folded"]["flops"] <= c["original"]["flops"], r
        assert c["folded"]["bytes"] <= c["original"]["bytes"] * 1.001, r
    assert {(r["net"], r["batch"]) for r in res["forward"]} == {
        (n, b) for n in ("fwd-stem", "fwd-bn-conv") for b in (1, 8)}
    for r in res["forward"]:         # a bias map is folded only where it removes more work
        c = r["cost"]
        assert c["folded"]["flops"] <= c["original"]["flops"], r
        assert c["folded"]["bytes"] <= c["original"]["bytes"] * 1.001, r
    (fp,) = res["first_program"]     # issue 69 item 10: one fresh process per variant
    assert fp["runs"] == 1 and set(fp["first_s"]) == set(fp["window_ms"]) == {
        "fold", "jit", "deploy"}, fp
    assert fp["kept"] in (["defaults"], ["option"]) and len(fp["right"]) == 1, fp
    md = (tmp_path / "calls.md").read_text()
    for section in ("First call", "Under the user's jit", "Dispatch", "new parameter pytree",
                    "Artifacts", "Forward folds behind SAME padding",
                    "first program of a process"):
        assert section in md


@pytest.mark.slow   # a long evidence run: CI runs it in the slow tier
def test_foldtime_quick():
    """``python -m benchmarks.foldtime --quick``: every row timed for this checkout (tiny
    models, one round; it says nothing about performance)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.foldtime", "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| jaxpr") or
            line.startswith("| stablehlo")]
    # 5 jaxpr rows (constants: first and later folds), 3 StableHLO, 2 × 2 deep decoders
    assert len(rows) == 12, proc.stdout
    # make_jaxpr, the 10k-op module, and per decoder: str of the parsed module, and as bytes
    assert sum(line.startswith("| doing nothing") for line in proc.stdout.splitlines()) == 6
    assert all(" ms [" in r for r in rows), proc.stdout


@pytest.mark.slow
def test_branches_quick(tmp_path):
    """``python -m benchmarks.branches --quick``: the multi-branch nets next to jax.jit and
    their deploy form, and timm's exports next to the modules as given, written with the
    machine stamped. Asserts the structure (the folded programs are the deploy form), not
    the timings (tiny sizes, two rounds)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.branches", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "branches_cpu.json").read_text())
    assert res["machine"]["backend"] == "cpu"
    assert {(r["arch"], r["batch"]) for r in res["flax"]} == {
        (a, 1) for a in ("repvgg_a0", "mobileone_s0")}    # --quick: batch 1 only
    for r in res["flax"]:
        assert r["convs"]["fold"] == r["convs"]["deploy"] < r["convs"]["train"], r
        assert set(r["steady_ms"]) == {"jit", "fold", "deploy", "under jit", "jit, no YNN",
                                       "fold, no YNN", "deploy, no YNN", "deploy, single",
                                       "deploy, single, train tree"}
        # measured on the settled program's calls: XLA's defaults or the YNNPACK limit
        assert r["compile_options"] in ({}, {"xla_cpu_experimental_ynn_fusion_type": (
            "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT")})
    for r in res["timm"]:
        assert r["convs"]["folded"] <= r["convs"]["timm deploy"] < r["convs"]["original"]
    assert "fold/deploy" in (tmp_path / "branches_cpu.md").read_text()


@pytest.mark.slow
def test_gpu_script_quick_on_the_cpu(tmp_path):
    """``python -m benchmarks.gpu PART --quick`` (the script a lent GPU runs) works here:
    every entry point runs and matches ``jax.jit``, and the StableHLO rows time the folded
    export next to the one as given, as called and under ``jax.jit``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for part in ("env", "entry", "decoder", "stack", "decorator"):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", part, "--quick", "--out",
                               str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "env.json").read_text())["disabled"] == {}
    entry = json.loads((tmp_path / "entry.json").read_text())["entry"]
    assert len(entry) == 9 and all(r["ok"] and r["max_abs_diff"] < 1e-4 for r in entry.values()), entry
    (row,) = json.loads((tmp_path / "decoder.json").read_text())["decoder"]
    assert set(row["steady_ms"]) == {"original", "folded", "jit original", "jit folded"}
    assert row["folded"] > 0 and row["max_abs_diff"] <= 1e-4 * row["max_abs_ref"]
    stack = json.loads((tmp_path / "stack.json").read_text())["stack"]
    assert len(stack) == 3 and not any("error" in r for r in stack), stack
    assert all(r["folded"] > 0 and r["max_abs_diff"] <= 1e-4 * r["max_abs_ref"] for r in stack)
    # the decorator next to jax.jit (issue 52 item 6): every model, outputs against the CPU
    rows = json.loads((tmp_path / "decorator.json").read_text())["decorator"]
    # 3 image models and the decoder, at batch 1 (--quick)
    assert len(rows) == 4 and not any("error" in r for r in rows), rows
    assert all((r["folded"] + r["merged"] > 0 or r["model"].startswith("decoder")) and
               r["running"] is None and
               r["rel_diff_fold_vs_jit"] < 1e-4 and set(r["steady_ms"]) == {"jit", "fold"}
               for r in rows), rows
