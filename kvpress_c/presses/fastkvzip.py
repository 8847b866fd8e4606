from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .base import BasePress, check_int, check_number

GATES_URL = "https://huggingface.co/Jang-Hyun/Fast-KVzip/tree/main"
# a layer's gate tensors, as in the Fast-KVzip repository's state dicts (the layer index is the prefix in
# .safetensors / .npz files: "0.q_proj.weight", ...)
GATE_TENSORS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight", "k_base", "b")


@dataclass
class FastKVzipPress(BasePress):
    """Fast KVzip (Kim, Han & Yun, arXiv 2601.17668, "Fast KVzip"), as kvpress's FastKVzipPress: per layer, a small
    gate trained on KVzip's scores reads each prompt token's normed hidden state (the attention block's input)
    and scores it for every KV head, without KVzip's reconstruction forward; the first `n_sink` rows and a
    recent window (max(1, int(n window_ratio)) rows below 32,000 tokens, else `window_size`) score 1, the top.
    The `compression_ratio` lowest scores over all layers and heads are evicted (`layerwise=True`: that share of
    every layer). Scores a prefill of the prompt on an empty session. kvpress masks; here rows are evicted.

    The gates come from a local file (`gates_path`): the Fast-KVzip repository's `.pt` for the model
    ({url}/<model>/q<groups>_dim16_sink16.pt; read with torch, which must be installed), or a `.safetensors` /
    `.npz` with the same tensors prefixed by the layer index ("0.q_proj.weight", ... "0.k_base", "0.b"; see
    `convert_gates`). The gate's sink count is in the file name (`..._sink<N>`) and must match its k_base.
    Nothing is downloaded.
    """
    compression_ratio: float = 0.0
    layerwise: bool = False
    n_sink: int = 4
    window_size: int = 4096
    window_ratio: float = 0.02
    gates_path: Optional[str] = None
    gates: dict = field(init=False, default=None, repr=False)

    def __post_init__(self):
        check_number("compression_ratio", self.compression_ratio)
        if not 0 <= self.compression_ratio < 1:
            raise ValueError(f"compression_ratio must be in [0, 1), got {self.compression_ratio!r}")
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"layerwise must be True or False, got {self.layerwise!r}")
        check_int("n_sink", self.n_sink, minimum=0)
        check_int("window_size", self.window_size, minimum=1)
        check_number("window_ratio", self.window_ratio)
        if not 0 <= self.window_ratio <= 1:
            raise ValueError(f"window_ratio must be in [0, 1], got {self.window_ratio!r}")
        self.gates = load_gates(self.gates_path)

    @property
    def budget(self):
        return None

    @property
    def is_noop(self) -> bool:
        return self.compression_ratio == 0

    def c_config(self) -> dict:
        return {"scorer": "knorm", "allocation": "uniform",  # the scorer: the gates (set below)
                "compression_ratio": float(self.compression_ratio), "budget": 0, "window": 0, "kernel": 1}

    def before_prefill(self, session, n: int, config: dict) -> None:
        g = self.gates
        want = (config["n_layers"], config["n_kv_heads"], config["hidden"])
        have = (g["n_layers"], g["n_heads"], g["input_dim"])
        if have != want:
            raise ValueError(f"the Fast KVzip gates in {self.gates_path} are for {have[0]} layers, {have[1]} KV heads and "
                             f"hidden size {have[2]}; this model has {want[0]}, {want[1]} and {want[2]}: use its gates")
        session.set_fastkvzip(*(g[name] for name in GATE_TENSORS), n_groups=g["n_groups"], out_dim=g["out_dim"],
                              n_base=g["n_base"], n_sink=self.n_sink, window_size=self.window_size,
                              window_ratio=float(self.window_ratio), layerwise=self.layerwise)


FastKVzipPress.__doc__ = FastKVzipPress.__doc__.format(url=GATES_URL)


