from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .base import ScorerPress

QFILTERS_URL = "https://huggingface.co/collections/nthngdy/q-filters-67a4994dcb302a3d37f3d119"


@dataclass
class QFilterPress(ScorerPress):
    """Q-Filters (Godey et al., 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression"),
    as kvpress's QFilterPress: each row scores -<k, f[layer, kv_head]> with learned filters, the lowest go.

    The filters come from a local file (`filters_path`): the `model.safetensors` of the model's Q-filters
    repository (tensor "q_filters", [layers, KV heads, head dim], Hugging Face channel order), that folder,
    or a .npy of the same array. Get them from {url}; nothing is downloaded.
    """
    filters_path: Optional[str] = None
    filters: np.ndarray = field(init=False, default=None, repr=False)

    scorer = "knorm"  # placeholder in the config: the C core scores with the filters

    def __post_init__(self):
        super().__post_init__()
        self.filters = load_q_filters(self.filters_path)

    def before_prefill(self, session, n: int, config: dict) -> None:
        want = (config["n_layers"], config["n_kv_heads"], config["head_dim"])
        if self.filters.shape != want:
            raise ValueError(f"the Q-filters in {self.filters_path} have shape {self.filters.shape}; this model needs {want}")
        f = self.filters
        if config.get("rope_pairing") == "adjacent":  # GGUF K channels: HF channel i at 2i, i + d/2 at 2i + 1
            half = f.shape[-1] // 2
            f = np.stack([f[..., :half], f[..., half:]], axis=-1).reshape(f.shape)
        session.set_press_array("key_filters", f)


QFilterPress.__doc__ = QFilterPress.__doc__.format(url=QFILTERS_URL)


def load_q_filters(path) -> np.ndarray:
    if path is None:
        raise ValueError(f"QFilterPress needs the model's Q-filters from a local file: download the model.safetensors of "
                         f"your model's repository in {QFILTERS_URL} and pass filters_path='that file' (kvpress_c never "
                         "downloads)")
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Q-filters file missing: {path} (get it from {QFILTERS_URL})")
    if path.endswith(".npy"):
        f = np.load(path)
    else:
        from ._tensor_files import read_tensors
        tensors = read_tensors(path)
        if "q_filters" not in tensors:
            raise ValueError(f"{path} has no tensor 'q_filters' (it holds {sorted(tensors)})")
        f = tensors["q_filters"]
    f = np.asarray(f, dtype=np.float32)
    if f.ndim != 3 or not np.isfinite(f).all():
        raise ValueError(f"{path}: Q-filters must be a finite [layers, KV heads, head dim] array, got shape {f.shape}")
    return f
