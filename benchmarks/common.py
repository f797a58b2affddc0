"""What every benchmark shares: timing, medians with spreads, ratios, and the stamp of the
machine and the code a figure came from."""
from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback

import jax
import numpy as np

import hlofold


def now() -> float:
    return time.perf_counter()


def timed(fn, *args):
    t0 = now()
    out = jax.block_until_ready(fn(*args))
    return now() - t0, out


def summary(xs) -> dict:
    xs = [float(x) for x in xs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def steady(fns: dict, args: dict, rounds: int, calls: int) -> dict:
    """Steady calls of each ``fns[name](*args[name])`` (compiled and warm first), in
    interleaved rounds of ``calls`` calls: ms per call, a :func:`summary` per name."""
    times = steady_rounds(fns, args, rounds, calls)
    return {name: summary(ts) for name, ts in times.items()}


def steady_rounds(fns: dict, args: dict, rounds: int, calls: int,
                  rotate: bool = False) -> dict:
    """:func:`steady`'s per-round times (ms per call), for ratios paired by round;
    ``rotate``: each round starts at the next variant (no variant always runs first)."""
    for name, fn in fns.items():                  # compiled and warm
        jax.block_until_ready(fn(*args[name]))
        jax.block_until_ready(fn(*args[name]))
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        k = r % len(names) if rotate else 0
        for name in names[k:] + names[:k]:
            fn, a = fns[name], args[name]
            t0 = now()
            for _ in range(calls):
                out = fn(*a)
            jax.block_until_ready(out)
            times[name].append((now() - t0) / calls * 1e3)
    return times


def paired(times: dict, num: str, den: str) -> dict:
    """The ratio ``num / den`` round by round (both ran in the same round): a summary."""
    return summary([a / b for a, b in zip(times[num], times[den])])


def loadavg():
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def rss_mb() -> dict:
    """Process memory: current RSS (/proc/self/statm) and peak RSS (getrusage ru_maxrss)."""
    cur = None
    try:
        with open("/proc/self/statm") as f:
            cur = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"rss_mb": cur, "peak_rss_mb": peak}


def device_memory() -> dict | None:
    try:
        st = jax.devices()[0].memory_stats()
    except Exception:  # pragma: no cover
        st = None
    if not st:
        return None
    keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(st[k]) for k in keep if k in st}


def error_text(e: BaseException) -> str:
    tb = [l for l in traceback.format_exception(type(e), e, e.__traceback__)
          if l.startswith("  File")]
    own = [l for l in tb if "site-packages" not in l]
    frames = own[-3:] + ([tb[-1]] if tb and tb[-1] not in own[-3:] else [])
    return f"{type(e).__name__}: {str(e)[:300]}\n" + "".join(frames)


def run_worker(argv: list, *, timeout: float | None = 600, env: dict | None = None) -> str:
    """``python <argv>`` in a fresh process, from the repository root and with it importable
    (``env`` over this process's environment): the last line it prints; a ``RuntimeError``
    with the end of its stderr where it fails. The benchmarks' fresh-process measurements
    (first calls, first programs, workers that must not share a process) all run so."""
    import subprocess
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
    path = os.pathsep.join([root] + ([os.environ["PYTHONPATH"]]
                                     if os.environ.get("PYTHONPATH") else []))
    p = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                       timeout=timeout, cwd=root,
                       env={**os.environ, "PYTHONPATH": path, **(env or {})})
    if p.returncode:
        shown = argv[2:] if argv[0] == "-c" else argv      # (not a -c script's text)
        raise RuntimeError(f"worker {' '.join(map(str, shown))[:200]}: {p.stderr[-3000:]}")
    return p.stdout.strip().splitlines()[-1]


def code_info() -> dict:
    """Which hlofold was measured: git commit, whether hlofold/ differs from it, and a hash
    of the imported hlofold sources (the repository may change between runs)."""
    import hashlib
    import subprocess
    pkg = os.path.dirname(hlofold.__file__)
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(pkg)):
        for fn in sorted(files):
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, fn), pkg)
                with open(os.path.join(dirpath, fn), "rb") as f:
                    h.update(rel.encode() + b"\0" + f.read())
    info = {"hlofold_path": pkg, "hlofold_sources_sha256": h.hexdigest()[:16]}
    try:
        root = os.path.dirname(pkg)
        git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True,  # noqa: E731
                                        text=True, timeout=10).stdout.strip()
        info["git_commit"] = git("rev-parse", "--short", "HEAD") or None
        info["hlofold_dirty"] = bool(git("status", "--porcelain", "--", "hlofold"))
        info["benchmarks_dirty"] = bool(git("status", "--porcelain", "--", "benchmarks"))
    except Exception:  # pragma: no cover
        pass
    return info


def version(mod: str):
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:
        return None


def machine_info() -> dict:
    cpu = None
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if cpu is None and line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                if not flags and line.startswith("flags"):
                    flags = line.split(":", 1)[1]
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f} " in f" {flags} "]
    dev = jax.devices()[0]
    return {
        "cpu_model": cpu or platform.processor() or platform.machine(),
        "cpu_isa": isa,
        "os_cpu_count": os.cpu_count(),
        "sched_affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "flax": version("flax"),
        "numpy": np.__version__,
        "hlofold": hlofold.__version__,
        "backend": jax.default_backend(),
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "devices": [str(d) for d in jax.devices()],
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(m: dict) -> str:
    return (f"{m['cpu_model']}, {m['sched_affinity_cpus']} usable cores; device "
            f"{m['backend']}:{m['device_kind']}; jax {m['jax']}, jaxlib {m['jaxlib']}, "
            f"flax {m['flax']}, hlofold {m['hlofold']}")


def ratio(num: dict, den: dict) -> float:
    """hlofold's median over doing nothing's median (two :func:`summary` dicts)."""
    return num["median"] / den["median"]


def kept_parts(res: dict) -> dict:
    """Part → the run (date, code) it was measured in, for the parts ``res`` kept."""
    kept = res.get("kept_from") or {}
    if "parts" in kept:                         # the older single-run form
        return {k: {"date_utc": kept["date_utc"], "code": kept["code"]} for k in kept["parts"]}
    return kept


def run_of(res: dict, part: str) -> dict:
    return kept_parts(res).get(part) or {"date_utc": res["machine"]["date_utc"],
                                    "code": res["code"].get("git_commit")}


def kept_runs(res: dict) -> dict:
    runs: dict = {}
    for part, r in kept_parts(res).items():
        runs.setdefault((r["date_utc"], r["code"]), []).append(part)
    return runs


def write_doc(out_dir: str, name: str, res: dict, lines: list[str]) -> None:
    """``res`` as ``out_dir/name.json`` and ``lines`` as ``out_dir/name.md``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    with open(os.path.join(out_dir, name + ".md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
