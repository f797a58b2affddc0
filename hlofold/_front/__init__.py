"""The front ends users call: the decorator (``api``) with its signatures, dispatch,
prepare, compile options and views; ``lower``/``export``; ``fold_params`` (``writeback``,
``folded_params``, ``identities``); ``fold_stablehlo`` (``artifacts``); ``verify`` (with
``iree``, ``precision``); the CLI (``cli``, ``demo``, ``files``). May import anything; nothing
below imports it."""
