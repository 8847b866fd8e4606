"""Tokenizer: a `tokenizers.Tokenizer` loaded from a Hugging Face folder (tokenizer.json) or built from
a GGUF file's vocabulary (byte-level BPE "gpt2" or SentencePiece "llama"), with BOS/EOS, every
end-of-turn token as a stop id, and the chat template.

Tokenisation is not compute, so it stays in Python on top of the `tokenizers` library."""
from __future__ import annotations

import json
import os
import warnings
from typing import Iterable, Optional

from tokenizers import AddedToken, Regex, Tokenizer as _HFTokenizer, decoders, models, normalizers, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# ---- pre-tokenizer split rules, by GGUF `tokenizer.ggml.pre` ------------------------------------
# Each rule is a list of regexes applied one after the other; every regex cuts each current piece
# into its matches and the text between them (both kept), which is how llama.cpp runs its lists and
# what `Split(behavior="isolated")` does. Written from the models' published tokenizer.json files.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
          rf"{_CONTRACTION}|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_RULES = {
    # llama.cpp's fallback for BPE files without a recognised pre-tokenizer
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],          # digits one by one, then GPT-2's split
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "tekken": [_TEKKEN],                  # Mistral Nemo / Pixtral style BPE
    "gpt4o": [_GPT4O],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
}
_PRE_ALIASES = {
    "gpt2": ["gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
             "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat", "exaone4", "trillion", "mellum"],
    "smollm": ["starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
    "llama3": ["llama-bpe", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4",
               "falcon-h1", "midm-2.0", "lfm2"],
    "qwen2": ["deepseek-r1-qwen", "stablelm2", "megrez", "kormo"],
    "gpt4o": ["gpt-4o", "llama4", "minimax-m2"],
}
_PRE_CANONICAL = {name: name for name in _PRE_RULES}
_PRE_CANONICAL.update({alias: name for name, aliases in _PRE_ALIASES.items() for alias in aliases})
# pre-tokenizers whose vocabularies are used with "whole word first" (ignore_merges) in llama.cpp
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "midm-2.0", "lfm2", "pixtral", "tekken"}
# pre-tokenizers for which llama.cpp prepends BOS when the file does not say
_ADD_BOS_BY_DEFAULT = _IGNORE_MERGES | {"chameleon"}

# texts of end-of-turn / end-of-text tokens of common chat formats: when one of these is a special token of
# the vocabulary it is a stop id (generation must end there even if the file names only one EOS)
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "</s>", "<|end|>",
                      "<end_of_turn>", "<|end_of_turn|>", "<EOT>", "<|return|>", "<|END_OF_TURN_TOKEN|>",
                      "<｜end▁of▁sentence｜>")


