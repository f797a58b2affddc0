"""``hlofold.verify``: run the original and the folded program on every backend present and
compare them, with a tolerance model per dtype that accounts for accumulation length.

Tolerance model. A folded program computes the same sums in another order and rounds the
kernel once more, so its error against the original grows like rounding noise over the
longest accumulation ``L`` (the largest ``C_in/G · kernel window`` of a convolution, or
contraction size of a dot):

    |folded − original| ≤ eps(dtype) · (8 + 2·√L) · max|original|  (+ eps · 1e-3 absolute)

Across backends (a GPU against the CPU original) float32 may run as TF32 on tensor cores,
so the cross-backend check uses eps = 2⁻¹⁰ for float32 on GPUs and the same formula.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat as C

_PLATFORMS = ("cpu", "gpu", "tpu")


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

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def to_dict(self):
        return {"passed": self.passed, "accumulation": self.accumulation,
                "backends": self.backends, "devices": self.devices,
                "rows": [r.to_dict() for r in self.rows]}

    def __str__(self):
        head = (f"hlofold verify: {'PASS' if self.passed else 'FAIL'} on "
                f"{', '.join(f'{b} ({self.devices.get(b, b)})' for b in self.backends)}; "
                f"accumulation length {self.accumulation}")
        lines = [head, f"  {'backend':8s} {'against':14s} out  dtype     max|Δ|     max rel  "
                       f"eps units  tolerance  result"]
        for r in self.rows:
            lines.append(f"  {r.backend:8s} {r.against:14s} {r.output:<4d} {r.dtype:9s} "
                         f"{r.max_abs:9.3e}  {r.max_rel:9.3e}  {r.eps_units:9.1f}  "
                         f"{r.tolerance:9.3e}  {'ok' if r.passed else 'FAIL'}"
                         + ("" if r.finite == 1.0 else
                            f"  (only {r.finite:.0%} of the values are finite)"))
        return "\n".join(lines)


def _eps(dtype, backend: str, cross: bool) -> float:
    dt = np.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        return 0.0
    if cross and backend == "gpu" and dt == np.float32:
        return 2.0 ** -10
    return float(jnp.finfo(dt).eps)


def tolerance(dtype, scale: float, accumulation: int, backend: str = "cpu",
              cross: bool = False) -> float:
    """The absolute tolerance of the model above for outputs of magnitude ``scale``."""
    eps = _eps(dtype, backend, cross)
    return eps * (8 + 2 * math.sqrt(max(accumulation, 1))) * scale + eps * 1e-3


def _available(backends):
    out = []
    for b in backends or _PLATFORMS:
        try:
            if jax.devices(b):
                out.append(b)
        except RuntimeError:
            continue
    return out


def _as_callable(prog, platform: str):
    from ._artifacts import module_callable
    if callable(prog) and not isinstance(prog, (str, bytes, bytearray)):
        return prog
    return module_callable(prog, platform)


def accumulation_length(prog, args) -> int:
    """The longest accumulation of a conv/dot in ``prog`` (a callable or an artifact)."""
    best = 1
    if callable(prog) and not isinstance(prog, (str, bytes, bytearray)):
        closed = jax.make_jaxpr(prog)(*args)
        from ._jaxpr_nested import subjaxprs
        stack = [closed.jaxpr]
        while stack:
            for e in stack.pop().eqns:
                best = max(best, _eqn_acc(e))
                stack.extend(subjaxprs(e))
        return best
    from ._artifacts import read_artifact
    ir = C.mlir()[0]
    art = read_artifact(prog)
    with C.mlir_context():
        module = ir.Module.parse(art.module)
        for fop in module.body.operations:
            for block in fop.regions[0].blocks if fop.operation.regions else []:
                for op in block.operations:
                    if op.operation.name == "stablehlo.convolution":
                        stablehlo = C.mlir()[1]
                        k = ir.RankedTensorType(op.operands[1].type).shape
                        dn = stablehlo.ConvDimensionNumbers(
                            op.attributes["dimension_numbers"])
                        out_feat = k[dn.kernel_output_feature_dimension]
                        best = max(best, int(np.prod(k)) // max(1, out_feat))
                    elif op.operation.name == "stablehlo.dot_general":
                        stablehlo = C.mlir()[1]
                        lhs = ir.RankedTensorType(op.operands[0].type).shape
                        dn = stablehlo.DotDimensionNumbers(
                            op.attributes["dot_dimension_numbers"])
                        best = max(best, int(np.prod([lhs[d] for d in
                                                      dn.lhs_contracting_dimensions])))
    return best


def _eqn_acc(e) -> int:
    if e.primitive.name == "conv_general_dilated":
        k = e.invars[1].aval.shape
        out_feat = k[e.params["dimension_numbers"].rhs_spec[0]]
        return int(np.prod(k)) // max(1, out_feat)
    if e.primitive.name == "dot_general":
        (lc, _), _ = e.params["dimension_numbers"]
        return int(np.prod([e.invars[0].aval.shape[d] for d in lc], dtype=np.int64))
    return 1


def verify(original, folded, *args, backends: Sequence[str] | None = None,
           accumulation: int | None = None, raise_on_failure: bool = True) -> VerifyReport:
    """Compare ``folded`` against ``original`` on every available backend.

    ``original``/``folded`` are Python callables or StableHLO artifacts (text, bytecode,
    serialized ``jax.export`` bytes, an ``Exported``, or a path). ``args`` are the inputs
    (a flat list of arrays for artifacts). Each output is compared with the original on the
    same backend, and with the original on the CPU (cross-backend). Raises
    ``VerificationError`` on failure unless ``raise_on_failure=False``.
    """
    names = _available(backends)
    if not names:
        raise ValueError(f"none of the backends {list(backends or _PLATFORMS)} is available")
    acc = accumulation or accumulation_length(original, args)
    results: dict[str, tuple[list, list]] = {}
    devices = {}
    for b in names:
        dev = jax.devices(b)[0]
        devices[b] = getattr(dev, "device_kind", str(dev))
        dargs = jax.device_put(args, dev)
        with jax.default_device(dev):
            o = jax.tree.leaves(_as_callable(original, b)(*dargs))
            f = jax.tree.leaves(_as_callable(folded, b)(*dargs))
        results[b] = ([np.asarray(x) for x in o], [np.asarray(x) for x in f])
    rows = []
    cpu_ref = results.get("cpu", (None,))[0]
    for b in names:
        orig, fold = results[b]
        if len(orig) != len(fold):
            raise VerificationError(VerifyReport([], acc, names, devices))
        pairs = [("same backend", orig)]
        if cpu_ref is not None and b != "cpu":
            pairs.append(("cpu original", cpu_ref))
        for against, refs in pairs:
            for i, (r, x) in enumerate(zip(refs, fold)):
                rows.append(_row(b, against, i, r, x, acc))
    rep = VerifyReport(rows, acc, names, devices)
    if raise_on_failure and not rep.passed:
        raise VerificationError(rep)
    return rep


def _row(backend, against, i, ref, out, acc) -> VerifyRow:
    r64, o64 = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    finite = np.isfinite(r64) & np.isfinite(o64)
    same_nonfinite = np.array_equal(np.isnan(r64), np.isnan(o64)) and \
        np.array_equal(np.where(np.isinf(r64), r64, 0), np.where(np.isinf(o64), o64, 0))
    diff = np.abs(r64 - o64)[finite] if r64.size else np.zeros(0)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(r64[finite]).max()) if finite.any() else 0.0
    cross = against != "same backend"
    tol = tolerance(ref.dtype, scale, acc, backend, cross)
    eps = _eps(ref.dtype, backend, cross) or 1.0
    return VerifyRow(backend, against, i, str(ref.dtype), max_abs,
                     max_abs / scale if scale else 0.0,
                     max_abs / (eps * scale) if scale else 0.0, tol,
                     bool(same_nonfinite and max_abs <= tol),
                     float(finite.mean()) if finite.size else 1.0)
