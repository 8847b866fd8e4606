"""examples/new_press.ipynb runs top to bottom (nbclient, a fresh kernel on this Python): a press written in
Python in about twenty lines, compared with SnapKV on a needle grid (table and heatmaps), and the positions
each press kept."""
from notebooks import run_notebook


def test_new_press_notebook_runs(tmp_path, monkeypatch):
    nb, outputs, text = run_notebook("new_press.ipynb", tmp_path, monkeypatch)
    assert "PeakAttention" in text and "Ada-PeakAttention" in text and "kept at the needle's first token" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 5  # four heatmaps, the kept positions
    # the press is about twenty lines
    source = next(c.source for c in nb.cells if "class PeakAttentionPress" in c.source)
    assert len(source.split("presses = {")[0].strip().splitlines()) <= 20
