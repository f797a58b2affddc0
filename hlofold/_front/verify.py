"""``hlofold.verify``: run the original and the folded program on every backend present and
compare them under hlofold's tolerance model (:mod:`hlofold._base.tolerance`: by dtype, longest
accumulation and depth; TF32 eps for float32 on GPUs across backends).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from . import iree
from hlofold._base import tolerance as T
from hlofold._fold.jaxpr.accumulation import output_profiles

_PLATFORMS: tuple[str, ...] = ("cpu", "gpu", "tpu")


class VerificationError(AssertionError):
    """The folded program differs from the original beyond the tolerance."""

    def __init__(self, report: "VerifyReport"):
        super().__init__(f"hlofold.verify failed:\n{report}")
        self.report = report


@dataclasses.dataclass
class VerifyRow:
    backend: str
    against: str               # "same backend" or "cpu original"
    output: int
    dtype: str
    max_abs: float
    max_rel: float
    eps_units: float           # max_abs / (eps · max|ref|)
    tolerance: float
    passed: bool
    finite: float = 1.0        # fraction of finite reference values compared

    def to_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VerifyReport:
    rows: list[VerifyRow]
    accumulation: int
    backends: list[str]
    devices: dict[str, str] = dataclasses.field(default_factory=dict)
    depth: int = 0
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)   # backend -> why
    errors: dict[str, str] = dataclasses.field(default_factory=dict)    # backend -> failure

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows) and not self.errors

    def to_dict(self):
        return {"passed": self.passed, "accumulation": self.accumulation, "depth": self.depth,
                "backends": self.backends, "devices": self.devices, "skipped": self.skipped, "errors": self.errors,
                "rows": [r.to_dict() for r in self.rows]}

    def __str__(self):
        head = (f"hlofold verify: {'PASS' if self.passed else 'FAIL'} on "
                f"{', '.join(f'{b} ({self.devices.get(b, b)})' for b in self.backends)}; "
                f"accumulation length {self.accumulation}, depth {self.depth}")
        lines = [head, f"  {'backend':13s} {'against':14s} out  dtype     max|Δ|     max rel  "
                       f"eps units  tolerance  result"]
        for r in self.rows:
            lines.append(f"  {r.backend:13s} {r.against:14s} {r.output:<4d} {r.dtype:9s} "
                         f"{r.max_abs:9.3e}  {r.max_rel:9.3e}  {r.eps_units:9.1f}  "
                         f"{r.tolerance:9.3e}  {'ok' if r.passed else 'FAIL'}"
                         + ("" if r.finite == 1.0 else
                            f"  (only {r.finite:.0%} of the values are finite)"))
        lines += [f"  {b}: not compared ({why})" for b, why in self.skipped.items()]
        lines += [f"  {b}: FAIL ({why})" for b, why in self.errors.items()]
        return "\n".join(lines)


def known_backends() -> tuple[str, ...]:
    """The backend names ``verify`` takes: XLA's platforms and IREE's runtimes."""
    return _PLATFORMS + ("cuda", "rocm") + tuple(iree.TARGETS)


def available_backends(backends):
    """The backends asked for (default: XLA's platforms and IREE's runtimes) present here."""
    out = []
    for b in backends or _PLATFORMS + iree.runtimes():
        if b.startswith("iree:"):
            if b in iree.runtimes():
                out.append(b)
            continue
        try:
            if jax.devices(b):
                out.append(b)
        except RuntimeError:
            continue
    return out


def _run(prog, backend: str, args) -> list[np.ndarray]:
    """``prog``'s outputs on ``backend`` (an XLA platform, or an IREE runtime)."""
    if backend.startswith("iree:"):
        return iree.run(backend, _as_callable(prog, "cpu"), args)
    dev = jax.devices(backend)[0]
    dargs = jax.device_put(args, dev)
    with jax.default_device(dev):
        return [np.asarray(x) for x in jax.tree.leaves(_as_callable(prog, backend)(*dargs))]


def _as_callable(prog, platform: str):
    from hlofold._ir.stablehlo.artifacts import module_callable
    if callable(prog) and not isinstance(prog, (str, bytes, bytearray)):
        return prog
    return module_callable(prog, platform)


