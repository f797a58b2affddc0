"""Quantization-ready rewrites: equalize, smooth (with its α search) and rotate move
per-channel scales (or an orthogonal matrix) across ops that commute with them, exactly in
float. ``core`` holds the math, IR-agnostic; ``jaxpr`` and ``stablehlo`` its adapters."""