def _byte_level_pre_tokenizer(pre: Optional[str]):
    """Pre-tokenizer for GGUF pre type `pre` (GPT-2 byte mapping after the family's splits)."""
    name = (pre or "default").strip().lower()
    rule = _PRE_CANONICAL.get(name)
    if rule is None:
        warnings.warn(f"GGUF pre-tokenizer '{pre}' is not known to kvpress_c; splitting text the GPT-2 way, "
                      "token ids may differ from the model's own tokenizer", RuntimeWarning, stacklevel=3)
        rule = "gpt2"
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in _PRE_RULES[rule]]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens, stop ids and chat template.

    Attributes: bos_id, eos_id (int or None), add_bos (a BOS is prepended when encoding a prompt with
    add_special_tokens=True), add_eos, stop_ids (frozenset: EOS and every end-of-turn token),
    chat_template (str or None), vocab_size.
    """

    def __init__(self, tok: _HFTokenizer, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 add_bos: bool = False, chat_template: Optional[str] = None, extra_stop_ids: Iterable[int] = (),
                 special_ids: Optional[Iterable[int]] = None, add_eos: bool = False,
                 unk_id: Optional[int] = None, pad_id: Optional[int] = None):
        self._tok = tok
        n = self._vocab_size = tok.get_vocab_size(with_added_tokens=True)  # fixed from here on

        def valid(i):
            return int(i) if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n else None

        self.bos_id = valid(bos_id)
        self.eos_id = valid(eos_id)
        self.unk_id = valid(unk_id)
        self.pad_id = valid(pad_id)
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.add_eos = bool(add_eos) and self.eos_id is not None
        self.chat_template = chat_template if isinstance(chat_template, str) and chat_template.strip() else None
        if special_ids is None:
            special_ids = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
        self.special_ids = frozenset(int(i) for i in special_ids)
        stops = {v for v in (valid(i) for i in extra_stop_ids) if v is not None}
        if self.eos_id is not None:
            stops.add(self.eos_id)
        for text in END_OF_TURN_TOKENS:
            i = tok.token_to_id(text)
            if i is not None and i in self.special_ids:
                stops.add(i)
        self.stop_ids = frozenset(stops)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, path: str) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ special_tokens_map.json, generation_config.json,
        config.json, chat_template.jinja / chat_template.json when present)."""
        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"no tokenizer.json in '{path}': the folder needs one to encode text "
                                    "(token ids can still be passed directly)")
        try:
            tok = _HFTokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{tj} could not be loaded by the tokenizers library: {e}") from e
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        smap = _read_json(os.path.join(path, "special_tokens_map.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))

        def token_id(key):
            for src in (cfg, smap):
                v = src.get(key)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str) and tok.token_to_id(v) is not None:
                    return tok.token_to_id(v)
            for src in (model_cfg, gen):  # ids, where the tokenizer files name no token
                v = src.get(key + "_id")
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
                if isinstance(v, list) and v and isinstance(v[0], int):
                    return v[0]
            return None

        bos, eos, unk, pad = (token_id(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token"))
        stops = []
        for src in (gen, model_cfg):
            v = src.get("eos_token_id")
            stops += [i for i in (v if isinstance(v, list) else [v]) if isinstance(i, int) and not isinstance(i, bool)]

        template = cfg.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        if template is None:
            template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        if isinstance(template, list):  # named templates: the default one, else the first
            named = [t for t in template if isinstance(t, dict) and isinstance(t.get("template"), str)]
            template = next((t["template"] for t in named if t.get("name") == "default"),
                            named[0]["template"] if named else None)

        # The post-processor is where tokenizer.json adds BOS/EOS; we add them ourselves (encode with
        # add_special_tokens=True), so find out what it adds, then drop it.
        probe = tok.encode("a", add_special_tokens=True).ids
        plain = tok.encode("a", add_special_tokens=False).ids
        adds_bos = bos is not None and len(probe) > len(plain) and probe[0] == bos
        adds_eos = eos is not None and len(probe) > len(plain) and probe[-1] == eos
        add_bos = cfg.get("add_bos_token", adds_bos)
        add_eos = cfg.get("add_eos_token", adds_eos)
        tok.post_processor = None
        return cls(tok, bos, eos, bool(add_bos), template, stops, add_eos=bool(add_eos), unk_id=unk, pad_id=pad)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Build the tokenizer from GGUF metadata (keys -> values as stored: str, int, float, bool, lists)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("this GGUF file has no tokenizer (tokenizer.ggml.tokens is missing or empty): "
                             "pass token ids instead of text")
        n = len(tokens)
        types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * n)
        if len(types) != n:
            raise ValueError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")

        def opt_id(key):
            v = meta.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n else None

        bos, eos = opt_id("tokenizer.ggml.bos_token_id"), opt_id("tokenizer.ggml.eos_token_id")
        unk, pad = opt_id("tokenizer.ggml.unknown_token_id"), opt_id("tokenizer.ggml.padding_token_id")
        pre = meta.get("tokenizer.ggml.pre")
        if kind == "gpt2":
            tok = _gguf_byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], pre)
            default_add_bos = (pre or "").lower() in _ADD_BOS_BY_DEFAULT
        elif kind == "llama":
            add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
            tok = _gguf_sentencepiece_bpe(tokens, types, meta.get("tokenizer.ggml.scores"),
                                          meta.get("tokenizer.ggml.merges"), unk, bool(add_prefix))
            default_add_bos = True
        elif kind in (None, "", "none", "no_vocab"):
            raise ValueError("this GGUF file has no usable tokenizer (tokenizer.ggml.model is "
                             f"{kind!r}): pass token ids instead of text")
        else:
            raise NotImplementedError(f"GGUF tokenizer model '{kind}' is not supported by kvpress_c "
                                      "(supported: 'gpt2' byte-level BPE and 'llama' SentencePiece)")

        # Control tokens (and the unknown token) are special: matched whole in text, skipped when decoding
        # with skip_special_tokens. User-defined tokens are matched whole too but decode as text.
        special, user, special_ids = [], [], []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (_CONTROL, _UNKNOWN) and t:
                special.append(AddedToken(t, special=True, normalized=False))
                special_ids.append(i)
            elif ty == _USER_DEFINED and t:
                user.append(AddedToken(t, special=False, normalized=False))
        # the tokens are already in the vocabulary: this only makes them match whole in text
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        stops = [i for i in (opt_id("tokenizer.ggml.eot_token_id"), opt_id("tokenizer.ggml.eom_token_id"))
                 if i is not None]
        add_bos = meta.get("tokenizer.ggml.add_bos_token", default_add_bos)
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        return cls(tok, bos, eos, bool(add_bos), meta.get("tokenizer.chat_template"), stops,
                   special_ids=special_ids, add_eos=bool(add_eos), unk_id=unk, pad_id=pad)

    # -- use ------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text become their single ids. With
        add_special_tokens, BOS (and EOS) are added as the model's tokenizer settings say."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids = [self.bos_id] + ids
            if self.add_eos:
                ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {n})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: Optional[int]) -> Optional[str]:
        """Token text of id `i` ("" for None, None for an id outside the vocabulary)."""
        if i is None:
            return ""
        return self._tok.id_to_token(int(i))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token(self) -> str:
        return self._text(self.bos_id)

    @property
    def eos_token(self) -> str:
        return self._text(self.eos_id)

    def special_tokens_map(self) -> dict:
        """bos/eos/unk/pad token texts, as chat templates expect them ("" where the model has none)."""
        return {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self._text(self.unk_id),
                "pad_token": self._text(self.pad_id)}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render messages with this model's chat template (a plain one when it has none)."""
        from .chat import render_chat
        kw = self.special_tokens_map()
        kw.update(kwargs)
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **kw)

    def _text(self, i: Optional[int]) -> str:
        return (self._tok.id_to_token(i) or "") if i is not None else ""


