"""The IR-agnostic core: what a fold is, decided once for both IRs.

Roots and their geometry (``patterns``), the chain walk after a root (``chain``, with the step
rules of ``chain_rules``) and the walk in front of one (``forward_walk``), the site decision
(``decide``) over the safety rules (``rules``), the s/t algebra (``algebra``), the one
tolerance model (``tolerance``), reason kinds (``reasons``), which calls a fold crosses
(``boundary``) and the report (``report``, ``unreached``). Nothing here imports an IR
adapter (``hlofold._jaxpr``, ``hlofold._stablehlo``) or a front end: the adapters answer the
core's questions through small protocols (``chain.ChainIR``, ``forward_walk.ForwardIR``).
"""
