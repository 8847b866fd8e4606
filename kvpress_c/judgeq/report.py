"""Judge Q's reports: the loss curve, a progress bar that degrades politely, and the critical-KV hit rate of
the paper's analysis (kept rows against those the response's own queries would keep)."""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from .. import _core
from .._progress import progress_bar
from .data import _as_samples
from .gradient import _core_model, _soft


def plot_history(hist: dict, path: str) -> None:
    """Training loss per step and validation loss, log scale, to a PNG (matplotlib, Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if hist["steps"]:
        ax.plot(hist["steps"], hist["train_loss"], lw=1, alpha=0.8, label="train (batch mean)")
    if hist["val_steps"]:
        ax.plot(hist["val_steps"], hist["val_loss"], "o-", lw=1.5, label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("Judge Q loss (MSE of attention maps)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- evaluation: critical-KV hit rate ----------------------------------------------------------------

def kept_indices(session, n_layers: int, n_kv: int) -> list[list[np.ndarray]]:
    return [[session.cache_positions(l, h) for h in range(n_kv)] for l in range(n_layers)]


def hit_rates(model, samples, soft_embeddings=None, budgets: Iterable[int] = (64, 128, 256), window: int = 32,
              kernel_size: int = 5, extra_soft: Optional[dict] = None, progress: bool = False) -> dict:
    """Critical-KV hit rate (diagnostics.critical_kv_hit_rate: |kept & oracle| / |oracle|, mean over
    layers and KV heads) against the response-guided oracle (the prompt scored by the queries of the
    sample's own response, ResponseGuidedPress) at equal budget, for Judge Q with `soft_embeddings`
    ("judgeq"), every array in `extra_soft` (name -> soft embeddings) and SnapKV ("snapkv": the last
    `window` prompt tokens as queries, the window kept inside the budget). All share the pooling (avg,
    `kernel_size`) and the GQA mean. Per budget and method: mean, std and n over the samples whose
    prompt is longer than the budget."""
    from ..diagnostics import critical_kv_hit_rate
    from ..presses import JudgeQPress, ResponseGuidedPress, SnapKVPress
    core = _core_model(model)
    cfg = core.config
    L, Hkv = cfg["n_layers"], cfg["n_kv_heads"]
    samples = _as_samples(samples)
    budgets = [int(b) for b in budgets]
    softs = {}
    if soft_embeddings is not None:
        softs["judgeq"] = soft_embeddings
    softs.update(extra_soft or {})
    softs = {k: _soft(v, cfg["hidden"]) for k, v in softs.items()}

    def presses(B, s):
        out = {"oracle": ResponseGuidedPress(response_ids=s.response_ids.tolist(), budget=B, kernel_size=kernel_size)}
        for name, E in softs.items():
            out[name] = JudgeQPress(soft_embeddings=E, budget=B, kernel_size=kernel_size)
        out["snapkv"] = SnapKVPress(budget=B, window_size=window, kernel_size=kernel_size)
        return out

    names = list(softs) + ["snapkv"]
    result = {}
    bar = progress_bar(total=len(budgets) * len(samples), desc="hit rate", disable=not progress)
    for B in budgets:
        rows = {name: [] for name in names}
        for s in samples:
            bar.update(1)
            if len(s.prompt_ids) <= B:
                continue
            extra_rows = max([len(s.response_ids)] + [E.shape[0] for E in softs.values()])
            kept = {}
            for name, press in presses(B, s).items():
                sess = _core.Session(core, len(s.prompt_ids) + extra_rows)
                if press.attach_to_session:
                    sess.set_press(**press.c_config())
                press.prefill(sess, s.prompt_ids.astype(np.int32), cfg)
                kept[name] = kept_indices(sess, L, Hkv)
            for name in names:
                rows[name].append(critical_kv_hit_rate(kept[name], kept["oracle"]))
        result[B] = {name: {"mean": float(np.mean(v)) if v else float("nan"),
                            "std": float(np.std(v)) if v else float("nan"), "n": len(v)} for name, v in rows.items()}
    bar.close()
    return result
