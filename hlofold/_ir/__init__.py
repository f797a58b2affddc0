"""Each IR as hlofold reads, builds and evaluates it, with no knowledge of folding or
rewriting: ``jaxpr`` and ``stablehlo`` (the MLIR vocabulary, modules, op builders, artifact
I/O, weights bound as values). The two never import each other; each imports the shared
base and ``hlofold._compat`` only."""
