"""Compile options hlofold chooses per program (issues 38 item 4, 53).

Merging a block's parallel branches leaves a chain of single-use convolutions (the deploy
form). XLA:CPU sometimes grows one YNNPACK library fusion from the final reduction up
through such a chain, which runs slower than the train-time program (RepVGG-A0, 64 px,
batch 8: 1.6x of ``jax.jit``); at most other sizes limiting that fusion to single
convolutions and dots costs 1.1-1.8x instead. So a merged program is compiled both ways
and the first call keeps the faster (``hlofold._front.tune``); the report says which and why; the
user's own choice of the option wins; a jaxlib that does not take the option (or a JAX
outside the tested window) compiles without it."""
from __future__ import annotations

import re

import jax
import pytest

import hlofold
from hlofold import _compat as C
from hlofold._front import tune as T
from hlofold._compat import xla as X
from tests.helpers import assert_close
from tests.helpers.conv_bn import conv_bn, conv_bn_params

repmodels = pytest.importorskip("benchmarks.repmodels")

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")


def convs_per_library_fusion(hlo: str) -> list[int]:
    """Convolutions inside each YNNPACK fusion of a compiled module's text."""
    per_comp, cur = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            cur = line.split()[0].lstrip("%")
            per_comp[cur] = 0
        elif cur is not None and " convolution(" in line:
            per_comp[cur] += 1
    return [per_comp.get(c, 0)
            for c in re.findall(r"calls=%([\w.\-]+),[^\n]*__ynn_fusion", hlo)]


@pytest.fixture(scope="module")
def repvgg():
    # large enough that XLA:CPU fuses several of the merged convolutions into one
    apply, v, x = repmodels.make("repvgg", width=32, blocks=6, size=32, batch=8)
    return apply, v, x, jax.jit(apply)(v, x)


@pytest.fixture
def measured(monkeypatch):
    """The option's executable compiled on the first call (not in the background), and the
    timed calls forced: ``measured(default_s, option_s)``."""
    monkeypatch.setattr(T, "BACKGROUND", False)

    def force(default_s, option_s):
        real = T.Tuned._record
        monkeypatch.setattr(T.Tuned, "_record", lambda self, k, dt:
                            real(self, k, (default_s, option_s)[k]))
    return force


def settle(f, *args):
    """Call ``f`` until its program has measured both executables (the first call, then
    SAMPLES of each in bursts); the outputs of every call."""
    return [f(*args) for _ in range(1 + T.MEASURING)]


@cpu_only
def test_the_option_is_kept_where_it_measures_faster(repvgg, measured):
    apply, v, x, ref = repvgg
    if not X.option_supported(X.YNN_FUSION, X.YNN_SINGLE_OPS):
        pytest.skip("this jaxlib does not take the option")
    measured(2e-3, 1e-3)
    f = hlofold.fold(apply)
    assert "measured against them on the first calls" in f.report(v, x).compile_note
    for out in settle(f, v, x):
        assert_close(ref, out, depth=12)
    rep = f.report(v, x)
    assert len(rep.merged) == 6
    assert rep.compile_options == {X.YNN_FUSION: X.YNN_SINGLE_OPS}
    assert "NOTE: compiled with xla_cpu_experimental_ynn_fusion_type" in str(rep)
    assert "2 ms, YNNPACK limited to single ops 1 ms: the limit kept" in rep.compile_note
    assert rep.to_dict()["compile_options"] == rep.compile_options
    # the same program compiled with XLA's defaults fuses several convolutions into one
    # library call; with the option, each convolution is its own
    plain = jax.jit(C.jaxpr_as_fun(f.jaxpr(v, x))).lower(x).compile().as_text()
    assert C.ynn_fused_convolutions(plain) > 1
    ours = convs_per_library_fusion(f.lower(v, x).compile().as_text())
    assert ours.count(1) == 6 and max(ours) == 1
    assert_close(ref, f(v, x), depth=12)
    # under an enclosing jit with the parameters closed over, the prepared program is
    # inlined (a nested jit cannot take compile options: it raised before)
    assert_close(ref, jax.jit(lambda x: f(v, x))(x), depth=12)
    mine = hlofold.fold(jax.jit(apply, compiler_options={"xla_embed_ir_in_executable": True}))
    assert_close(ref, jax.jit(lambda x: mine(v, x))(x), depth=12)
    # the device-prepared apply and split() choose too
    d = hlofold.fold(apply, prepare="device")
    for out in settle(d, v, x):
        assert_close(ref, out, depth=12)
    assert d.report(v, x).compile_options == rep.compile_options
    s = f.split(v, x)
    assert_close(ref, s.apply(s.prepare(v, x), v, x), depth=12)


