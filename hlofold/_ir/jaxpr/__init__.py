"""Jaxprs as hlofold reads and builds them: uses and producers (``uses``), sites traced
once and cloned (``templates``). Imports the shared base and ``hlofold._compat`` only."""
