"""The steady-state benchmark's Markdown: the summary table, one section per model and batch,
the method, and the targets (``benchmarks.run``; its chart is ``benchmarks.steady_plot``)."""
from __future__ import annotations

import json
import os
import sys

from .common import error_text
from .hlo_stats import CUDNN_BIAS_ACT
from .steady_plot import plot

VARIANTS = ["a", "b", "b'", "c", "d"]
LABELS = {
    "a": "unfolded: jax.jit(model.apply)",
    "b": "hlofold.fold(jax.jit(model.apply)), params as inputs, cached prepare",
    "b'": "hlofold.fold(jax.jit(model.apply), cache_prepared=False)",
    "c": "hlofold.fold(model.apply, freeze=0) (params frozen)",
    "d": "ideal: jax.jit(model_without_bn.apply) on hand-folded params",
}
SHORT = {"a": "unfolded", "b": "folded", "b'": "folded, no cache", "c": "frozen",
         "d": "ideal (no BN)"}
RATIOS = [("b", "a"), ("b'", "a"), ("c", "a"), ("d", "a"), ("b", "d"), ("c", "d")]
PROGRAMS = [("a", "(a) unfolded"), ("b_apply", "(b) apply program"), ("c", "(c) frozen"),
            ("d", "(d) ideal")]
FLAX_MODELS = ["resnet18", "resnet50", "mobilenetv2"]
JAX_MODELS = ["jax-resnet18", "jax-resnet50"]
TITLES = {"resnet18": "ResNet-18", "resnet50": "ResNet-50", "mobilenetv2": "MobileNetV2",
          "jax-resnet18": "ResNet-18 (plain JAX)", "jax-resnet50": "ResNet-50 (plain JAX)"}


def _ms(s):
    return f"{1e3 * s:.1f}" if s >= 0.01 else f"{1e3 * s:.2f}"


def _mb(b):
    return "–" if b is None else f"{b / 2 ** 20:.1f}"


def _ratio(b, key):
    r = b.get("ratios", {}).get(key)
    return f"{r['median']:.3f} [{r['min']:.2f}–{r['max']:.2f}]" if r else "–"


SUMMARY_PROGRAMS = ("a", "b_apply", "d")


def common_blocks(b, blocks) -> list[str]:
    """The residual blocks that no compared program ((a), (b) apply, (d)) has swallowed into a
    spanning fusion: per-block fusion counts are comparable on these."""
    h = b.get("hlo", {})
    gone = set()
    for p in SUMMARY_PROGRAMS:
        gone |= set(h.get(p, {}).get("spanned_blocks", ()))
    return [blk for blk in blocks if blk not in gone]


def _fpb(b, prog, blocks):
    """Mean ENTRY fusions per residual block of one program, over ``blocks``."""
    h = b.get("hlo", {}).get(prog)
    if not h or not blocks:
        return None
    return sum(h["fusions_per_block"].get(blk, 0) for blk in blocks) / len(blocks)


def summary_table(result: dict) -> list[str]:
    """The headline table: one row per model and batch."""
    gpu = result["machine"]["backend"] == "gpu"
    L = ["| model | batch | (a) unfolded ms | (b)/(a) | (b')/(a) | (c)/(a) | (b)/(d) | (c)/(d) "
         "| fold ms (% of XLA compile of (a)) | fusions per residual block (a) → (b) → (d) |"
         + (f" `{CUDNN_BIAS_ACT}` (a) → (b) → (d) |" if gpu else ""),
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else "")]
    for mk in result["models"]:
        for b in mk["batches"]:
            lat = b.get("latency_s", {})
            a = _ms(lat["a"]["median"]) if "a" in lat else "–"
            fv = b.get("fold_vs_compile_a")
            fold = (f"{1e3 * fv['fold_jaxpr_median_s']:.1f} ({fv['percent']:.1f}%)"
                    if fv else "–")
            blocks = common_blocks(b, mk.get("blocks") or [])
            fus = " → ".join("–" if _fpb(b, p, blocks) is None else f"{_fpb(b, p, blocks):.1f}"
                             for p in SUMMARY_PROGRAMS)
            nbl = len(mk.get("blocks") or [])
            if blocks and len(blocks) < nbl:
                fus += f" ({len(blocks)}/{nbl} blocks†)"
            L.append(f"| {mk['title']} | {b['batch']} | {a} | {_ratio(b, 'b/a')} | "
                     f"{_ratio(b, 'b' + chr(39) + '/a')} | {_ratio(b, 'c/a')} | "
                     f"{_ratio(b, 'b/d')} | {_ratio(b, 'c/d')} | {fold} | {fus} |"
                     + (" " + " → ".join(str(b.get("hlo", {}).get(p, {}).get(
                         "cudnn_conv_bias_activation", "–")) for p in ("a", "b_apply", "d"))
                        + " |" if gpu else ""))
    return L