@cpu_only
def test_the_defaults_are_kept_where_the_option_is_not_faster(repvgg, measured):
    apply, v, x, ref = repvgg
    if not X.option_supported(X.YNN_FUSION, X.YNN_SINGLE_OPS):
        pytest.skip("this jaxlib does not take the option")
    measured(1e-3, 0.98e-3)          # within the margin: XLA's defaults, as jax.jit
    f = hlofold.fold(apply)
    for out in settle(f, v, x):
        assert_close(ref, out, depth=12)
    rep = f.report(v, x)
    assert rep.compile_options == {} and "compiled with" not in str(rep)
    assert "the defaults kept" in rep.compile_note
    ours = f.lower(v, x).compile().as_text()
    plain = jax.jit(C.jaxpr_as_fun(f.jaxpr(v, x))).lower(x).compile().as_text()
    assert convs_per_library_fusion(ours) == convs_per_library_fusion(plain)
    s = f.split(v, x)
    assert_close(ref, s.apply(s.prepare(v, x), v, x), depth=12)


@cpu_only
def test_the_calls_measure_both_in_the_background_and_keep_one(repvgg, monkeypatch):
    """Unforced: the first call runs XLA's defaults while the option compiles in the
    background; once it is ready, calls run the two in turn, in bursts, until each ran
    SAMPLES timed calls, then the faster alone — from eight threads calling at once too;
    every output right."""
    import threading
    apply, v, x, ref = repvgg
    if not X.option_supported(X.YNN_FUSION, X.YNN_SINGLE_OPS):
        pytest.skip("this jaxlib does not take the option")
    seen = []
    real = T.Tuned._record

    def spy(self, k, dt):
        seen.append(k)
        real(self, k, dt)
    monkeypatch.setattr(T.Tuned, "_record", spy)
    f = hlofold.fold(apply)
    assert_close(ref, f(v, x), depth=12)                  # the first call: the defaults
    tuned = f._fast.fn if f._fast is not None else None
    assert isinstance(tuned, T.Tuned) and tuned.chosen is None
    assert not tuned._ready.wait(0.5)                      # a program called once: no more
    assert_close(ref, f(v, x), depth=12)                  # the second starts it
    assert tuned._ready.wait(120)                          # compiled in the background
    outs, errs = [], []

    def call():
        try:
            for _ in range(4):
                outs.append(f(v, x))
        except Exception as e:          # noqa: BLE001
            errs.append(e)
    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs and len(outs) == 32
    for o in outs:
        assert_close(ref, o, depth=12)
    assert tuned.chosen is not None
    assert seen.count(0) >= T.SAMPLES and seen.count(1) >= T.SAMPLES
    rep = f.report(v, x)
    kept = "the limit kept" if rep.compile_options else "the defaults kept"
    assert kept in rep.compile_note and f"on {T.SAMPLES} calls of each" in rep.compile_note
    n = len(seen)
    f(v, x)
    assert len(seen) == n                                  # settled: nothing more timed


