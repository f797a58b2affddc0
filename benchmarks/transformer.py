"""A Llama-style decoder under ``hlofold.fold`` next to ``jax.jit`` (issue 29): the
``transformer`` part of ``python -m benchmarks.calls``.

The decoder is ``hlofold.examples`` (RMSNorm → q, k, v, o; RMSNorm → gate, up, down):
8 layers, d = 2048, FFN 5632, vocab 32000 — 0.54 B parameters, 2.17 GB in float32 — on 16
tokens (``--quick``: 2 layers, d = 64). Measured, each next to doing nothing:

* **first call** of ``fold(f)`` and of ``jax.jit(f)``: trace + fold + compile + run, each
  sample in a fresh process, variants interleaved; in the same processes the **peak memory**
  growth of the calls (the process's high-water mark reset after the parameters are made);
* **steady calls**, interleaved round by round in one process;
* **a call with new parameter values** (a training loop that evaluates): each timed call
  gets a parameter tree of new arrays (made and finished before the clock starts);
* **prepare throughput**, both ways, with every norm folded (``fold_costly=True``, which the
  cost rule leaves by default): the host prepare and the prepare program on the
  parameters' devices, and :func:`hlofold.fold_params` (time and peak memory growth next
  to the bytes of the leaves it rewrites).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

FULL = {"layers": 8, "d": 2048, "ffn": 5632, "vocab": 32000, "tokens": 16}
QUICK = {"layers": 2, "d": 64, "ffn": 128, "vocab": 256, "tokens": 8}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """Free memory the allocator keeps back to the system (else a call reusing it shows no
    growth), then VmHWM := VmRSS (Linux)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _live_bytes() -> int:
    import jax
    return int(sum(a.nbytes for a in jax.live_arrays()))


def _model(cfg):
    import jax.numpy as jnp
    from hlofold import examples
    p = examples.init_decoder(cfg["layers"], d=cfg["d"], ffn=cfg["ffn"], vocab=cfg["vocab"])
    tokens = jnp.asarray(np.arange(cfg["tokens"])[None] % cfg["vocab"], jnp.int32)
    if cfg.get("scanned"):          # the MaxText layout: one scan over stacked layers
        return examples.scanned_decoder_apply, examples.stack_decoder(p), tokens
    return examples.decoder_apply, p, tokens


def worker(variant: str, quick: bool, scanned: bool = False) -> dict:
    """In a fresh process: the first call of ``variant`` and the peak memory it adds."""
    import jax
    import hlofold
    f, p, tokens = _model({**(QUICK if quick else FULL), "scanned": scanned})
    jax.block_until_ready(p)
    g = jax.jit(f) if variant == "jit" else hlofold.fold(f)
    live = _live_bytes()
    _reset_peak()
    rss = _status("VmHWM")             # the high-water mark starts from here
    t0 = time.perf_counter()
    y = jax.block_until_ready(g(p, tokens))
    first = time.perf_counter() - t0
    for _ in range(2):
        y = jax.block_until_ready(g(p, tokens))
    out = {"first_s": first, "peak_growth_bytes": _status("VmHWM") - rss,
           "held_bytes": _live_bytes() - live - y.nbytes,     # arrays kept beside p
           "param_bytes": int(sum(a.nbytes for a in jax.tree.leaves(p)))}
    if variant == "fold":
        out["report"] = g.report(p, tokens).counts()
    return out


def _run_worker(variant: str, quick: bool, scanned: bool = False) -> dict:
    from .common import run_worker
    return json.loads(run_worker(
        ["-m", "benchmarks.transformer", "--worker", variant] + (["--quick"] if quick else [])
        + (["--scanned"] if scanned else []), timeout=1800, env={"JAX_PLATFORMS": "cpu"}))


