"""The notebooks run headless (nbclient) and finish without errors."""

import pathlib

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "notebooks"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["knapspec.ipynb"])
def test_notebook_runs(name):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "predicted TPT" in text and "t_attn(n)" in text
