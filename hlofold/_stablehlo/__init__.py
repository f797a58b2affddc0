"""The StableHLO adapter: reading, folding and writing StableHLO modules and artifacts.

``ir`` (the MLIR vocabulary), ``module`` (parse, check, private functions, unused ops),
``patterns`` (roots and per-channel operands, the evaluator), ``match`` (its chain
adapter), ``forward`` (its forward-walk adapter), ``values`` (a site's values on the host or
in the graph), ``fold`` (the pass), ``weights`` (weights given as values), ``split``
(prepare and apply modules), ``artifacts`` (text, bytecode, VHLO, jax.export in and out).
Imports the core and ``hlofold._compat`` only.
"""
