"""The README's Python blocks run as written, in order, in one namespace."""
from __future__ import annotations

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), ns)
    # what the blocks claim
    np.testing.assert_allclose(ns["y"], ns["examples"].resnet_apply(ns["params"], ns["x"]),
                               rtol=1e-4, atol=1e-4)
    assert ns["infer"].report(ns["params"], ns["x"]).num_folded > 0
    assert len(ns["written"].changes) > 0
    np.testing.assert_allclose(ns["y_same"], ns["y"], rtol=1e-4, atol=1e-4)
    assert ns["report"].num_folded > 0 and "stablehlo.convolution" in ns["text"]
