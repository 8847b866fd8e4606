"""examples/quickstart.ipynb runs top to bottom (nbclient, a fresh kernel on this Python), and its
cells produce what they say: the answers, the NIAH table and three heatmaps."""
import os

import nbformat
from nbclient import NotebookClient

import kvpress_c

ROOT = os.path.dirname(os.path.dirname(kvpress_c.__file__))


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    nb = nbformat.read(os.path.join(ROOT, "examples", "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "SmolLM2" in text and "EvalResult(" in text and "chunkkv-b64" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3
