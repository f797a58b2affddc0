"""The jaxpr adapter of the rewrites: pairs of layers (``pairs`` over ``pair_rules``),
residual streams (``residual``), pairs in a scan's body (``scan_pairs``), the residual
stream rotated (``rotate``, ``rotate_terms``) and the driver over a parameter tree
(``rewrite``)."""
