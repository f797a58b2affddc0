"""The jaxpr adapter of folding: ``fold_jaxpr`` (``fold``: the scope, one jaxpr and its
nested jaxprs), site decisions through the core (``plan``), its forward walk (``forward``),
rewritten equations (``emit``), known values (``values``), one rule per higher-order
primitive (``nested``), NumPy rules for constants (``host``), roots and chain steps
(``patterns``, ``steps``), the staged algebra (``arith``), merges (``merge``,
``merge_emit``), stacks (``stacks``), the tolerance profile (``accumulation``), checks
on an untested JAX (``check``), parameter roles (``roles``)."""
