"""The folding core, IR-agnostic: roots and their geometry (``patterns``), the chain walk
after a root (``chain``) and the walk in front of one (``forward_walk``), the site decision
(``decide``) over the safety rules (``rules``), the rescale (``rescale``), the cost rule
(``cost``), merged branches (``merge``), scanned stacks (``stacks``), calls a fold crosses
(``boundary``) and normalizations no root reaches (``unreached``). Imports the shared base
only: the adapters answer its questions through small protocols (``chain.ChainIR``,
``forward_walk.ForwardIR``)."""