def measure(quick: bool, rounds: int, log, scanned: bool = False) -> dict:
    """Every figure of the part (see the module docstring); ``scanned``: the same decoder
    as one ``lax.scan`` over stacked layers (``examples.scanned_decoder_apply``)."""
    import jax
    import hlofold
    from .common import ratio, summary
    cfg = {**(QUICK if quick else FULL), "scanned": scanned}
    res: dict = {"config": cfg}
    firsts = {"jit": [], "fold": []}
    for r in range(rounds):
        for v in (("jit", "fold") if r % 2 == 0 else ("fold", "jit")):
            firsts[v].append(_run_worker(v, quick, scanned))
            log(f"transformer first call {v}: {firsts[v][-1]['first_s']:.2f} s")
    res["first_call"] = {v: summary([w["first_s"] for w in ws]) for v, ws in firsts.items()}
    res["first_call_fold_vs_jit"] = ratio(res["first_call"]["fold"], res["first_call"]["jit"])
    res["param_bytes"] = firsts["jit"][0]["param_bytes"]
    res["peak_growth_bytes"] = {v: summary([w["peak_growth_bytes"] for w in ws])
                                for v, ws in firsts.items()}
    res["peak_growth_fold_minus_jit_vs_params"] = (
        res["peak_growth_bytes"]["fold"]["median"] - res["peak_growth_bytes"]["jit"]["median"]
    ) / res["param_bytes"]
    res["held_bytes"] = {v: max(w["held_bytes"] for w in ws) for v, ws in firsts.items()}
    res["report"] = firsts["fold"][0]["report"]

    f, p, tokens = _model(cfg)
    fns = {"jit": jax.jit(f), "fold": hlofold.fold(f)}
    for g in fns.values():
        jax.block_until_ready(g(p, tokens))
    steady = {k: [] for k in fns}
    fresh = {k: [] for k in fns}
    for r in range(rounds * 2):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(fns[k](p, tokens))
            steady[k].append(time.perf_counter() - t0)
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            q = jax.block_until_ready(jax.tree.map(lambda a: a * 1, p))   # new arrays
            t0 = time.perf_counter()
            jax.block_until_ready(fns[k](q, tokens))
            fresh[k].append(time.perf_counter() - t0)
            del q
    res["steady"] = {k: summary(v) for k, v in steady.items()}
    res["steady_fold_vs_jit"] = ratio(res["steady"]["fold"], res["steady"]["jit"])
    res["new_params"] = {k: summary(v) for k, v in fresh.items()}
    res["new_params_fold_vs_jit"] = ratio(res["new_params"]["fold"], res["new_params"]["jit"])
    log(f"transformer steady {res['steady_fold_vs_jit']:.3f}x, new parameters "
        f"{res['new_params_fold_vs_jit']:.3f}x")
    res["prepare"] = _prepare_both_ways(f, p, tokens, log)
    return res


def _prepare_both_ways(f, p, tokens, log) -> dict:
    """Every norm folded (``fold_costly=True``): the prepare step on the host and on the
    parameters' devices, and fold_params; seconds and peak memory growth."""
    import jax
    import hlofold
    out = {}
    for where in ("host", "device"):
        g = hlofold.fold(f, fold_costly=True, prepare=where)
        sp = g.split(p, tokens)                     # trace, plan (and compile: device)
        q = jax.block_until_ready(jax.tree.map(lambda a: a * 1, p))     # new values
        _reset_peak()
        rss = _status("VmHWM")
        t0 = time.perf_counter()
        prepared = jax.block_until_ready(sp.prepare(q, tokens))
        out[where] = {"seconds": time.perf_counter() - t0,
                      "peak_growth_bytes": _status("VmHWM") - rss,
                      "folded": sp.report.num_folded,
                      "prepared_bytes": int(sum(a.nbytes for a in prepared))}
        del prepared, sp, g, q
        log(f"prepare on the {where}: {out[where]['seconds']:.2f} s")
    jax.clear_caches()      # fold_params compiles what it runs (its check program), as
    _reset_peak()           # in a process that has not prepared these shapes before
    rss = _status("VmHWM")
    t0 = time.perf_counter()
    written = hlofold.fold_params(f, p, tokens)
    out["fold_params"] = {"seconds": time.perf_counter() - t0,
                          "peak_growth_bytes": _status("VmHWM") - rss,
                          "sites": len(written.changes),
                          "rewritten_bytes": _rewritten_bytes(p, written.params)}
    rewritten = [a for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(written.params))
                 if a is not b]
    del written
    copy = jax.jit(lambda xs: [a * 1 for a in xs]).lower(rewritten).compile()
    t0 = time.perf_counter()
    jax.block_until_ready(copy(rewritten))        # one new copy of the same leaves, for scale
    out["fold_params"]["copy_seconds"] = time.perf_counter() - t0
    log(f"fold_params: {out['fold_params']['seconds']:.2f} s (a copy of its leaves: "
        f"{out['fold_params']['copy_seconds']:.2f} s)")
    return out


def _rewritten_bytes(old, new) -> int:
    import jax
    return int(sum(a.nbytes for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))
                   if a is not b))