def to_markdown(result: dict, png: str | None = None) -> str:
    m, cfg = result["machine"], result["config"]
    L = []
    names = ", ".join(mk["title"] for mk in result["models"])
    L.append(f"# BatchNorm folding benchmark: {names} ({m['backend'].upper()})\n")
    if cfg.get("quick"):
        L.append("**Quick (smoke) run: tiny networks and few rounds; the figures say nothing "
                 "about performance.**\n")
    if cfg.get("note"):
        L.append(f"**Note: {cfg['note']}**\n")
    L.append(f"Command: `{result['command']}`\n")
    L.append(f"- Machine: {m['cpu_model']} ({', '.join(m['cpu_isa']) or 'no AVX2/AVX-512 flags'}), "
             f"{m['sched_affinity_cpus']} usable cores (os.cpu_count={m['os_cpu_count']}), "
             f"{m['platform']}")
    L.append(f"- Device: {m['backend']} `{m['device_kind']}` ({', '.join(m['devices'])})")
    L.append(f"- Software: Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, "
             f"flax {m['flax']}, numpy {m['numpy']}, hlofold {m['hlofold']}; "
             f"XLA_FLAGS=`{m['XLA_FLAGS'] or '(unset)'}`")
    L.append(f"- Date (UTC): {m['date_utc']}")
    c = result.get("code", {})
    dirty = [d for d, k in (("hlofold/", "hlofold_dirty"), ("benchmarks/", "benchmarks_dirty"))
             if c.get(k)]
    L.append(f"- Code: git {c.get('git_commit')}"
             + (f" with uncommitted changes in {' and '.join(dirty)}" if dirty else "")
             + f", hlofold sources sha256 {c.get('hlofold_sources_sha256')}")
    L.append(f"- Timing: {cfg['warmup']} warm-up calls per variant, then {cfg['rounds']} rounds; each "
             "round calls every variant once, in an order rotated by one each round; every call is "
             "wall-clock `time.perf_counter` around `jax.block_until_ready(f(params, x))` in one "
             "process. Ratios are computed per round (same round numerator/denominator) and "
             "summarised as median [min–max].")
    L.append(f"- Total runtime: {result['total_runtime_s']:.0f} s; process peak RSS "
             f"{result['process_memory']['peak_rss_mb']:.0f} MB.")
    L.append("")
    L.append("Variants:\n")
    for v in VARIANTS:
        L.append(f"- **({v})** {LABELS[v]}")
    L.append("")
    L.append("Networks (Flax linen, `benchmarks/models.py`; BN statistics drawn per channel: "
             "γ ~ 1+0.2·N, β ~ 0.1·N, μ ~ 0.2·N, σ² ~ exp(0.5·N); (d) is the same network built "
             "with `use_bn=False`, conv + bias, parameters `K·s`, `β−μ·s` computed in float64):\n")
    for mk in result["models"]:
        i = mk["info"]
        L.append(f"- {mk['title']}: {i['library']}, {i['num_bn']} BatchNorms, {i['num_blocks']} "
                 f"residual blocks, {i['num_params'] / 1e6:.2f} M parameters "
                 f"({i['param_mb']:.1f} MB), {i['dtype']}, NHWC {i['image_size']}×"
                 f"{i['image_size']}×3, {i['num_classes']} classes"
                 + (f", width {i['width']}" if "width" in i else "")
                 + (f", width multiplier {i['width_mult']}" if "width_mult" in i else ""))
    L.append("")
    L.append("## Summary\n")
    L.extend(summary_table(result))
    L.append("")
    L.append("Ratios: median [min–max] of per-round ratios; below 1 means faster than the "
             "denominator. Fold ms: `hlofold.fold_jaxpr` on the traced jaxpr (tracing excluded). "
             "Fusions per residual block: ENTRY-level fusions of the optimized HLO whose root's "
             "`op_name` lies in a residual block, averaged over the blocks; †: averaged only "
             "over the blocks that none of (a), (b), (d) swallowed into a fusion ending outside "
             "them (XLA:CPU's YNNPACK fuses the last blocks into one fusion ending at the "
             "head's mean; *spanning* fusions, see the batch sections).\n")
    if png:
        L.append(f"![latency relative to unfolded, compile times]({png})\n")
    errs: dict = {}
    for mk in result["models"]:
        if mk.get("error"):
            errs.setdefault((mk["title"], "build"), ([], mk["error"]))[0].append("-")
        for b in mk["batches"]:
            for k, v in b["errors"].items():
                errs.setdefault((mk["title"], k), ([], v))[0].append(str(b["batch"]))
    if errs:
        L.append("## Failures\n")
        for (t, k), (bts, v) in errs.items():
            L.append(f"- {t}, variant/step `{k}`, batch {', '.join(bts)} (first error):"
                     f"\n\n```\n{v.strip()}\n```")
        L.append("")
    for mk in result["models"]:
        for b in mk["batches"]:
            L.extend(_batch_section(mk, b, cfg, m))
    L.append("## Method\n")
    L.append("Counting method (optimized HLO, `jax.jit(...).lower(...).compile().as_text()`): "
             "every instruction line `%name = <shape> <opcode>(…)` is parsed; *fusions* counts "
             "opcode `fusion` anywhere in the module; *entry ops* counts ENTRY instructions except "
             "parameter/constant/bitcast/get-tuple-element/tuple (≈ kernels launched); "
             "*convolutions* counts opcode `convolution` anywhere, including inside fused "
             "computations; *per block*: an ENTRY fusion belongs to the block named in its "
             "`op_name` metadata (that of the fusion's root; `/stage<s>_block<i>/`, "
             "`/block<i>/`), counted once; *multi-block* fusions hold ops of several blocks in "
             "their fused computation (e.g. a block's residual add fused into the next block's "
             "conv); *spanning* fusions end outside any block but take in blocks (XLA:CPU's "
             "YNNPACK can fuse whole stages into one fusion ending at the head's mean), so "
             "those blocks show few or no fusions of their own; fusions outside any block "
             "(stem, head, kernel re-layouts without metadata) are not in the per-block "
             "figures. "
             "On GPU, *cuDNN* counts `custom-call`s with a `__cudnn$conv…` target and, separately, "
             f"`{CUDNN_BIAS_ACT}` (conv fused with bias and activation).\n")
    L.append("Compile-time method: (a),(d): `jax.jit(f).lower(params, x)` then `.compile()`, timed "
             "separately. (c): `Folded.lower(params, x)` (trace + fold + lower) then `.compile()`. "
             "(b): `Folded.split(params, x)` (trace + fold + prepare/apply split) then lower and "
             "compile of the apply and prepare jaxprs, which are the two executables (b) runs. "
             "Each rep uses fresh Python function objects so no JAX trace/compile cache is hit. "
             "Fold time: `hlofold.fold_jaxpr(jax.make_jaxpr(f)(params, x))`, tracing timed "
             "separately and excluded.\n")
    L.append("Memory method: per program, XLA's `compiled.memory_analysis()` (buffer assignment "
             "of the compiled executable): arguments, outputs, temporaries, and "
             "`peak_memory_in_bytes` where the backend reports it (0 or absent on CPU). Frozen "
             "constants of (c) are part of the executable, not of its arguments. (b) keeps the "
             "prepared (folded) parameters cached next to the original ones: *prepared MB*. "
             "Process memory: RSS from `/proc/self/statm` after each batch and the process peak "
             "(`getrusage` `ru_maxrss`), which covers every variant of every model measured so "
             "far in the one process, so it is an upper bound, not a per-variant figure.\n")
    return "\n".join(L)


