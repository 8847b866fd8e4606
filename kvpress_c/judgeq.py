"""Judge Q training (JudgeQ-trainable-queries.txt; METHODS.md "Judge Q"): soft-token embeddings whose
attention to the prompt imitates the attention of the model's own response.

    import kvpress_c
    from kvpress_c import judgeq
    model = kvpress_c.load_model()
    data = judgeq.build_dataset(model, judgeq.stdlib_corpus("train")[:200])
    result = judgeq.train(model, data, n_soft=32, lr=1e-2, epochs=3, batch_size=16, out="runs/jq")
    press = kvpress_c.JudgeQPress(soft_embeddings=result.soft_embeddings, budget=128)

The loss and its gradient are computed in C (`kvc_judgeq_loss_grad`, csrc/train/judgeq_grad.c): for a
(prompt, response) pair, A_resp[l, h, j] is the mean over the response tokens of their causal softmax
attention read at prompt position j (not renormalised), A_soft the same for the soft tokens appended
after the prompt (positions len(prompt) ..., as JudgeQPress runs them), and the loss is the mean of
(A_soft - A_resp)^2 over layers, query heads and prompt positions. This module only drives it:
data building, AdamW in NumPy, validation, checkpoints that resume exactly, a loss curve.
"""
from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from . import _core

CHECKPOINT = "checkpoint.npz"
FINAL = "soft_embeddings.npy"
BEST = "best_soft_embeddings.npy"
HISTORY = "history.json"
CURVE = "loss_curve.png"


# -- the C core ------------------------------------------------------------------------------------

def _core_model(model):
    core = getattr(model, "_core", model)
    if not isinstance(core, _core.Model):
        raise TypeError(f"model must be a kvpress_c.Model (kvpress_c.load_model(...)), not {type(model).__name__}")
    return core


