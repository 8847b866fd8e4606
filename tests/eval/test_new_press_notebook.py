"""examples/new_press.ipynb runs top to bottom (nbclient, a fresh kernel on this Python): a press written in
Python in about twenty lines, compared with SnapKV on a needle grid (table and heatmaps), and the positions
each press kept."""
import os

import nbformat
from nbclient import NotebookClient

import kvpress_c

ROOT = os.path.dirname(os.path.dirname(kvpress_c.__file__))


def test_new_press_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    nb = nbformat.read(os.path.join(ROOT, "examples", "new_press.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "PeakAttention" in text and "Ada-PeakAttention" in text and "kept at the needle's first token" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 5  # four heatmaps, the kept positions
    # the press is about twenty lines
    source = next(c.source for c in nb.cells if "class PeakAttentionPress" in c.source)
    assert len(source.split("presses = {")[0].strip().splitlines()) <= 20