def _batch_section(mk: dict, b: dict, cfg: dict, m: dict) -> list[str]:
    L = [f"## {mk['title']}, batch {b['batch']}\n"]
    lat = b.get("latency_s", {})
    L.append("| variant | median ms | min–max ms | first call s | max abs diff vs (a) |")
    L.append("|---|---:|---:|---:|---:|")
    for v in VARIANTS:
        if v not in lat:
            L.append(f"| ({v}) {LABELS[v]} | failed | | | |")
            continue
        s = lat[v]
        L.append(f"| ({v}) {LABELS[v]} | {_ms(s['median'])} | {_ms(s['min'])}–{_ms(s['max'])} | "
                 f"{b['first_call_s'][v]:.2f} | {b['max_abs_diff_vs_a'].get(v, float('nan')):.1e} |")
    if b.get("max_abs_logit_a"):
        L.append(f"\n(max |logit| of (a): {b['max_abs_logit_a']:.3g}, so the largest relative "
                 f"difference is {max(b['max_abs_diff_vs_a'].values()) / b['max_abs_logit_a']:.1e}; "
                 f"1-min load average before/after: {b['loadavg_before']} / {b['loadavg_after']})\n")
    L.append("| per-round ratio | median | min–max |")
    L.append("|---|---:|---:|")
    for k, s in b["ratios"].items():
        n, d = k.split("/")
        L.append(f"| ({n})/({d}) | {s['median']:.3f} | {s['min']:.3f}–{s['max']:.3f} |")
    c = b.get("compile", {})
    L.append(f"\nCompile / transform cost (median of {cfg['compile_reps']} AOT reps, fresh "
             "function objects each rep):\n")
    L.append("| program | trace+lower s | XLA compile s |")
    L.append("|---|---:|---:|")
    if "a" in c:
        L.append(f"| (a) unfolded | {c['a']['lower_s']['median']:.3f} | {c['a']['compile_s']['median']:.3f} |")
    if "d" in c:
        L.append(f"| (d) ideal | {c['d']['lower_s']['median']:.3f} | {c['d']['compile_s']['median']:.3f} |")
    if "c" in c:
        L.append(f"| (c) frozen (`Folded.lower` incl. trace+fold; then `.compile()`) | "
                 f"{c['c']['lower_s']['median']:.3f} | {c['c']['compile_s']['median']:.3f} |")
    if "b" in c and "apply_compile_s" in c["b"]:
        L.append(f"| (b) `Folded.split` (trace+fold+host prepare), apply program | "
                 f"{c['b']['split_s']['median']:.3f} + {c['b']['apply_lower_s']['median']:.3f} | "
                 f"{c['b']['apply_compile_s']['median']:.3f} |")
        if "prepare_compile_s" in c["b"]:
            L.append(f"| (b) prepare program | {c['b']['prepare_lower_s']['median']:.3f} | "
                     f"{c['b']['prepare_compile_s']['median']:.3f} |")
    f, fv = b.get("fold"), b.get("fold_vs_compile_a")
    if f:
        L.append(f"\nhlofold transform alone: `hlofold.fold_jaxpr(jax.make_jaxpr(f)(params, x))` "
                 f"= **{1e3 * f['fold_jaxpr_s']['median']:.1f} ms** median "
                 f"({1e3 * f['fold_jaxpr_s']['min']:.1f}–{1e3 * f['fold_jaxpr_s']['max']:.1f} ms, "
                 f"{f['fold_jaxpr_s']['n']} reps; jaxpr of {f['jaxpr_eqns']} equations incl. nested; "
                 f"tracing itself {1e3 * f['trace_s']['median']:.1f} ms, not included)"
                 + (f". Relative to XLA compile of (a) ({fv['compile_a_median_s']:.3f} s): "
                    f"**{fv['percent']:.1f}%** (of lower+compile: "
                    f"{fv['percent_of_lower_plus_compile']:.1f}%)" if fv else "")
                 + f". Fold report: {f['report_counts']}.\n")
    if b.get("first_call_overhead_s"):
        L.append("First-call overhead (first call − steady-state median; includes trace, "
                 "hlofold fold/split where applicable, XLA compile(s), prepare run, first run): "
                 + ", ".join(f"({v}) {s:.2f} s" for v, s in b["first_call_overhead_s"].items())
                 + "\n")
    h, mem = b.get("hlo", {}), b.get("memory", {})
    gpu = m["backend"] == "gpu"
    L.append("Optimized HLO and memory (`compiled.memory_analysis()`, MB):\n")
    head = ("| program | fusions (by kind) | entry ops | convolutions | entry constants "
            "| fusions in blocks (mean per block) | multi-block / spanning (blocks) | args MB "
            "| temp MB | output MB |")
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if gpu:
        head += " cuDNN convs | of which conv+bias+act |"
        sep += "---:|---:|"
    L.append(head)
    L.append(sep)
    nb = mk["info"]["num_blocks"] or 1
    for key, name in PROGRAMS:
        if key not in h:
            continue
        hh, mm = h[key], mem.get(key) or {}
        kinds = ", ".join(f"{k}:{v}" for k, v in hh["fusion_kinds"].items())
        row = (f"| {name} | {hh['fusions']} ({kinds}) | {hh['entry_ops']} | "
               f"{hh['convolutions']} | {hh['constants_in_entry']} | "
               f"{hh['fusions_in_blocks']} ({hh['fusions_in_blocks'] / nb:.2f}) | "
               f"{hh.get('multi_block_fusions', 0)} / {hh.get('spanning_fusions', 0)} "
               f"({hh.get('blocks_in_spanning_fusions', 0)}) | "
               f"{_mb(mm.get('argument_size'))} | {_mb(mm.get('temp_size'))} | "
               f"{_mb(mm.get('output_size'))} |")
        if gpu:
            row += f" {hh['cudnn_convs']} | {hh['cudnn_conv_bias_activation']} |"
        L.append(row)
    pr = b.get("prepared", {})
    if pr.get("prepared_mb") is not None:
        L.append(f"\n(b) caches {pr['prepared_mb']:.1f} MB of prepared (folded) parameters, "
                 f"computed from {pr['prepared_from']} parameter arrays, next to the "
                 f"{mk['info']['param_mb']:.1f} MB of original parameters.")
    pm = b.get("process_memory", {})
    L.append(f"Process RSS after this batch {pm.get('rss_mb') or 0:.0f} MB, peak so far "
             f"{pm.get('peak_rss_mb') or 0:.0f} MB"
             + (f"; device memory {b['device_memory']}" if b.get("device_memory") else "") + ".\n")
    blocks = mk.get("blocks") or []
    if blocks and any(h.get(k, {}).get("fusions_per_block") for k in ("a", "b_apply", "d")):
        L.append("<details><summary>Fusions per residual block (ENTRY fusions by their "
                 "root's op_name): (a) / (b) apply / (c) / (d)</summary>\n")
        L.append("| block | (a) | (b) apply | (c) | (d) |")
        L.append("|---|---:|---:|---:|---:|")
        for blk in blocks:
            vals = [(str(h[k]["fusions_per_block"].get(blk, 0))
                     + ("*" if blk in h[k].get("spanned_blocks", ()) else "")) if k in h else "–"
                    for k in ("a", "b_apply", "c", "d")]
            L.append(f"| {blk} | " + " | ".join(vals) + " |")
        L.append("\n\\*: (part of) the block is inside a fusion that ends outside it "
                 "(spanning).\n\n</details>\n")
    return L


