"""Folding: per-channel affine arithmetic absorbed into the convolution or dense layer
before it (BatchNorm, norm scales, merged branches, scanned stacks). ``core`` decides, IR-agnostic;
``jaxpr`` and ``stablehlo`` are its two adapters."""
