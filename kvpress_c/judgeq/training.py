"""Judge Q's training loop: AdamW in NumPy over the C gradient, gradient accumulation, validation, a
checkpoint after every step that resumes exactly, the loss history and curve."""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from .data import Sample, _as_samples, _fingerprint
from .gradient import Pair, _core_model, _soft, init_soft, loss_only
from .._progress import progress_bar
from .report import plot_history


CHECKPOINT = "checkpoint.npz"
FINAL = "soft_embeddings.npy"
BEST = "best_soft_embeddings.npy"
HISTORY = "history.json"
CURVE = "loss_curve.png"


@dataclass
class AdamW:
    """AdamW as torch.optim.AdamW: p <- p (1 - lr wd); m, v moments; p <- p - lr m_hat / (sqrt(v_hat) + eps)."""
    lr: float
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def step(self, p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int) -> None:
        """In place on float64 p, m, v; t is the 1-based step number."""
        b1, b2 = self.betas
        p *= 1.0 - self.lr * self.weight_decay
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * g * g
        m_hat = m / (1.0 - b1 ** t)
        v_hat = v / (1.0 - b2 ** t)
        p -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


# -- training --------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    soft_embeddings: np.ndarray        # final E [n_soft, hidden]
    best_soft_embeddings: np.ndarray   # E at the lowest validation loss
    history: dict                      # steps, train_loss, val_steps, val_loss, seconds
    out: Optional[str] = None
    resumed_from_step: int = 0

    @property
    def val_loss(self) -> list:
        return self.history["val_loss"]


def evaluate(model, E, data) -> float:
    """Mean Judge Q loss of E over samples (no gradient)."""
    samples = _as_samples(data)
    if not samples:
        raise ValueError("evaluate: no samples")
    return float(np.mean([loss_only(model, s.prompt_ids, s.response_ids, E) for s in samples]))