def assess(result: dict) -> list[str]:
    lines = []
    for mk in result["models"]:
        for b in mk["batches"]:
            for v in ("b", "c"):
                r = b["ratios"].get(f"{v}/a")
                if not r:
                    lines.append(f"- {mk['title']} batch {b['batch']}: ({v}) not measured.")
                    continue
                la, lv = b["latency_s"]["a"]["median"], b["latency_s"][v]["median"]
                ok_lat, ok_ratio = lv <= la, r["median"] <= 1.0
                verdict = ("meets target ≤ (a) on both." if ok_lat and ok_ratio else
                           "**falls short of target ≤ (a) on both.**" if not (ok_lat or ok_ratio)
                           else "**mixed**: " + ("median latency meets, " if ok_lat else
                                                 "median latency falls short, ")
                           + ("per-round ratio meets." if ok_ratio else
                              "per-round ratio falls short."))
                lines.append(f"- {mk['title']} batch {b['batch']}: ({v}) median "
                             f"{1e3 * lv:.2f} ms vs (a) {1e3 * la:.2f} ms; per-round ({v})/(a) "
                             f"{r['median']:.3f} [{r['min']:.3f}–{r['max']:.3f}]: " + verdict)
            fv = b.get("fold_vs_compile_a")
            if fv:
                lines.append(f"- {mk['title']} batch {b['batch']}: fold time "
                             f"{1e3 * fv['fold_jaxpr_median_s']:.1f} ms = {fv['percent']:.1f}% of "
                             f"(a) XLA compile {fv['compile_a_median_s']:.3f} s: "
                             + ("meets target < 5%." if fv["percent"] < 5 else
                                "**falls short of target < 5%.**"))
    return lines


def write_outputs(result: dict, out: str, stem: str, plot_png: bool = True) -> str | None:
    os.makedirs(out, exist_ok=True)
    png = None
    if plot_png:
        try:
            plot(result, os.path.join(out, stem + ".png"))
            png = stem + ".png"
        except Exception as e:  # noqa: BLE001 -- the tables matter more than the chart
            print(f"chart FAILED: {error_text(e)}", file=sys.stderr)
            result["plot_error"] = error_text(e)
    md = to_markdown(result, png)
    md += "\n## Targets\n\n" + "\n".join(result["assessment"]) + "\n"
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(md)
    return png


def render(path: str, out: str, name: str | None) -> int:
    with open(path) as f:
        result = json.load(f)
    result["assessment"] = assess(result)
    stem = name or os.path.splitext(os.path.basename(path))[0]
    write_outputs(result, out, stem)
    print("\n".join(summary_table(result)))
    return 0
