"""The quantization core, IR-agnostic: pairs and cross-layer equalization (``equalize``),
SmoothQuant scales (``smooth``) and their search (``smooth_search``), rotation (``rotation``),
residual streams (``streams``) and a scanned stack's pairs (``layer_pairs``). Imports the
shared base only."""