def _ids(x, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _soft(E, hidden: int) -> np.ndarray:
    E = np.asarray(E)
    if E.ndim != 2 or E.shape[0] < 1 or E.shape[1] != hidden:
        raise ValueError(f"soft embeddings must have shape (n_soft >= 1, {hidden}), got {E.shape}")
    if not np.issubdtype(E.dtype, np.floating):
        raise ValueError(f"soft embeddings must be floats, got dtype {E.dtype}")
    return np.ascontiguousarray(E, dtype=np.float32)


class Pair:
    """One (prompt, response) pair prepared in C: one forward of prompt + response, after which the
    prompt's K/V cache and the response's attention maps are kept, so that each loss / gradient costs
    only the soft rows' forward and backward. `nbytes` is what it holds (about
    n_layers * n_kv_heads * head_dim * 2 * (len(prompt) + max(len(response), max_soft)) floats)."""

    def __init__(self, model, prompt_ids, response_ids, max_soft: int = 32):
        self._core_model = _core_model(model)
        self.hidden = self._core_model.config["hidden"]
        self.prompt_len = len(_ids(prompt_ids, "prompt_ids"))
        self._pair, self.nbytes = _core.judgeq_pair(self._core_model, _ids(prompt_ids, "prompt_ids"),
                                                    _ids(response_ids, "response_ids"), int(max_soft))

    def loss_and_grad(self, E) -> tuple[float, np.ndarray]:
        loss, grad, _, _ = _core.judgeq_loss_grad(self._pair, _soft(E, self.hidden), grad=True)
        return loss, grad

    def loss(self, E) -> float:
        return _core.judgeq_loss_grad(self._pair, _soft(E, self.hidden), grad=False)[0]

    def attention_maps(self, E) -> tuple[np.ndarray, np.ndarray]:
        _, _, a_soft, a_resp = _core.judgeq_loss_grad(self._pair, _soft(E, self.hidden), grad=False, maps=True)
        return a_soft, a_resp


def loss_and_grad(model, prompt_ids, response_ids, E) -> tuple[float, np.ndarray]:
    """Judge Q loss of soft embeddings E [n_soft, hidden] for one (prompt, response) pair, and dL/dE
    (float32, same shape). Computed in C (CPU backend); the GIL is released meanwhile."""
    E = _soft(E, _core_model(model).config["hidden"])
    return Pair(model, prompt_ids, response_ids, max_soft=E.shape[0]).loss_and_grad(E)


def loss_only(model, prompt_ids, response_ids, E) -> float:
    """The loss without the backward pass (validation)."""
    E = _soft(E, _core_model(model).config["hidden"])
    return Pair(model, prompt_ids, response_ids, max_soft=E.shape[0]).loss(E)


def attention_maps(model, prompt_ids, response_ids, E) -> tuple[np.ndarray, np.ndarray]:
    """(A_soft, A_resp), each [n_layers, n_heads, len(prompt)]: the two attention maps the loss compares."""
    E = _soft(E, _core_model(model).config["hidden"])
    return Pair(model, prompt_ids, response_ids, max_soft=E.shape[0]).attention_maps(E)


def token_embeddings(model, ids) -> np.ndarray:
    """Input embedding rows [len(ids), hidden] of the model (float32)."""
    return _core.token_embeddings(_core_model(model), _ids(ids, "ids"))


def init_soft(model, n_soft: int, init: Union[str, Sequence[int]] = "random",
              rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Initial soft embeddings [n_soft, hidden]:
    "random": N(0, s^2) with s the standard deviation of the token embedding matrix;
    "mean": every row the mean token embedding;
    token ids (a sequence of n_soft ids, or fewer, repeated): those tokens' embeddings."""
    core = _core_model(model)
    if isinstance(n_soft, bool) or not isinstance(n_soft, (int, np.integer)) or n_soft < 1:
        raise ValueError(f"n_soft must be a positive integer, got {n_soft!r}")
    vocab, hidden = core.config["vocab"], core.config["hidden"]
    if isinstance(init, str):
        if init not in ("random", "mean"):
            raise ValueError(f"init must be 'random', 'mean' or a sequence of token ids, got {init!r}")
        table = _core.token_embeddings(core, np.arange(vocab, dtype=np.int64))
        if init == "mean":
            return np.repeat(table.mean(axis=0, dtype=np.float64)[None], n_soft, axis=0).astype(np.float32)
        rng = rng if rng is not None else np.random.default_rng(0)
        return (rng.standard_normal((n_soft, hidden)) * float(table.std())).astype(np.float32)
    ids = _ids(list(init), "init token ids")
    ids = np.resize(ids, n_soft)
    return token_embeddings(core, ids)


# -- data ------------------------------------------------------------------------------------------

@dataclass
class Sample:
    prompt_ids: np.ndarray
    response_ids: np.ndarray

    def to_json(self) -> dict:
        return {"prompt_ids": self.prompt_ids.tolist(), "response_ids": self.response_ids.tolist()}


_SKIP_MODULES = ("test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data", "site-packages",
                 "dist-packages", "__pycache__", "encodings", "config-")


def stdlib_corpus(split: str = "all", chunk_chars: int = 1500, min_chars: int = 700,
                  max_chunks_per_module: int = 6) -> list[str]:
    """A small English corpus built from CPython's own standard library (PSF License, shipped with the
    interpreter): for each pure-Python stdlib module, its module docstring followed by the docstrings of
    its top-level classes and functions, as plain text (read with `ast`, nothing is imported), cut at
    paragraph boundaries into pieces of about `chunk_chars` characters (at most
    `max_chunks_per_module` per module; pieces under `min_chars` dropped).
    split: "train" (about 80 % of the modules), "test" (the others, chosen by a hash of the module
    name, so no module is in both) or "all". Deterministic for a given Python version."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not any(s in d for s in _SKIP_MODULES))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith(("test_", "_")) and fn != "__init__.py":
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root)
            name = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
            if split != "all" and (zlib.crc32(name.encode()) % 5 == 0) != (split == "test"):
                continue
            text = _module_text(path, name)
            if text:
                texts.extend(_chunks(text, chunk_chars, min_chars)[:max_chunks_per_module])
    return texts


def _chunks(text: str, size: int, min_size: int) -> list[str]:
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) + 2 > size:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) > size:  # one long paragraph: cut it
            out.append(cur[:size])
            cur = ""
    if cur:
        out.append(cur)
    return [c for c in out if len(c) >= min_size]


def _module_text(path: str, name: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return None
    parts = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(doc.strip())
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            d = ast.get_docstring(node)
            if d:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                parts.append(f"The {kind} {name}.{node.name}: {d.strip()}")
    return "\n\n".join(parts) if parts else None


def _read_source(source) -> list:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"dataset source '{path}' does not exist (a .jsonl of texts or conversations)")
        items = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                line = line.strip()
                if not line:
                    continue
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {i + 1}: not JSON ({e})") from None
        return items
    return list(source)


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


def _item_ids(model, item) -> Optional[list[int]]:
    """Token ids of one corpus item: a string, {"text": ...}, or a ShareGPT conversation
    ({"conversations": [{"from": "human"|"gpt", "value": ...}, ...]} or {"messages": [{"role", "content"}]}),
    the latter rendered with the model's chat template."""
    if isinstance(item, str):
        return model.encode(item)
    if isinstance(item, dict):
        if "text" in item:
            return model.encode(str(item["text"]))
        turns = item.get("conversations", item.get("messages"))
        if isinstance(turns, list):
            messages = []
            for t in turns:
                if not isinstance(t, dict):
                    raise ValueError(f"a conversation turn must be a dict, got {type(t).__name__}")
                role = _ROLES.get(str(t.get("from", t.get("role", ""))).lower())
                content = t.get("value", t.get("content"))
                if role is None or content is None:
                    raise ValueError(f"conversation turn {t!r}: need 'from'/'role' (human, gpt, user, assistant, "
                                     "system) and 'value'/'content'")
                messages.append({"role": role, "content": str(content)})
            if not messages:
                return None
            text = model.apply_chat_template(messages, add_generation_prompt=False)
            return model.encode(text, add_bos=False)
    raise ValueError(f"a corpus item must be a string, {{'text': ...}} or a ShareGPT conversation, got {item!r:.80}")


_GEN_BATCH = 16  # prompts whose greedy responses are decoded together


def build_dataset(model, texts_or_jsonl, *, max_samples: Optional[int] = None, max_text_tokens: int = 320,
                  min_text_tokens: int = 48, prompt_fraction: float = 0.9, max_response_tokens: int = 64,
                  min_response_tokens: int = 8, seed: int = 0, progress: bool = True) -> list[Sample]:
    """Judge Q training pairs, as in the paper's appendix A.1: each text (or conversation rendered with
    the chat template) is tokenised and cut to its first `max_text_tokens` tokens; the prompt is the
    first `prompt_fraction` (90 %) of those tokens; the response is the model's own greedy continuation
    of the prompt (kvpress_c, up to `max_response_tokens`, stopping at an end token), randomly
    truncated to a length drawn uniformly in [min_response_tokens, its length] (seeded). Items shorter
    than `min_text_tokens` are skipped."""
    from .model import Model, greedy_many
    if not isinstance(model, Model):
        raise TypeError("build_dataset needs a kvpress_c.Model (it generates the responses)")
    if not 0 < prompt_fraction < 1:
        raise ValueError(f"prompt_fraction must be in (0, 1), got {prompt_fraction}")
    if min_response_tokens < 1 or max_response_tokens < min_response_tokens:
        raise ValueError("need 1 <= min_response_tokens <= max_response_tokens")
    if max_text_tokens < 2 or min_text_tokens < 2:
        raise ValueError("max_text_tokens and min_text_tokens must be >= 2")
    source = _read_source(texts_or_jsonl)
    items = iter(source)
    rng = np.random.default_rng(seed)
    stop = set(model.tokenizer.stop_ids)
    out: list[Sample] = []
    bar = _progress(total=min(max_samples or len(source), len(source)), desc="judgeq data", disable=not progress)
    exhausted = False
    while not exhausted and (max_samples is None or len(out) < max_samples):
        # the responses of a group of prompts decode together (one batched forward per step)
        want = _GEN_BATCH if max_samples is None else min(_GEN_BATCH, max_samples - len(out))
        prompts = []
        while len(prompts) < want:
            item = next(items, None)
            if item is None:
                exhausted = True
                break
            ids = _item_ids(model, item)
            if not ids or len(ids) < min_text_tokens:
                continue
            ids = ids[:max_text_tokens]
            n_prompt = max(1, int(round(len(ids) * prompt_fraction)))
            prompts.append(np.asarray(ids[:n_prompt], dtype=np.int64))
        if not prompts:
            break
        sessions = [model.new_session(len(p) + max_response_tokens) for p in prompts]
        first = [s.forward(p.astype(np.int32), logits="last") for s, p in zip(sessions, prompts)]
        responses = greedy_many(sessions, first, max_response_tokens, stop)
        del sessions
        for prompt, resp in zip(prompts, responses):
            if len(resp) == 0:
                continue
            keep = int(rng.integers(min(min_response_tokens, len(resp)), len(resp) + 1))
            out.append(Sample(prompt, np.asarray(resp[:keep], dtype=np.int64)))
            bar.update(1)
    bar.close()
    if not out:
        raise ValueError("build_dataset: no usable item (texts too short? lower min_text_tokens)")
    return out


def save_dataset(samples: Sequence[Sample], path: str) -> None:
    """One JSON object per line: {"prompt_ids": [...], "response_ids": [...]}."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for s in samples:
            f.write(json.dumps(s.to_json()) + "\n")
    os.replace(tmp, path)


def load_dataset(path: str) -> list[Sample]:
    out = []
    for i, obj in enumerate(_read_source(path)):
        try:
            out.append(Sample(_ids(obj["prompt_ids"], "prompt_ids"), _ids(obj["response_ids"], "response_ids")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}, record {i + 1}: not a Judge Q sample ({e})") from None
    return out


def _as_samples(data) -> list[Sample]:
    out = []
    for i, s in enumerate(data):
        if isinstance(s, Sample):
            out.append(s)
        elif isinstance(s, dict) and "prompt_ids" in s and "response_ids" in s:
            out.append(Sample(_ids(s["prompt_ids"], "prompt_ids"), _ids(s["response_ids"], "response_ids")))
        elif isinstance(s, (tuple, list)) and len(s) == 2:
            out.append(Sample(_ids(s[0], "prompt_ids"), _ids(s[1], "response_ids")))
        else:
            raise ValueError(f"training sample {i} must be a Sample, a (prompt_ids, response_ids) pair or a dict "
                             "with prompt_ids and response_ids")
    return out


def _fingerprint(samples: Sequence[Sample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(np.asarray(s.prompt_ids, dtype=np.int64).tobytes())
        h.update(b"|")
        h.update(np.asarray(s.response_ids, dtype=np.int64).tobytes())
        h.update(b"#")
    return h.hexdigest()[:16]


# -- optimiser -------------------------------------------------------------------------------------

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
    bar = _progress(total=total_steps, initial=step, desc="judgeq train", disable=not progress)
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


def _progress(total=None, initial=0, desc="", disable=False):
    try:
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, desc=desc, disable=disable, dynamic_ncols=True, file=sys.stderr)
    except ImportError:  # pragma: no cover
        class _Null:
            def update(self, n=1): pass
            def set_postfix(self, *a, **k): pass
            def close(self): pass
        return _Null()


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
    from .diagnostics import critical_kv_hit_rate
    from .presses import JudgeQPress, ResponseGuidedPress, SnapKVPress
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
    bar = _progress(total=len(budgets) * len(samples), desc="hit rate", disable=not progress)
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
