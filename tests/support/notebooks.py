"""Run an example notebook top to bottom in a fresh kernel on this Python (nbclient), for the notebook tests."""
from __future__ import annotations

import os

import kvpress_c

ROOT = os.path.dirname(os.path.dirname(kvpress_c.__file__))


def run_notebook(name: str, tmp_path, monkeypatch):
    """examples/<name> executed in tmp_path: (the notebook, its code cells' outputs, their text). A cell that
    raised fails here with its error."""
    import nbformat
    from nbclient import NotebookClient
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(os.path.join(ROOT, "examples", name), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    return nb, outputs, text
