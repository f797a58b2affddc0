"""The shared base every layer may read: reason kinds (``reasons``), the report
(``report``), the one tolerance model (``tolerance``), the s/t algebra (``algebra``) and the
channel bookkeeping of a chain or a pair (``chain_rules``, ``channel_axes``). Imports no
other part of hlofold."""