def _torch_gates(path: str) -> list[dict]:
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path} is a PyTorch file and torch is not installed: convert it once where torch is, with "
                         "kvpress_c.presses.fastkvzip.convert_gates('that.pt', 'that.npz') (keep the '_sink<N>' in the "
                         "name), and pass the .npz") from None
    core = getattr(np, "_core", None) or np.core  # the repository's files pickle NumPy pieces: allowed, nothing else
    with torch.serialization.safe_globals([(core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
                                           np.ndarray, np.dtype, np.dtypes.Float64DType, np.dtypes.Float32DType]):
        obj = torch.load(path, map_location="cpu", weights_only=True)
    layers = obj["module"] if isinstance(obj, dict) and "module" in obj else obj
    if not isinstance(layers, (list, tuple)):
        raise ValueError(f"{path}: expected the Fast-KVzip layout (a list of per-layer state dicts under 'module')")
    return [{k: np.asarray(v.detach().float().numpy() if hasattr(v, "detach") else v, np.float32)
             for k, v in layer.items()} for layer in layers]


def _flat_gates(path: str) -> list[dict]:
    from ._tensor_files import read_tensors
    t = read_tensors(path)
    layers = {}
    for name, a in t.items():
        idx, _, rest = name.partition(".")
        if not idx.isdigit() or rest not in GATE_TENSORS:
            raise ValueError(f"{path}: unexpected tensor {name!r}; a gate file holds '<layer>.<name>' for the names "
                             f"{', '.join(GATE_TENSORS)}")
        layers.setdefault(int(idx), {})[rest] = a
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"{path}: the layers must be numbered 0 .. n - 1, got {sorted(layers)}")
    return [layers[i] for i in range(len(layers))]


def load_gates(path) -> dict:
    """The gates of every layer stacked: {name: [L, ...] float32} for GATE_TENSORS, plus n_layers, n_heads, n_groups,
    out_dim, n_base, input_dim."""
    if path is None:
        raise ValueError(f"FastKVzipPress needs the model's gates from a local file: download <model>/q<groups>_dim16_sink16.pt "
                         f"from {GATES_URL} and pass gates_path='that.pt' (kvpress_c never downloads)")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Fast KVzip gates file missing: {path} (get it from {GATES_URL})")
    layers = _torch_gates(path) if path.endswith((".pt", ".pth")) else _flat_gates(path)
    if not layers:
        raise ValueError(f"{path} holds no gate")
    for i, layer in enumerate(layers):
        missing = [n for n in GATE_TENSORS if n not in layer]
        if missing:
            raise ValueError(f"{path}: layer {i} lacks {', '.join(missing)}")
    first = layers[0]
    od = first["q_norm.weight"].shape[-1]
    qrows, D = first["q_proj.weight"].shape
    krows = first["k_proj.weight"].shape[0]
    heads, groups, n_base = krows // od, qrows // max(krows, 1), first["k_base"].shape[2] if first["k_base"].ndim == 4 else -1
    shapes = {"q_proj.weight": (heads * groups * od, D), "q_proj.bias": (heads * groups * od,), "k_proj.weight": (heads * od, D),
              "q_norm.weight": (od,), "k_norm.weight": (od,), "k_base": (heads, 1, n_base, od), "b": (heads, 1, groups)}
    if heads < 1 or groups < 1 or krows != heads * od or qrows != heads * groups * od:
        raise ValueError(f"{path}: q_proj {first['q_proj.weight'].shape} and k_proj {first['k_proj.weight'].shape} do not "
                         f"split into heads of {od} (q_norm's size)")
    for i, layer in enumerate(layers):
        for name, shape in shapes.items():
            if layer[name].shape != shape:
                raise ValueError(f"{path}: layer {i} {name} has shape {layer[name].shape}, expected {shape}")
            if not np.isfinite(layer[name]).all():
                raise ValueError(f"{path}: layer {i} {name} is not finite")
    m = re.search(r"sink(\d+)", os.path.basename(path))
    if m and int(m.group(1)) != n_base:
        raise ValueError(f"{path}: the file name says sink{m.group(1)} but k_base holds {n_base} rows per head")
    out = {name: np.ascontiguousarray(np.stack([layer[name] for layer in layers]), dtype=np.float32) for name in GATE_TENSORS}
    out.update(n_layers=len(layers), n_heads=heads, n_groups=groups, out_dim=od, n_base=n_base, input_dim=D)
    return out


def convert_gates(src: str, dst: str) -> str:
    """Convert the Fast-KVzip repository's .pt gates (needs torch) to a .npz (or .safetensors) that loads
    without torch: tensors '<layer>.<name>'. Keep the '_sink<N>' of the name."""
    layers = _torch_gates(os.fspath(src))
    flat = {f"{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.items() if k in GATE_TENSORS}
    if dst.endswith(".safetensors"):
        from ._tensor_files import write_safetensors
        write_safetensors(dst, flat)
    else:
        np.savez(dst, **flat)
    return dst
