from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from .base import check_int
from .expected_attention import ExpectedAttentionPress

STATS_URL = "https://huggingface.co/collections/alessiodevoto/expectedattentionstats-68b0248d519303713320e2cf"
STATS_FILES = ("config.json", "model.safetensors")


@dataclass
class ExpectedAttentionStatsPress(ExpectedAttentionPress):
    """Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating
    Attention from Future Queries Distribution") with query statistics computed once over a corpus, as
    kvpress's ExpectedAttentionStatsPress: per layer and query head, the mean and covariance of the pre-RoPE
    queries come from a file instead of the prompt's own queries; the RoPE averaged over the next
    `n_future_positions` positions rotates them, then the scores are ExpectedAttentionPress's.

    The statistics come from a local folder (`stats_folder`) in the format of kvpress's
    ExpectedAttentionStats.save_pretrained: config.json and model.safetensors holding query_mean
    [layers, heads, head dim] and query_cov [layers, heads, head dim, head dim] (Hugging Face channel order).
    Get the folder of your model from {url} (repositories
    alessiodevoto/exp_att_stats_<model>_<dataset>_<num_samples>_<sample_seq_len>_<n_sink>), or compute it with
    `collect_query_stats(model, texts, out=folder)` (this module). Nothing is downloaded; `dataset_name`,
    `num_samples` and `sample_seq_len` only name the statistics, as in kvpress.
    """
    sample_seq_len: int = 1000
    num_samples: int = 100
    dataset_name: str = "kmfoda/booksum"
    stats_folder: Optional[str] = None
    mu: np.ndarray = field(init=False, default=None, repr=False)
    cov: np.ndarray = field(init=False, default=None, repr=False)

    def check_types(self) -> None:
        super().check_types()
        check_int("sample_seq_len", self.sample_seq_len, minimum=1)
        check_int("num_samples", self.num_samples, minimum=1)

    def __post_init__(self):
        super().__post_init__()
        self.mu, self.cov = load_query_stats(self.stats_folder)

    def before_prefill(self, session, n: int, config: dict) -> None:
        mean, cov = self.engine_stats(config)
        session.set_press_array("query_mean", mean)
        session.set_press_array("query_cov", cov)

    def engine_stats(self, config: dict) -> tuple[np.ndarray, np.ndarray]:
        """(mean, cov) float32 in the engine's channel order for this model (checked against its shape)."""
        want = (config["n_layers"], config["n_heads"], config["head_dim"])
        if self.mu.shape != want:
            raise ValueError(f"the query statistics in {self.stats_folder} are for {self.mu.shape[0]} layers x "
                             f"{self.mu.shape[1]} heads x head dim {self.mu.shape[2]}; this model has {want[0]} x "
                             f"{want[1]} x {want[2]}: use the statistics of this model")
        mu, cov = self.mu, self.cov
        if config.get("rope_pairing") == "adjacent":  # GGUF q channels: HF channel i at 2i, i + d/2 at 2i + 1
            order = _gguf_order(mu.shape[-1])
            mu, cov = mu[..., order], cov[..., order, :][..., order]
        return np.ascontiguousarray(mu, np.float32), np.ascontiguousarray(cov, np.float32)


ExpectedAttentionStatsPress.__doc__ = ExpectedAttentionStatsPress.__doc__.format(url=STATS_URL)


def _gguf_order(d: int) -> np.ndarray:
    """Our (GGUF, adjacent pairs) channel c holds HF channel order[c]."""
    half = d // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


def load_query_stats(folder) -> tuple[np.ndarray, np.ndarray]:
    """(query_mean [L, H, d], query_cov [L, H, d, d]) as float32 from a folder in kvpress's format."""
    if folder is None:
        raise ValueError("ExpectedAttentionStatsPress needs query statistics from a local folder: download "
                         f"{' and '.join(STATS_FILES)} of your model's repository in {STATS_URL}, or compute them with "
                         "kvpress_c.presses.expected_attention_stats.collect_query_stats(model, texts, out='folder'), "
                         "and pass stats_folder='that/folder' (kvpress_c never downloads)")
    files = {n: os.path.join(os.fspath(folder), n) for n in STATS_FILES}
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"query statistics files missing: {', '.join(missing)} (get them from {STATS_URL}, or "
                                "write them with collect_query_stats)")
    from ._tensor_files import read_safetensors
    with open(files["config.json"]) as f:
        cfg = json.load(f)
    t = read_safetensors(files["model.safetensors"])
    for name in ("query_mean", "query_cov"):
        if name not in t:
            raise ValueError(f"{files['model.safetensors']} has no tensor {name!r} (it holds {sorted(t)}): not "
                             "ExpectedAttentionStats")
    mu, cov = np.asarray(t["query_mean"], np.float32), np.asarray(t["query_cov"], np.float32)
    if mu.ndim != 3 or cov.shape != mu.shape + mu.shape[-1:]:
        raise ValueError(f"{files['model.safetensors']}: query_mean must be [layers, heads, head dim] and query_cov "
                         f"[layers, heads, head dim, head dim], got {mu.shape} and {cov.shape}")
    have = dict(num_layers=mu.shape[0], num_heads=mu.shape[1], head_dim=mu.shape[2])
    for key, v in have.items():
        if key in cfg and cfg[key] != v:
            raise ValueError(f"{files['config.json']} says {key}={cfg[key]} but the tensors have {v}: the folder is "
                             "inconsistent, write it again")
    if not (np.isfinite(mu).all() and np.isfinite(cov).all()):
        raise ValueError(f"{files['model.safetensors']}: the query statistics must be finite")
    return mu, cov


