"""The notebooks run headless (nbclient) and finish without errors."""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "experiments" / "notebooks"


EXPECTED = {"knapspec.ipynb": ("predicted TPT", "t_attn(n)"),
            "dustin.ipynb": ("ARR at k = 128/", "positions:", "dense  verification")}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs(name, monkeypatch):
    # the kernel starts in the notebooks folder: put this checkout first, so it runs this code
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    # the notebooks' smaller settings for a headless run (knapspec.ipynb: the DP on two prefixes, not three)
    monkeypatch.setenv("JAXSPEC_NOTEBOOK_SMALL", "1")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    missing = [needle for needle in EXPECTED[name] if needle not in text]
    assert not missing, f"{name}: expected output {missing} not printed"
