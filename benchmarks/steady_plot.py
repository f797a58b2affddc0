"""The steady-state benchmark's chart: latency relative to unfolded, compile vs fold time."""
from __future__ import annotations

import numpy as np

from .common import machine_line


def plot(result: dict, path: str) -> None:
    """Bar chart: per model and batch, latency of (b), (b'), (c), (d) relative to (a)
    (median per-round ratio, min–max whiskers), and compile vs fold times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(mk, b) for mk in result["models"] for b in mk["batches"]]
    labels = [f"{mk['title']}\nbatch {b['batch']}" for mk, b in groups]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(7.0, 1.9 * len(groups) + 2), 8.5))
    xs = np.arange(len(groups))
    series = [("b/a", "(b) folded, cached prepare"), ("b'/a", "(b') folded, no cache"),
              ("c/a", "(c) frozen"), ("d/a", "(d) ideal, no BN")]
    w = 0.8 / len(series)
    for i, (key, lab) in enumerate(series):
        med, lo, hi = [], [], []
        for _, b in groups:
            r = b.get("ratios", {}).get(key)
            med.append(r["median"] if r else np.nan)
            lo.append(r["median"] - r["min"] if r else 0)
            hi.append(r["max"] - r["median"] if r else 0)
        pos = xs + (i - (len(series) - 1) / 2) * w
        ax1.bar(pos, med, w, yerr=[lo, hi], capsize=2, label=lab)
        for px, v in zip(pos, med):
            if np.isnan(v):
                ax1.text(px, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=7)
    ax1.axhline(1.0, color="k", lw=0.8, ls="--")
    ax1.set_xticks(xs, labels, fontsize=8)
    ax1.set_ylabel("latency / unfolded (a)\nmedian per-round ratio, min–max")
    ax1.legend(fontsize=8, ncol=2)
    ax1.set_title("Steady-state latency relative to unfolded jax.jit(model.apply)", fontsize=10)

    def med(b, key, field="compile_s"):
        c = b.get("compile", {}).get(key, {}).get(field)
        return c["median"] if c else np.nan

    cseries = ["a", "b", "c", "d", "fold"]
    w = 0.8 / len(cseries)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, key in enumerate(cseries):
        pos = xs + (i - (len(cseries) - 1) / 2) * w
        if key == "fold":
            vals = [b["fold"]["fold_jaxpr_s"]["median"] if b.get("fold") else np.nan
                    for _, b in groups]
            ax2.bar(pos, vals, w, color=colors[4], hatch="//", label="hlofold fold_jaxpr")
        elif key == "b":
            app = [med(b, "b", "apply_compile_s") for _, b in groups]
            ax2.bar(pos, app, w, color=colors[1], label="(b) XLA compile, apply program")
        else:
            lab = {"a": "(a) XLA compile", "c": "(c) XLA compile, frozen",
                   "d": "(d) XLA compile"}[key]
            ax2.bar(pos, [med(b, key) for _, b in groups], w, color=colors[i], label=lab)
    ax2.set_xticks(xs, labels, fontsize=8)
    ax2.set_ylabel("seconds (median of AOT reps)")
    ax2.legend(fontsize=8, ncol=2)
    ax2.set_title("Compile time vs hlofold fold time", fontsize=10)
    m = result["machine"]
    fig.suptitle("hlofold BatchNorm folding" + (" (QUICK smoke run)" if result["config"].get(
        "quick") else ""), fontsize=12)
    fig.text(0.01, 0.005, machine_line(m) + f"; {m['date_utc']}", fontsize=7, ha="left",
             va="bottom")
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