# ---- GGUF vocabularies ---------------------------------------------------------------------------
def _vocab_dict(tokens) -> dict:
    # a later duplicate wins, as in transformers' GGUF conversion
    return {t: i for i, t in enumerate(tokens)}


def _parse_merges(merges) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise ValueError(f"GGUF tokenizer.ggml.merges entry {m!r} is not of the form 'left right'")
        out.append((a, b))
    return out


def _gguf_byte_level_bpe(tokens, merges, pre: Optional[str]) -> _HFTokenizer:
    """GPT-2-style byte-level BPE: split with the family's regexes, map bytes to printable characters,
    merge by rank."""
    ignore_merges = (pre or "").strip().lower() in _IGNORE_MERGES
    tok = _HFTokenizer(models.BPE(vocab=_vocab_dict(tokens), merges=_parse_merges(merges), fuse_unk=False,
                                  byte_fallback=False, ignore_merges=ignore_merges))
    if (pre or "").strip().lower() == "qwen2":
        tok.normalizer = normalizers.NFC()  # Qwen2's own tokenizer.json normalises to NFC first
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges_from_scores(tokens, types, scores) -> list[tuple[str, str]]:
    """Merge list equivalent to SentencePiece-BPE's rule "join the adjacent pair whose concatenation is
    the best-scored piece": every split of every mergeable piece into two known pieces, ordered by the
    piece's score (best first), ties by id."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] in (_CONTROL, _BYTE, _UNKNOWN, _UNUSED) or len(t) < 2 or vocab.get(t) != i:
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _gguf_sentencepiece_bpe(tokens, types, scores, merges, unk: Optional[int], add_prefix: bool) -> _HFTokenizer:
    """SentencePiece ("llama") vocabulary as a BPE over characters with byte fallback: spaces become
    '▁', a '▁' is prepended to each text piece (start and after special tokens) when add_space_prefix."""
    if merges:
        merge_list = _parse_merges(merges)
    else:
        if scores is None or len(scores) != len(tokens):
            raise ValueError("GGUF SentencePiece vocabulary needs tokenizer.ggml.scores (one per token) "
                             "or tokenizer.ggml.merges")
        merge_list = _spm_merges_from_scores(tokens, types, scores)
    unk_token = tokens[unk] if unk is not None else None
    tok = _HFTokenizer(models.BPE(vocab=_vocab_dict(tokens), merges=merge_list, unk_token=unk_token, fuse_unk=True,
                                  byte_fallback=True))
    norm = [normalizers.Replace(" ", "▁")]
    if add_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}
