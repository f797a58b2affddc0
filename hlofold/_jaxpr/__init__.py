"""The jaxpr adapter: ``fold_jaxpr`` and what it needs to read and rewrite a jaxpr.

``fold`` (the scope: one jaxpr, its nested jaxprs), ``plan`` (site decisions through the
core), ``forward`` (its forward-walk adapter), ``emit`` (the rewritten equations, guards),
``templates`` (sites traced once and cloned), ``values`` (a scope's known values),
``nested`` (one rule per higher-order primitive), ``host`` (NumPy rules for transform-time
constants), ``patterns``/``steps`` (roots and chain steps read from equations), ``arith``
(the s/t algebra staged with ``lax``). Imports the core and ``hlofold._compat`` only.
"""