def train(model, data, n_soft: int = 32, lr: float = 5e-5, epochs: int = 3, batch_size: int = 32,
          weight_decay: float = 0.0, seed: int = 0, out: Optional[str] = None,
          init: Union[str, Sequence[int], np.ndarray] = "random", val_fraction: float = 0.1,
          betas: tuple = (0.9, 0.999), eps: float = 1e-8, val_every: int = 0, max_steps: Optional[int] = None,
          resume: bool = True, progress: bool = True, plot: bool = True, val_data=None,
          cache_mb: float = 4096) -> TrainResult:
    """Train soft tokens with AdamW (NumPy) on (prompt, response) samples.

    data: Samples, (prompt_ids, response_ids) pairs or dicts (build_dataset / load_dataset).
    A seeded `val_fraction` of it is held out (or `val_data` is used); each optimiser step accumulates
    the gradient of `batch_size` samples (their mean). Validation loss before training, every
    `val_every` steps (0: at the end of each epoch only) and at the end. Paper setup: lr 5e-5, 3 epochs,
    batch 32 (over 50 000 samples); small CPU runs need a larger lr (docs/results/judgeq/README.md).
    init: "random", "mean", token ids, or an array [n_soft, hidden].
    out: a folder for checkpoint.npz (E, Adam moments, step, epoch position, RNG state; written after
    every step, atomically), history.json, soft_embeddings.npy, best_soft_embeddings.npy and
    loss_curve.png. With resume=True an existing checkpoint there is continued exactly where it stopped
    (same data and settings required). max_steps stops early (a checkpoint remains to resume from).
    cache_mb: memory for prepared pairs (Pair: the prompt's K/V and the target, computed once and
    reused every epoch, which saves the prompt + response forward); samples beyond it are prepared
    again at each use. The results are the same either way."""
    core = _core_model(model)
    hidden = core.config["hidden"]
    samples = _as_samples(data)
    for name, val, lo in (("epochs", epochs, 1), ("batch_size", batch_size, 1)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {val!r}")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if val_data is None and not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if max_steps is not None and (not isinstance(max_steps, (int, np.integer)) or max_steps < 0):
        raise ValueError(f"max_steps must be a non-negative integer, got {max_steps!r}")

    rng = np.random.default_rng(seed)
    if val_data is not None:
        train_set, val_set = samples, _as_samples(val_data)
    else:
        order = rng.permutation(len(samples))
        n_val = int(round(len(samples) * val_fraction))
        if val_fraction > 0:
            n_val = max(1, n_val)
        val_set = [samples[i] for i in order[:n_val]]
        train_set = [samples[i] for i in order[n_val:]]
    if not train_set:
        raise ValueError(f"no training samples left ({len(samples)} samples, val_fraction {val_fraction})")
    if isinstance(init, np.ndarray):
        E = _soft(init, hidden).copy()
        if E.shape[0] != n_soft:
            raise ValueError(f"init array has {E.shape[0]} rows, n_soft is {n_soft}")
        init_desc = "array"
    else:
        E = init_soft(core, n_soft, init, rng)
        init_desc = init if isinstance(init, str) else [int(i) for i in init]
    settings = {"n_soft": int(n_soft), "lr": float(lr), "epochs": int(epochs), "batch_size": int(batch_size),
                "weight_decay": float(weight_decay), "seed": int(seed), "init": init_desc,
                "val_fraction": float(val_fraction), "betas": [float(b) for b in betas], "eps": float(eps),
                "val_every": int(val_every), "data": _fingerprint(train_set), "val_data": _fingerprint(val_set),
                "model": os.path.basename(getattr(model, "path", "") or core.path or "")}
    opt = AdamW(lr=float(lr), betas=tuple(betas), eps=float(eps), weight_decay=float(weight_decay))
    steps_per_epoch = math.ceil(len(train_set) / batch_size)
    total_steps = epochs * steps_per_epoch

    # state
    p = E.astype(np.float64)
    m1 = np.zeros_like(p)
    m2 = np.zeros_like(p)
    step, epoch, batch, perm = 0, 0, 0, None
    hist = {"steps": [], "train_loss": [], "val_steps": [], "val_loss": [], "seconds": [], "settings": settings}
    best = (math.inf, p.astype(np.float32))
    resumed = 0
    if out is not None:
        os.makedirs(out, exist_ok=True)
        ck = os.path.join(out, CHECKPOINT)
        if resume and os.path.exists(ck):
            st = _load_checkpoint(ck)
            if st["settings"] != settings:
                diff = {k: (st["settings"].get(k), v) for k, v in settings.items() if st["settings"].get(k) != v}
                raise ValueError(f"{ck} was written with other settings or data: {diff}; use another out folder "
                                 "or resume=False")
            p, m1, m2 = st["E"], st["m"], st["v"]
            step, epoch, batch, perm = st["step"], st["epoch"], st["batch"], st["perm"]
            rng.bit_generator.state = st["rng"]
            hist = st["history"]
            best = (st["best_loss"], st["best_E"])
            resumed = step

    cache = _PairCache(core, n_soft, cache_mb)

    def validate():
        if not val_set:
            return None
        Ef = p.astype(np.float32)
        v = float(np.mean([cache.get(("val", i), s).loss(Ef) for i, s in enumerate(val_set)]))
        hist["val_steps"].append(step)
        hist["val_loss"].append(v)
        nonlocal best
        if v < best[0]:
            best = (v, p.astype(np.float32))
        return v

    if step == 0 and not hist["val_steps"]:
        validate()
        _save(out, p, m1, m2, step, epoch, batch, perm, rng, hist, best)
    bar = progress_bar(total=total_steps, initial=step, desc="judgeq train", disable=not progress)
    t_start = time.perf_counter()
    stopped = False
    while epoch < epochs and not stopped:
        if batch == 0 or perm is None:
            perm = rng.permutation(len(train_set))
        while batch < steps_per_epoch:
            if max_steps is not None and step >= max_steps:
                stopped = True
                break
            idx = perm[batch * batch_size:(batch + 1) * batch_size]
            t0 = time.perf_counter()
            g = np.zeros_like(p)
            losses = []
            Ef = p.astype(np.float32)
            for i in idx:
                loss, grad = cache.get(("train", int(i)), train_set[i]).loss_and_grad(Ef)
                losses.append(loss)
                g += grad
            g /= len(idx)
            step += 1
            opt.step(p, g, m1, m2, step)
            batch += 1
            hist["steps"].append(step)
            hist["train_loss"].append(float(np.mean(losses)))
            hist["seconds"].append(time.perf_counter() - t0)
            if val_every and step % val_every == 0 and batch < steps_per_epoch:
                validate()
            if batch == steps_per_epoch:
                epoch, batch = epoch + 1, 0
                validate()
            _save(out, p, m1, m2, step, epoch, batch, perm, rng, hist, best)
            bar.update(1)
            post = {"loss": f"{hist['train_loss'][-1]:.3e}"}
            if hist["val_loss"]:
                post["val"] = f"{hist['val_loss'][-1]:.3e}"
            bar.set_postfix(post)
            if batch == 0:
                break
    bar.close()
    final = p.astype(np.float32)
    if not val_set:
        best = (math.nan, final)
    result = TrainResult(final, best[1], hist, out, resumed)
    if out is not None:
        np.save(os.path.join(out, FINAL), final)
        np.save(os.path.join(out, BEST), best[1])
        with open(os.path.join(out, HISTORY), "w") as f:
            json.dump(hist, f, indent=1)
        if plot:
            plot_history(hist, os.path.join(out, CURVE))
    _ = t_start
    return result


class _PairCache:
    """Prepared pairs kept while they fit in `mb` megabytes (the rest are prepared at each use)."""

    def __init__(self, core, max_soft: int, mb: float):
        self.core, self.max_soft, self.budget = core, int(max_soft), float(mb) * 2 ** 20
        self.pairs, self.used = {}, 0

    def get(self, key, sample: Sample) -> Pair:
        pair = self.pairs.get(key)
        if pair is None:
            pair = Pair(self.core, sample.prompt_ids, sample.response_ids, self.max_soft)
            if self.used + pair.nbytes <= self.budget:
                self.pairs[key] = pair
                self.used += pair.nbytes
        return pair


def _save(out, p, m1, m2, step, epoch, batch, perm, rng, hist, best) -> None:
    if out is None:
        return
    path = os.path.join(out, CHECKPOINT)
    tmp = path + ".tmp.npz"
    np.savez(tmp, E=p, m=m1, v=m2, step=np.int64(step), epoch=np.int64(epoch), batch=np.int64(batch),
             perm=np.asarray(perm if perm is not None else [], dtype=np.int64), has_perm=np.int8(perm is not None),
             rng=np.array(json.dumps(rng.bit_generator.state)), history=np.array(json.dumps(hist)),
             best_loss=np.float64(best[0]), best_E=best[1])
    os.replace(tmp, path)


def _load_checkpoint(path: str) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            hist = json.loads(str(z["history"]))
            return {"E": z["E"].astype(np.float64), "m": z["m"].astype(np.float64), "v": z["v"].astype(np.float64),
                    "step": int(z["step"]), "epoch": int(z["epoch"]), "batch": int(z["batch"]),
                    "perm": z["perm"].copy() if int(z["has_perm"]) else None, "rng": json.loads(str(z["rng"])),
                    "history": hist, "settings": hist["settings"], "best_loss": float(z["best_loss"]),
                    "best_E": z["best_E"].astype(np.float32)}
    except (KeyError, ValueError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a Judge Q checkpoint ({e})") from None
