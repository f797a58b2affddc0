"""XLA compile options hlofold sets on programs it compiles, checked against this jaxlib.

An option XLA does not know makes the compile fail ("No such compile option"), and these
are experimental flags a newer jaxlib may rename or drop. So each is used only on a JAX in
the tested window *and* after a probe compile of a one-op program with it succeeded (once
per process); otherwise hlofold compiles with the user's options alone — the program is
the same, only XLA's choice of kernels may be slower (fail closed).
"""
from __future__ import annotations

import re
import threading

import jax

from .lookup import untested

# XLA:CPU's YNNPACK library fusions, limited to single convolutions and dots: XLA:CPU
# (jaxlib 0.10) otherwise grows one fusion from a reduction or an element-wise op through a
# chain of single-use convolutions — the chain a merge of parallel branches leaves (the
# deploy form of RepVGG) — which runs several times slower than the same convolutions one
# by one (docs/benchmarks/branches_cpu.md).
YNN_FUSION = "xla_cpu_experimental_ynn_fusion_type"
YNN_SINGLE_OPS = ("LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION,"
                  "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT")

_lock = threading.Lock()
_probed: dict[tuple[str, str], bool] = {}


def option_supported(name: str, value: str) -> bool:
    """Whether this JAX is in the tested window and compiles with ``name=value``."""
    if untested():
        return False
    key = (name, value)
    with _lock:
        if key not in _probed:
            try:
                jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(
                    jax.ShapeDtypeStruct((), "float32")).compile()
                _probed[key] = True
            except Exception:       # noqa: BLE001 — any failure means: do not use it
                _probed[key] = False
        return _probed[key]


def ynn_single_ops(options: dict | None) -> dict | None:
    """``options`` with XLA:CPU's YNNPACK fusion limited to single convolutions and dots,
    unless the user chose that option or this jaxlib does not take it (then ``None``)."""
    if options and YNN_FUSION in options:
        return None
    if not option_supported(YNN_FUSION, YNN_SINGLE_OPS):
        return None
    return {**(options or {}), YNN_FUSION: YNN_SINGLE_OPS}


_YNN_CALL = re.compile(r"calls=%([\w.\-]+),[^\n]*__ynn_fusion")


def ynn_fused_convolutions(hlo_text: str) -> int:
    """The most convolutions XLA:CPU put into one YNNPACK library fusion of a compiled
    module (``Compiled.as_text()``): more than one is the chain fusion
    :func:`ynn_single_ops` avoids. 0 where the text has no such fusion (or another form)."""
    per_comp, cur = {}, None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            cur = line.split()[0].lstrip("%")
            per_comp[cur] = 0
        elif cur is not None and " convolution(" in line:
            per_comp[cur] += 1
    return max([per_comp.get(c, 0) for c in _YNN_CALL.findall(hlo_text)], default=0)
