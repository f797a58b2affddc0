"""IREE as a second consumer of StableHLO, for :func:`hlofold.verify` (optional).

StableHLO is compiled by XLA (through JAX) and by IREE. Where IREE's Python packages are
installed (``pip install hlofold[iree]``: ``iree-base-compiler``, ``iree-base-runtime``),
``verify`` also runs the original and the folded program with IREE on each of its devices
present — ``iree:llvm-cpu`` (the ``local-task`` driver) always, ``iree:cuda`` where a CUDA
device answers — and compares them with the same tolerance model, in rows beside XLA's
backends. A program is handed to IREE as the StableHLO JAX lowers it to for the CPU.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Callable, Sequence

import numpy as np

from hlofold import _compat as C

# IREE runtime name -> (compiler target backend, runtime driver, compiler flags)
TARGETS = {"iree:llvm-cpu": ("llvm-cpu", "local-task", ("--iree-llvmcpu-target-cpu=host",)),
            "iree:cuda": ("cuda", "cuda", ())}
_FLAGS = ("--iree-input-demote-f64-to-f32=false",)     # a float64 module stays float64


@functools.lru_cache(maxsize=None)
def runtimes() -> tuple[str, ...]:
    """The IREE runtimes present (empty without IREE's packages)."""
    try:
        if importlib.util.find_spec("iree.compiler") is None:
            return ()
        import iree.runtime as rt
    except ImportError:
        return ()
    out = []
    drivers = set(rt.query_available_drivers())
    for name, (_, driver, _) in TARGETS.items():
        if driver not in drivers:
            continue
        try:
            if rt.get_driver(driver).query_available_devices():
                out.append(name)
        except Exception:  # noqa: BLE001 -- a driver without a device: not present
            continue
    return tuple(out)


class CompileError(RuntimeError):
    """IREE could not compile a module (a limitation of IREE's, reported, not raised, by
    ``hlofold.verify`` for the original module)."""


def device_name(name: str) -> str:
    return f"IREE {TARGETS[name][0]} ({TARGETS[name][1]})"


def run(name: str, program: Callable, args: Sequence) -> list[np.ndarray]:
    """``program`` (a JAX-traceable callable of ``args``) lowered to StableHLO, compiled by
    IREE for ``name`` and run there on ``args``; its outputs, flattened."""
    import jax
    import iree.compiler as ic
    import iree.runtime as rt
    target, driver, flags = TARGETS[name]
    with jax.default_device(jax.devices("cpu")[0]), C.constants_in_module():
        text = jax.jit(program, keep_unused=True).lower(*args).as_text()   # (self-contained)
    try:
        vmfb = ic.compile_str(text, target_backends=[target], input_type="stablehlo",
                              extra_args=list(flags + _FLAGS))
    except ic.CompilerToolError as e:
        first = next((line.strip() for line in str(e).splitlines() if "error:" in line), "")
        raise CompileError(first[:300] or "iree-compile failed") from None
    ctx = rt.SystemContext(config=rt.Config(driver))
    module = rt.VmModule.copy_buffer(ctx.instance, vmfb)
    ctx.add_vm_module(module)
    outs = getattr(ctx.modules, module.name)["main"](*[np.asarray(a) for a in args])
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    return [np.asarray(o.to_host() if hasattr(o, "to_host") else o) for o in outs]
