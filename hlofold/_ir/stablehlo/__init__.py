"""StableHLO modules as hlofold reads and builds them: the MLIR vocabulary (``ir``), large
constants by reference (``blobs``), per-op facts (``facts``), parse/check and private functions
(``module``), op builders (``build``), integer indices and trip counts (``indices``), target
platforms (``platforms``), argument shardings (``shardings``), artifacts in and out
(``artifacts``: text, bytecode, VHLO, jax.export; ``module_callable``) and weights given as
values (``weights``). Imports the shared base and ``hlofold._compat`` only."""
