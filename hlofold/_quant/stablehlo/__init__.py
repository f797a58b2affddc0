"""The StableHLO adapter of the rewrites: pairs of layers (``pairs`` over ``pair_rules``),
residual streams (``residual``), equalize/smooth of a module's constants (``equalize``),
in a scanned stack's loop (``loop_pairs``)."""