def accumulation_length(prog, args) -> list[tuple[int, int, Any]]:
    """``(L, D, compute)`` of each output of ``prog`` (a callable or an artifact): the longest
    accumulation of a conv/dot that output is computed from, the most of them on one path,
    and the narrowest float type they compute in (see :mod:`hlofold._base.tolerance`)."""
    if callable(prog) and not isinstance(prog, (str, bytes, bytearray)):
        return output_profiles(jax.make_jaxpr(prog)(*args).jaxpr)
    from hlofold._fold.stablehlo.checked import artifact_profiles
    return artifact_profiles(prog)


def _per_output(accumulation, n: int) -> list[tuple[int, int, Any]]:
    """``verify``'s ``accumulation`` (``L``, ``(L, D)``, ``(L, D, compute)`` for every output,
    or a list of those, one per output) as one ``(L, D, compute)`` per output."""
    if isinstance(accumulation, list):
        return [(tuple(a) + (0, None))[:3] for a in accumulation] + [(1, 0, None)] * (
            n - len(accumulation))
    one = (tuple(accumulation) + (0, None))[:3] if isinstance(accumulation, tuple) else \
        (accumulation, 0, None)
    return [one] * n


def verify(original, folded, *args, backends: Sequence[str] | None = None,
           accumulation: int | tuple | None = None,
           raise_on_failure: bool = True) -> VerifyReport:
    """Compare ``folded`` against ``original`` on every available backend.

    ``original``/``folded`` are Python callables or StableHLO artifacts (text, bytecode,
    serialized ``jax.export`` bytes, an ``Exported``, or a path). ``args`` are the inputs
    (a flat list of arrays for artifacts). ``backends``: XLA platforms (``"cpu"``,
    ``"gpu"``, ``"tpu"``) and IREE runtimes (``"iree:llvm-cpu"``, ``"iree:cuda"``; present
    where IREE is installed, see :mod:`hlofold._front.iree`); default every one present. Each
    output is compared with the original on the same backend, and with the original on
    XLA's CPU (cross-backend). Raises ``VerificationError`` on failure unless
    ``raise_on_failure=False``. ``accumulation``: ``L``, ``(L, D)`` or ``(L, D, compute)``
    of the tolerance model for every output, or a list of those, one per output (default:
    read from ``original``, per output).
    """
    names = available_backends(backends)
    if not names:
        raise ValueError(f"none of the backends {list(backends or _PLATFORMS)} is available")
    if accumulation is None:
        accumulation = accumulation_length(original, args)
    results: dict[str, tuple[list, list]] = {}
    devices, skipped, errors = {}, {}, {}
    for b in names:
        devices[b] = iree.device_name(b) if b.startswith("iree:") else getattr(
            jax.devices(b)[0], "device_kind", b)
        try:
            orig = _run(original, b, args)
        except iree.CompileError as e:    # IREE cannot run the original: nothing to compare
            skipped[b] = f"IREE cannot compile the original module: {e}"
            continue
        try:
            results[b] = (orig, _run(folded, b, args))
        except iree.CompileError as e:    # the original compiles there, the fold does not
            errors[b] = f"IREE cannot compile the folded module: {e}"
    names = [b for b in names if b not in skipped and b not in errors]
    rows = []
    cpu_ref = results.get("cpu", (None,))[0]
    first = next(iter(results.values()), ([], []))[0]
    profiles = _per_output(accumulation, len(first))
    acc = max((p[0] for p in profiles), default=1)
    depth = max((p[1] for p in profiles), default=0)
    for b in names:
        orig, fold = results[b]
        if len(orig) != len(fold):
            raise VerificationError(VerifyReport([], acc, names, devices, depth))
        pairs = [("same backend", orig)]
        if cpu_ref is not None and b != "cpu":
            pairs.append(("cpu original", cpu_ref))
        for against, refs in pairs:
            for i, (r, x) in enumerate(zip(refs, fold)):
                rows.append(_row(b, against, i, r, x, *profiles[i]))
    rep = VerifyReport(rows, acc, names, devices, depth, skipped, errors)
    if raise_on_failure and not rep.passed:
        raise VerificationError(rep)
    return rep


def _row(backend, against, i, ref, out, acc, depth, compute=None) -> VerifyRow:
    c = T.compare(ref, out, acc, depth, backend, cross=against != "same backend",
                  compute=compute)
    return VerifyRow(backend, against, i, str(np.asarray(ref).dtype), c.max_abs, c.max_rel,
                     c.eps_units, c.bound, c.passed, c.finite)