def markdown(t: dict) -> list[str]:
    """The part's section of the calls report."""
    def s(x):
        return f"{1e3 * x['median']:.1f} [{1e3 * x['min']:.1f}–{1e3 * x['max']:.1f}]"
    c, pb = t["config"], t["param_bytes"]
    form = "as one scan over stacked layers" if c.get("scanned") else "a Llama-style decoder"
    L = ["", f"## 7. Transformer: {form} ({c['layers']} layers, d = {c['d']}, "
         f"{pb / 4e9:.2f} B parameters, {pb / 2 ** 30:.2f} GiB; {c['tokens']} tokens)", "",
         f"Sites under `hlofold.fold`: {t['report']} (every norm left by the cost rule: its "
         "per-token factor's pass stays).", "",
         "| what | jax.jit(f) | fold(f) | fold / jit |", "|---|---|---|---|",
         f"| first call, ms (fresh processes) | {s(t['first_call']['jit'])} | "
         f"{s(t['first_call']['fold'])} | **{t['first_call_fold_vs_jit']:.2f}×** |",
         f"| steady call, ms | {s(t['steady']['jit'])} | {s(t['steady']['fold'])} | "
         f"**{t['steady_fold_vs_jit']:.3f}×** |",
         f"| call with new parameter values, ms | {s(t['new_params']['jit'])} | "
         f"{s(t['new_params']['fold'])} | **{t['new_params_fold_vs_jit']:.2f}×** |",
         f"| peak memory growth of the first calls, GiB | "
         f"{t['peak_growth_bytes']['jit']['median'] / 2 ** 30:.2f} | "
         f"{t['peak_growth_bytes']['fold']['median'] / 2 ** 30:.2f} | "
         f"**{t['peak_growth_fold_minus_jit_vs_params']:+.3f}× the parameters** |"]
    if "held_bytes" in t:
        L.append(f"| arrays held beside the parameters after the calls, MiB | "
                 f"{t['held_bytes']['jit'] / 2 ** 20:.1f} | {t['held_bytes']['fold'] / 2 ** 20:.1f}"
                 f" | **{(t['held_bytes']['fold'] - t['held_bytes']['jit']) / pb:+.4f}× the "
                 "parameters** |")
    L.append("")
    pr = t["prepare"]
    L += ["Every norm folded (`fold_costly=True`), the prepare step both ways, and "
          "`fold_params`:", "", "| step | seconds | peak memory growth, GiB | notes |",
          "|---|---|---|---|"]
    for where in ("host", "device"):
        r = pr[where]
        L.append(f"| prepare on the {where} | {r['seconds']:.2f} | "
                 f"{r['peak_growth_bytes'] / 2 ** 30:.2f} | {r['folded']} sites, "
                 f"{r['prepared_bytes'] / 2 ** 30:.2f} GiB prepared |")
    fp = pr["fold_params"]
    L.append(f"| `fold_params` | {fp['seconds']:.2f} | {fp['peak_growth_bytes'] / 2 ** 30:.2f} "
             f"| {fp['sites']} sites; the leaves it rewrites: "
             f"{fp['rewritten_bytes'] / 2 ** 30:.2f} GiB |")
    if "copy_seconds" in fp:
        L.append(f"| for scale: one copy of those leaves (`jax.jit`, `a * 1`) | "
                 f"{fp['copy_seconds']:.2f} | — | what making "
                 f"{fp['rewritten_bytes'] / 2 ** 30:.2f} GiB of new arrays costs here |")
    return L


def main() -> None:
    """``python -m benchmarks.transformer --scanned [--quick] [--rounds N]``: the scanned
    decoder's section, written to ``docs/benchmarks/scanned_decoder_cpu.{md,json}`` (the
    unscanned one is part 7 of ``benchmarks.calls``)."""
    import platform
    quick = "--quick" in sys.argv
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    res = measure(quick, rounds, lambda m: print(m, flush=True), scanned=True)
    res["machine"] = f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor()}"
    if quick:
        print(json.dumps(res, indent=1, default=str))
        return
    base = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks",
                        "scanned_decoder_cpu")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    L = ["# The 0.54 B decoder as a scanned stack (MaxText layout), `fold(f)` vs `jax.jit(f)`",
         "", f"Machine: {res['machine']}; `python -m benchmarks.transformer --scanned "
         f"--rounds {rounds}`.", ""] + markdown(res)
    with open(base + ".md", "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        print(json.dumps(worker(sys.argv[sys.argv.index("--worker") + 1],
                                "--quick" in sys.argv, "--scanned" in sys.argv)))
    elif "--scanned" in sys.argv:
        main()
