"""The StableHLO adapter of folding: the pass (``fold``), roots, per-channel operands and
the evaluator of constants (``patterns``), its chain and forward walks (``match``,
``forward``), a site's values (``values``), what a decided site writes (``emit``), merges
(``merge``, ``merge_write``), private calls (``calls``), loops and scanned stacks
(``loops``, ``stacks``, ``hoist``), prepare/apply modules (``split``), the tolerance profile
(``accumulation``) and checks on an untested JAX (``checked``)."""
