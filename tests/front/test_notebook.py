"""The walkthrough notebook executes top to bottom without a cell error (small sizes)."""
import os
import sys

import pytest

from tests.helpers import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("flax")

NOTEBOOK = ROOT / "notebooks" / "walkthrough.ipynb"


def test_walkthrough_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, \
                "commit notebooks/walkthrough.ipynb without outputs"
    assert any("Exporting and folding StableHLO artifacts" in c.source for c in nb.cells)
    assert any("hlofold.export" in c.source for c in nb.cells if c.cell_type == "code")
    assert any('"fold", src' in c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
def test_walkthrough_executes(monkeypatch):
    # The "python3" kernel must be this interpreter (the venv's): jupyter_client replaces a
    # kernelspec's "python" with sys.executable, and the venv's bin goes first on PATH too.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()   # raises CellExecutionError on the first cell that fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) >= 2, "the error histogram and the latency chart"