@cpu_only
def test_a_program_that_donates_keeps_the_defaults_unmeasured(repvgg, monkeypatch):
    apply, v, x, ref = repvgg
    monkeypatch.setattr(T.Tuned, "_record", lambda *a: pytest.fail("measured"))
    f = hlofold.fold(jax.jit(lambda v, x: apply(v, x), donate_argnums=1))
    assert_close(ref, f(v, x + 0), depth=12)
    rep = f.report(v, x)
    assert rep.compile_options == {} and "donates inputs" in rep.compile_note


@cpu_only
def test_no_merge_no_option():
    p = conv_bn_params(__import__("numpy").random.default_rng(0), c=4)
    x = jax.numpy.ones((2, 6, 6, 4))
    f = hlofold.fold(conv_bn)
    f(p, x)
    rep = f.report(p, x)
    assert rep.num_folded == 1 and not rep.merged
    assert rep.compile_options == {} and "compiled with" not in str(rep)


@cpu_only
def test_the_users_choice_wins(repvgg):
    apply, v, x, ref = repvgg
    mine = {X.YNN_FUSION: ""}
    f = hlofold.fold(jax.jit(apply, compiler_options=mine))
    assert_close(ref, f(v, x), depth=12)
    rep = f.report(v, x)
    assert len(rep.merged) == 6 and rep.compile_options == {}
    assert convs_per_library_fusion(f.lower(v, x).compile().as_text()) == []   # YNN off


def test_a_jaxlib_without_the_option_compiles_without_it(repvgg, monkeypatch):
    apply, v, x, ref = repvgg
    assert not X.option_supported("xla_cpu_no_such_option_hlofold_probe", "1")
    monkeypatch.setattr(X, "YNN_SINGLE_OPS", "LIBRARY_FUSION_TYPE_NO_SUCH_TYPE")
    f = hlofold.fold(apply)
    assert_close(ref, f(v, x), depth=12)
    rep = f.report(v, x)
    assert len(rep.merged) == 6 and rep.compile_options == {}


def test_an_untested_jax_compiles_without_it(repvgg, monkeypatch):
    apply, v, x, ref = repvgg
    monkeypatch.setattr(X, "untested", lambda: True)
    f = hlofold.fold(apply)
    assert_close(ref, f(v, x), depth=12)
    assert f.report(v, x).compile_options == {}


@cpu_only
def test_split_apply_under_the_users_jit_with_the_option_chosen(repvgg, measured):
    apply, v, x, ref = repvgg
    if not X.option_supported(X.YNN_FUSION, X.YNN_SINGLE_OPS):
        pytest.skip("this jaxlib does not take the option")
    measured(2e-3, 1e-3)
    f = hlofold.fold(apply)
    s = f.split(v, x)
    prepared = s.prepare(v, x)
    for _ in range(1 + T.MEASURING):
        assert_close(ref, s.apply(prepared, v, x), depth=12)
    assert f.report(v, x).compile_options
    assert_close(ref, jax.jit(lambda pr, x: s.apply(pr, v, x))(prepared, x), depth=12)


@cpu_only
def test_measuring_runs_each_executable_in_bursts(repvgg, measured, monkeypatch):
    """Each executable runs BURST calls in a row while measuring, the first untimed: call by
    call in turn, each ran on the caches the other left."""
    apply, v, x, ref = repvgg
    if not X.option_supported(X.YNN_FUSION, X.YNN_SINGLE_OPS):
        pytest.skip("this jaxlib does not take the option")
    measured(1e-3, 2e-3)
    seen = []
    real = T.Tuned._record
    monkeypatch.setattr(T.Tuned, "_record", lambda self, k, dt: (seen.append(k),
                                                                 real(self, k, dt)))
    f = hlofold.fold(apply)
    settle(f, v, x)
    timed = T.BURST - 1
    assert seen[:2 * timed] == [0] * timed + [1] * timed
    assert seen.count(0) == seen.count(1) >= T.SAMPLES
    assert f.report(v, x).compile_options == {}
