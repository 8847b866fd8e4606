"""examples/quickstart.ipynb runs top to bottom (nbclient, a fresh kernel on this Python), and its
cells produce what they say: the answers, the NIAH table and three heatmaps."""
from notebooks import run_notebook


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    _, outputs, text = run_notebook("quickstart.ipynb", tmp_path, monkeypatch)
    assert "SmolLM2" in text and "EvalResult(" in text and "chunkkv-b64" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3
