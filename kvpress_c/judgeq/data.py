"""Judge Q's data: (prompt, response) samples from texts or conversations, the model's own greedy responses
(the paper's appendix), saved as jsonl; the default corpus is CPython's standard library docstrings."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .gradient import _ids
from .._progress import progress_bar


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
    from ..model import Model, greedy_many
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
    bar = progress_bar(total=min(max_samples or len(source), len(source)), desc="judgeq data", disable=not progress)
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
