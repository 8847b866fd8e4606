from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .base import ScorerPress, check_choice

KVZAP_URL = "https://huggingface.co/nvidia (repositories KVzap-<linear|mlp>-<model>)"


@dataclass
class KVzapPress(ScorerPress):
    """KVzap (Jegou et al., 2026, "KVzap", a fast approximation of KVzip), as kvpress's KVzapPress: a per-layer
    linear model or 2-layer MLP (GELU) reads each prompt token's normed hidden state (the attention block's
    input) and predicts one score per KV head; the lowest go. Scores a prefill into an empty session.

    The model comes from a local folder (`model_path`) holding the files of the matching {url} repository:
    config.json (input_dim, output_dim, n_modules, hidden_dim) and model.safetensors. Nothing is downloaded.
    `model_type` ("linear" or "mlp") must match the files.
    """
    model_type: str = "mlp"
    model_path: Optional[str] = None
    weights: tuple = field(init=False, default=None, repr=False)

    scorer = "knorm"  # placeholder in the config: the C core scores with the KVzap model

    def __post_init__(self):
        super().__post_init__()
        check_choice("model_type", self.model_type, ("linear", "mlp"))
        self.weights = load_kvzap(self.model_path, self.model_type)

    def before_prefill(self, session, n: int, config: dict) -> None:
        hid, w1, b1, w2, b2, cfg = self.weights
        want = (config["hidden"], config["n_kv_heads"], config["n_layers"])
        have = (cfg["input_dim"], cfg["output_dim"], cfg["n_modules"])
        if have != want:
            raise ValueError(f"the KVzap model in {self.model_path} maps hidden {have[0]} -> {have[1]} heads over {have[2]} "
                             f"layers; this model has hidden {want[0]}, {want[1]} KV heads, {want[2]} layers")
        session.set_kvzap(hid, w1, b1, w2, b2)


KVzapPress.__doc__ = KVzapPress.__doc__.format(url=KVZAP_URL)


def load_kvzap(path, model_type: str):
    """(hidden_dim (0: linear), W1 [L, o1, D], b1 [L, o1], W2 [L, Hkv, hid] or None, b2 or None, config)."""
    if path is None:
        raise ValueError(f"KVzapPress needs the KVzap model of your model from a local folder: download config.json and "
                         f"model.safetensors from {KVZAP_URL} and pass model_path='that/folder' (kvpress_c never downloads)")
    files = {n: os.path.join(os.fspath(path), n) for n in ("config.json", "model.safetensors")}
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"KVzap model files missing: {', '.join(missing)} (get them from {KVZAP_URL})")
    with open(files["config.json"]) as f:
        cfg = json.load(f)
    for key in ("input_dim", "output_dim", "n_modules"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ValueError(f"{files['config.json']}: {key} must be a positive integer, got {cfg.get(key)!r}")
    hid = cfg.get("hidden_dim") or 0
    if (hid > 0) != (model_type == "mlp"):
        raise ValueError(f"{path} holds a {'2-layer MLP' if hid else 'linear'} KVzap model, not model_type={model_type!r}")
    from ._tensor_files import read_tensors
    t = read_tensors(files["model.safetensors"])
    L = cfg["n_modules"]
    names = (["layers.{}.0.weight", "layers.{}.0.bias", "layers.{}.2.weight", "layers.{}.2.bias"] if hid
             else ["layers.{}.weight", "layers.{}.bias"])
    try:
        stacked = [np.stack([np.asarray(t[n.format(i)], np.float32) for i in range(L)]) for n in names]
    except KeyError as e:
        raise ValueError(f"{files['model.safetensors']} lacks tensor {e} of a {model_type} KVzap model") from None
    if hid:
        return hid, *stacked, cfg
    return 0, stacked[0], stacked[1], None, None, cfg