def collect_query_stats(model, texts: Iterable[str], n_sink: int = 4, sample_seq_len: int = 1000,
                        out: Optional[str] = None, dataset_name: str = "custom", progress: bool = True):
    """The query statistics ExpectedAttentionStatsPress reads, computed with this engine as kvpress's
    collect_queries computes them with HF transformers: each text cut to its first `sample_seq_len`
    characters (kvpress slices the string), encoded as a prompt (BOS where the tokenizer adds one), run
    through the model; every layer's pre-RoPE queries (after any q norm) of the positions from `n_sink` on,
    over all texts, give the mean and the covariance (divided by N - 1). Returns (query_mean [L, H, d],
    query_cov [L, H, d, d]) in float64, Hugging Face channel order; with `out`, also writes the folder
    (config.json + model.safetensors, kvpress's ExpectedAttentionStats format)."""
    from .._progress import progress_bar
    check_int("n_sink", n_sink, minimum=0)
    check_int("sample_seq_len", sample_seq_len, minimum=1)
    if isinstance(texts, str):
        raise ValueError("texts must be a list of strings, not one string")
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a non-empty list of strings")
    c = model.config
    L, H, d = c["n_layers"], c["n_heads"], c["head_dim"]
    total, outer, count = np.zeros((L, H, d)), np.zeros((L, H, d, d)), 0
    bar = progress_bar(total=len(texts), desc="Collecting queries", disable=not progress, unit="text")
    session = model.new_session()
    try:
        for text in texts:
            ids = np.asarray(model.encode(text[:sample_seq_len]), np.int32)
            if len(ids) > max(n_sink, 1):
                s, o = session.query_moments(ids, n_sink=n_sink)
                total += s
                outer += o
                count += len(ids) - n_sink
            bar.update(1)
    finally:
        bar.close()
    if count < 2:
        raise ValueError(f"the texts give {count} query rows after the first n_sink={n_sink} of each: need at least 2")
    mean = total / count
    cov = (outer - count * mean[..., :, None] * mean[..., None, :]) / (count - 1)
    if c.get("rope_pairing") == "adjacent":  # back to Hugging Face's channel order, the files' convention
        back = np.argsort(_gguf_order(d))
        mean, cov = mean[..., back], cov[..., back, :][..., back]
    if out is not None:
        write_query_stats(out, mean, cov, model_name=os.path.basename(os.path.normpath(getattr(model, "path", "model"))),
                          dataset_name=dataset_name, num_samples=len(texts), sample_seq_len=sample_seq_len, n_sink=n_sink)
    return mean, cov


def write_query_stats(folder: str, mean, cov, model_name: str = "model", dataset_name: str = "custom",
                      num_samples: int = 0, sample_seq_len: int = 0, n_sink: int = 4) -> str:
    """Write query statistics as kvpress's ExpectedAttentionStats.save_pretrained does: config.json (its init
    arguments) and model.safetensors (query_mean, query_cov as float32)."""
    from ._tensor_files import write_safetensors
    mean, cov = np.asarray(mean), np.asarray(cov)
    os.makedirs(folder, exist_ok=True)
    cfg = dict(dataset_name=dataset_name, head_dim=int(mean.shape[2]), model_name=model_name, n_sink=int(n_sink),
               num_heads=int(mean.shape[1]), num_layers=int(mean.shape[0]), num_samples=int(num_samples),
               sample_seq_len=int(sample_seq_len))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    write_safetensors(os.path.join(folder, "model.safetensors"), {"query_mean": mean, "query_cov": cov},
                      metadata={"format": "pt"})
    return folder
