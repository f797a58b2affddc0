"""The README and the docs: their Python blocks run as written (each page in order, in one
namespace of its own), their links resolve, and the README stays a five-minute read."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tests.helpers import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def run_blocks(path, tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for code in python_blocks(path):
        exec(compile(code, str(path), "exec"), ns)
    return ns


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    assert len(python_blocks(README)) >= 3
    ns = run_blocks(README, tmp_path, monkeypatch)
    # what the blocks claim
    np.testing.assert_allclose(ns["y"], ns["examples"].resnet_apply(ns["params"], ns["x"]),
                               rtol=1e-4, atol=1e-4)
    assert ns["infer"].report(ns["params"], ns["x"]).num_folded > 0
    assert len(ns["written"].changes) > 0
    np.testing.assert_allclose(ns["y_same"], ns["y"], rtol=1e-4, atol=1e-4)
    assert ns["report"].num_folded > 0 and "stablehlo.convolution" in ns["text"]


@pytest.mark.parametrize("page", [p for p in DOCS if python_blocks(p)], ids=lambda p: p.name)
def test_docs_python_blocks_run_as_written(page, tmp_path, monkeypatch):
    run_blocks(page, tmp_path, monkeypatch)


def test_readme_is_a_short_read_with_two_setup_commands_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert first and README.read_text().index(first.group(0)) < 2000   # on the first screen
    commands = [c for c in first.group(1).splitlines() if c.strip()]
    assert len(commands) == 2
    assert "hlofold demo" in commands[0] and "pytest" in commands[1]


def test_every_docs_page_is_linked_from_the_readme_and_every_link_resolves():
    readme = README.read_text()
    for page in DOCS:
        assert f"(docs/{page.name})" in readme, f"README does not link docs/{page.name}"
    for page in [README] + DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}: missing"
