"""Tokenizer: a `tokenizers.Tokenizer` from tokenizer.json, or built from a GGUF file's vocabulary,
merges and pre-tokenizer type; BOS/EOS and every end-of-turn token as stop ids."""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional

from tokenizers import AddedToken, Regex, Tokenizer as _HFTokenizer, decoders, models, normalizers, pre_tokenizers

# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre` (the splits llama.cpp applies for each model
# family; written from their published tokenizer.json files).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")

# end-of-turn tokens of common chat formats, used as stop tokens when present in the vocabulary
_END_OF_TURN = ["<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>", "<end_of_turn>",
                "<|eom_id|>"]


def _byte_level_pre(pre: str):
    pre = (pre or "default").lower()
    if pre in ("llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in ("qwen2", "deepseek-llm", "stablelm2"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # digits one by one, then GPT-2's byte-level split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(self, tok: _HFTokenizer, bos_id: Optional[int], eos_id: Optional[int], add_bos: bool,
                 chat_template: Optional[str], extra_stop_ids: Iterable[int] = ()):
        self._tok = tok
        self.bos_id = bos_id if bos_id is not None and bos_id >= 0 else None
        self.eos_id = eos_id if eos_id is not None and eos_id >= 0 else None
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.chat_template = chat_template or None
        stops = set(extra_stop_ids)
        if self.eos_id is not None:
            stops.add(self.eos_id)
        for t in _END_OF_TURN:
            i = tok.token_to_id(t)
            if i is not None:
                stops.add(i)
        self.stop_ids = frozenset(stops)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, path: str) -> "Tokenizer":
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"no tokenizer.json in '{path}': the folder needs one to encode text "
                                    "(token ids can still be passed directly)")
        tok = _HFTokenizer.from_file(tj)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))

        def token_id(v):
            if isinstance(v, dict):
                v = v.get("content")
            return tok.token_to_id(v) if isinstance(v, str) else None

        bos = token_id(cfg.get("bos_token"))
        eos = token_id(cfg.get("eos_token"))
        if bos is None and isinstance(model_cfg.get("bos_token_id"), int):
            bos = model_cfg["bos_token_id"]
        if eos is None and isinstance(model_cfg.get("eos_token_id"), int):
            eos = model_cfg["eos_token_id"]
        stops = []
        for src in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            stops += src if isinstance(src, list) else ([src] if isinstance(src, int) else [])
        template = cfg.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja):
            with open(jinja) as f:
                template = f.read()
        if template is None:
            template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        # the post-processor may add BOS itself; we add it explicitly instead
        add_bos = cfg.get("add_bos_token", bos is not None and model_cfg.get("model_type") in ("llama", "mistral"))
        tok.post_processor = None
        return cls(tok, bos, eos, add_bos, template, stops)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("this GGUF file has no tokenizer (tokenizer.ggml.tokens): pass token ids instead of text")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
            vocab = {t: i for i, t in enumerate(tokens)}
            tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
            tok.pre_tokenizer = _byte_level_pre(meta.get("tokenizer.ggml.pre"))
            tok.decoder = decoders.ByteLevel()
        elif kind == "llama":
            # SentencePiece vocabulary with scores: a Unigram model over the pieces with byte fallback
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
            tok = _HFTokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores)], unk_id=unk, byte_fallback=True))
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        else:
            raise NotImplementedError(f"GGUF tokenizer model '{kind}' is not supported (gpt2 and llama are)")
        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
        tok.add_special_tokens(specials)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(tok, meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"), add_bos,
                   meta.get("tokenizer.chat_template"), [meta["tokenizer.ggml.eot_token_id"]]
                   if "tokenizer.ggml.eot_token_id" in meta else [])

    # -- use ------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (special tokens written in the text are recognised; no BOS added unless
        add_special_tokens)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: Optional[int]) -> str:
        if i is None:
            return ""
        return self._tok.id_to_token(int(i)) or ""

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}
