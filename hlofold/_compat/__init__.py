"""Every use of JAX internals (and jaxlib's MLIR bindings) in hlofold lives here.

hlofold reads and rebuilds jaxprs and StableHLO modules, which needs names JAX keeps in
``jax.extend`` or ``jax._src``, the parameters of its control-flow primitives, and jaxlib's
MLIR bindings. Keeping them in one package means a JAX upgrade touches one place, and lets
hlofold *fail closed* on a JAX it has not seen:

* :mod:`.lookup`: the tested window (:data:`TESTED`), the one check every internal goes
  through (:func:`internal`), what this JAX changed (:data:`CHANGED`), which features that
  switched off (:func:`disabled`), and :class:`CompatError`;
* :mod:`.jaxpr`: jaxpr classes, evaluation, tracing, source locations;
* :mod:`.params`: the parameters of jit, cond, scan, while and remat;
* :mod:`.mlir`: the MLIR bindings and ``jax.export`` internals;
* :mod:`.xla`: XLA compile options hlofold sets, probed on this jaxlib.

Importing hlofold never fails because an internal moved: a missing one becomes a stand-in
that raises :class:`CompatError` when used, and the front ends run the original program.
"""
from .lookup import (CHANGED, LOOKUPS, JAX_VERSION, TESTED, WINDOW, CompatError, as_compat,
                     disabled, internal, is_untested, require, untested, version_tuple,
                     warn_untested)
from .jaxpr import (MERGED, ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var, add_eqn, as_closed,
                    aval_of, bind_eqn, check_jaxpr, closed_jaxpr, cond_eqn, eval_jaxpr,
                    hoist_consts, in_manual_context, is_closed, is_open, is_tracer, jaxpr_as_fun,
                    jaxpr_of, jit_info, name_stack, new_var, partial_eval, rebase_source,
                    shape_struct, source_of, stage_cond, trace, user_location, varying_axes)
from .params import (JIT_NAMES, OPEN_SLOTS, REMAT_NAMES, call_body, call_constraints, cond_branches,
                     constraint_eqn, forward_remat, inlinable_call, remat_without_consts,
                     is_closed_param, param_jaxprs, remat_body, scan_body, scan_layout, scan_linear,
                     scan_reverse, while_body, with_call_consts, with_cond_branches,
                     with_remat_body, with_scan_body, with_scan_operands, with_while_body)
from .mlir import (bfloat16, constants_in_module, exported_input_shardings, exported_with_inputs,
                   location_view, mlir, mlir_context, module_to_portable_artifact, ops_named)
from .xla import YNN_FUSION, option_supported, ynn_fused_convolutions, ynn_single_ops

__all__ = [
    "CHANGED", "LOOKUPS", "JAX_VERSION", "TESTED", "WINDOW", "CompatError", "as_compat",
    "disabled", "internal", "is_untested", "require", "untested", "version_tuple",
    "warn_untested",
    "MERGED", "ClosedJaxpr", "DropVar", "Jaxpr", "JaxprEqn", "Literal", "Var", "add_eqn",
    "as_closed", "aval_of", "bind_eqn", "check_jaxpr", "closed_jaxpr", "cond_eqn",
    "eval_jaxpr", "hoist_consts", "in_manual_context", "is_closed", "is_open",
    "is_tracer", "jaxpr_as_fun", "jaxpr_of", "jit_info", "name_stack", "new_var",
    "partial_eval", "rebase_source", "shape_struct", "source_of", "stage_cond", "trace",
    "user_location", "varying_axes",
    "JIT_NAMES", "OPEN_SLOTS", "REMAT_NAMES", "call_body", "call_constraints",
    "cond_branches", "constraint_eqn", "forward_remat",
    "inlinable_call", "remat_without_consts",
    "is_closed_param", "param_jaxprs", "remat_body", "scan_body", "scan_layout",
    "scan_linear", "scan_reverse", "while_body", "with_call_consts",
    "with_cond_branches", "with_remat_body", "with_scan_body", "with_scan_operands",
    "with_while_body",
    "bfloat16", "constants_in_module", "exported_input_shardings", "exported_with_inputs",
    "location_view",
    "mlir", "mlir_context", "module_to_portable_artifact", "ops_named",
    "YNN_FUSION", "option_supported", "ynn_fused_convolutions", "ynn_single_ops",
]
