"""Tokenizer and chat templates.

- The tokenizer built from the default GGUF's metadata (read here with gguf's GGUFReader) against
  transformers' tokenizer for the same file: identical ids on fixed and random strings.
- Tiny synthetic vocabularies (Llama-3 / Qwen2 / SmolLM / GPT-2 / default byte-level BPE, and
  SentencePiece) against plain-Python reference encoders written here from the algorithms' definitions
  (and against transformers' GGUF converters where transformers has one for that family).
- Chat rendering against transformers' renderer; kvpress's context/question split against kvpress's own
  pipeline preprocessing.
"""
import json
import os
import unicodedata

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
regex = pytest.importorskip("regex")
gguf = pytest.importorskip("gguf")

from kvpress_c.chat import render_chat, split_context_question  # noqa: E402
from kvpress_c.tokenizer import Tokenizer  # noqa: E402
from hf_models import _bytes_to_unicode  # noqa: E402

SPECIALS_DEFAULT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>"]

TEXTS = [
    "Hello world", "Hello, world!", "hello   world", "  leading spaces", "trailing spaces   ", "\ttab\tseparated\t",
    "line1\nline2\n\nline4", "\r\nwindows\r\nline endings\r\n", "12345", "3.14159", "1,000,000 and -42 +17 = -25",
    "2024-01-01T12:00:00Z", "phone: +1 (555) 123-4567", "x²+y³=z¹", "½ ¼ ¾ Ⅻ", "٣٤٥ ४५६ ௧௨", "café naïve résumé",
    "e\u0301 decomposed vs \u00e9 composed", "Ωmega αβγ δ", "日本語のテキスト", "中文和English混合", "한국어 텍스트",
    "Привет, мир!", "مرحبا بالعالم", "emoji 😀🚀👍🏽", "👨\u200d👩\u200d👧 family", "def f(x):\n    return x ** 2  # square",
    "for (int i = 0; i < n; ++i) { a[i] = b[i]; }", '<div class="x">&amp;</div>', "https://example.com/p?q=1&r=2#frag",
    "user@example.com", "don't won't I'm you're they've we'd she'll", "DON'T WON'T I'M YOU'RE", "MiXeD CaSe WoRdS",
    "punctuation!!! ??? ... ;;; --- ___", "    indented four", "a" * 300, " " * 17, "\n" * 5, "", " ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>after eos", "text<|im_end|>",
    "<|im_start|><|im_end|>", "not special: <|im_start and |>", "<repo_name>x<file_sep>y",
    "The quick brown fox jumps over the lazy dog. " * 30, '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Ĳ ĳ ǅ ǆ ﬁ", "I have 2 cats, 10 dogs and 100 fish.", "v1.2.3-rc4", "\u00a0nbsp\u2009thin\u3000ideographic", "zero\u200bwidth", "mixed\t \n \t\nspace", "tab\t\t\tend",
]

_POOL = (["the", " the", "The", " quick", "brown", " fox", "hello", " world", "lazy", " dog", "ing", "tion", "re", "'s",
          "'T", "'ll", "'VE"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") + list("0123456789")
         + [" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n", "\u00a0"] + list(".,;:!?-_()[]{}<>/\\|@#$%^&*+=~`\"'")
         + ["é", "ü", "ß", "Ω", "ж", "日本", "中", "한", "😀", "🚀", "²", "½", "٣", "e\u0301", "\u200b", "ﬁ", "…", "—"])


def _random_texts(rng, n, specials=()):
    pool = _POOL + list(specials)
    out = []
    for _ in range(n):
        k = int(rng.integers(1, 40))
        out.append("".join(pool[int(i)] for i in rng.integers(0, len(pool), size=k)))
    return out


def _seeded_rng():
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


# ---- the default GGUF against transformers ---------------------------------------------------------
def gguf_metadata(path: str) -> dict:
    """GGUF key/value metadata as plain Python values (what the C API's metadata() gives)."""
    reader = gguf.GGUFReader(path)
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        meta[name] = value
    return meta


@pytest.fixture(scope="module")
def meta(default_gguf):
    return gguf_metadata(default_gguf)


@pytest.fixture(scope="module")
def ours(meta):
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf_tok(default_gguf):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf))


def test_metadata_dict_format(meta):
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert isinstance(meta["tokenizer.ggml.tokens"][0], str) and isinstance(meta["tokenizer.ggml.token_type"][0], int)
    assert isinstance(meta["tokenizer.ggml.merges"][0], str) and " " in meta["tokenizer.ggml.merges"][0]
    assert meta["tokenizer.ggml.add_bos_token"] is False


@pytest.fixture(scope="module")
def hf_published(hf_tok):
    """transformers' tokenizer for the GGUF with SmolLM2's published pre-tokenizer (every numeric character
    on its own, then GPT-2's split), which is what GGUF pre type "smollm" means (llama.cpp splits the same
    way). transformers' GGUF loader ignores the pre type and uses GPT-2's split alone, so around numbers
    ("  1", "\r\n7", " ½") it tokenises differently from the model's own tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer, pre_tokenizers
    t = HFTokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return t


def _has_numeric(text):
    return any(unicodedata.category(c).startswith("N") for c in text)


def _check_against_transformers(ours, hf_tok, hf_published, texts, info=""):
    """Identical ids to transformers' tokenizer for the same GGUF wherever the GGUF pre type has no say (no
    numeric character), and identical ids to it with the published pre-tokenizer everywhere."""
    n_same = 0
    for text in texts:
        got = ours.encode(text)
        assert got == hf_published.encode(text, add_special_tokens=False).ids, f"{info} text={text!r}"
        ref = hf_tok(text, add_special_tokens=False)["input_ids"]
        if not _has_numeric(text):
            assert got == ref, f"{info} text={text!r}"
        n_same += got == ref
    return n_same


def test_encode_matches_transformers(ours, hf_tok, hf_published):
    assert len(TEXTS) >= 50
    n_same = _check_against_transformers(ours, hf_tok, hf_published, TEXTS)
    assert n_same >= len(TEXTS) - 3, n_same  # only the odd numeral case differs from transformers
    # where the two differ: transformers splits "  1" as " " + " 1", the model's tokenizer as "  " + "1"
    assert ours.encode("x  1") == [ours.token_to_id("x"), ours.token_to_id("ĠĠ"), ours.token_to_id("1")]


def test_encode_random_matches_transformers(ours, hf_tok, hf_published):
    rng, seed = _seeded_rng()
    _check_against_transformers(ours, hf_tok, hf_published, _random_texts(rng, 60, SPECIALS_DEFAULT), f"seed={seed}")


def test_decode_round_trip(ours, hf_tok):
    rng, seed = _seeded_rng()
    for text in TEXTS + _random_texts(rng, 30):
        ids = ours.encode(text)
        if not any(s in text for s in SPECIALS_DEFAULT):
            assert ours.decode(ids) == text, f"seed={seed} text={text!r}"
        assert ours.decode(ids, skip_special_tokens=False) == text, f"seed={seed} text={text!r}"
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_stop_ids(ours, meta, hf_tok):
    assert ours.encode("<|im_start|>") == [1] and ours.encode("<|im_end|>") == [2] and ours.encode("<|endoftext|>") == [0]
    assert ours.bos_id == 1 and ours.eos_id == 2 and ours.bos_token == "<|im_start|>" and ours.eos_token == "<|im_end|>"
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end == 2 and im_end in ours.stop_ids and 0 in ours.stop_ids  # <|im_end|> and <|endoftext|>
    assert ours.stop_ids <= ours.special_ids | {ours.eos_id}
    assert not ours.add_bos and ours.encode("hi", add_special_tokens=True) == ours.encode("hi")  # file says no BOS
    assert ours.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert ours.id_to_token(1) == "<|im_start|>" and ours.id_to_token(None) == "" and ours.id_to_token(10 ** 6) is None
    assert ours.chat_template == meta["tokenizer.chat_template"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([ours.vocab_size])


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "Unicode: 日本語 😀 café\nand newlines\n\n"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced  "}, {"role": "assistant", "content": "ok"}],
]


def test_chat_matches_transformers(ours, hf_tok):
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ref = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == ref, (conv, gen)
            assert render_chat(ours.chat_template, conv, add_generation_prompt=gen) == ref


# Hand-written templates in the styles of other model families, rendered by transformers' renderer.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}\n"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}\n"
    "  {%- if loop.index0 > 5 %}{% break %}{% endif %}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
GENERATION_TAG_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                           "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")


def _hf_render(template, conv, **kw):
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template(conversations=[conv], chat_template=template, **kw)
    return rendered[0]


def test_chat_templates_of_other_families_match_transformers():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <in> \"city\" & é",
                                               "parameters": {"type": "object"}}}]
    kw = dict(bos_token="<s>", eos_token="</s>", date_string="26 Jul 2024")
    alternating = [c for c in CONVERSATIONS if all((m["role"] == "user") == (i % 2 == 0) for i, m in enumerate(c))]
    for template in (LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, QWEN_TEMPLATE, GENERATION_TAG_TEMPLATE):
        for conv in (CONVERSATIONS if template is not MISTRAL_TEMPLATE else alternating):
            for extra in ({}, {"tools": tools, "enable_thinking": False}):
                ref = _hf_render(template, conv, add_generation_prompt=True, **kw, **extra)
                assert render_chat(template, conv, add_generation_prompt=True, **kw, **extra) == ref, (template, conv)


def test_chat_helpers_and_sandbox():
    from jinja2.exceptions import SecurityError, TemplateError
    with pytest.raises(TemplateError, match="must alternate"):
        render_chat(MISTRAL_TEMPLATE, [{"role": "assistant", "content": "x"}])
    year = render_chat("{{ strftime_now('%Y') }}", [])
    assert year.isdigit() and len(year) == 4
    with pytest.raises(SecurityError):
        render_chat("{{ messages.append(1) }}", [])  # immutable sandbox
    with pytest.raises((SecurityError, TemplateError)):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    assert render_chat("{{ x | tojson }}", [], x={"a": "<é>"}) == '{"a": "<é>"}'
    # no template: plain contents, one per line, after BOS
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat(None, conv, bos_token="<s>") == "<s>S\nU\n"
    with pytest.raises(TypeError):
        render_chat(QWEN_TEMPLATE, "not a list")


# ---- kvpress's context / question split ----------------------------------------------------------
def test_split_context_question(ours):
    template = ours.chat_template
    for context, question in [("CONTEXT", "QUESTION"), ("A long document.\nWith lines. " * 20, "What is it?"),
                              ("", "q"), ("### hashes ###", "#?")]:
        ctx, suffix = split_context_question(template, context, bos_token=ours.bos_token, eos_token=ours.eos_token)
        full = ours.apply_chat_template([{"role": "user", "content": context + question}])
        assert ctx + question + suffix == full
        assert suffix.endswith("<|im_start|>assistant\n") and suffix.startswith("<|im_end|>")
    for other in (LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, QWEN_TEMPLATE):
        ctx, suffix = split_context_question(other, "DOC", bos_token="<s>", eos_token="</s>", date_string="x")
        full = render_chat(other, [{"role": "user", "content": "DOCQ?"}], bos_token="<s>", eos_token="</s>",
                           date_string="x", enable_thinking=False)
        assert ctx + "Q?" + suffix == full
    # kvpress splits with thinking disabled
    assert split_context_question(QWEN_TEMPLATE, "D")[1].endswith("<think>\n\n</think>\n\n")
    assert split_context_question(None, "C", bos_token="<s>") == ("<s>C", "\n")
    with pytest.raises(ValueError, match="more than once"):
        split_context_question("{{ messages[0]['content'] * 2 }}", "C")
    with pytest.raises(ValueError, match="verbatim"):
        split_context_question("{{ 'no content' }}", "c")
    # kvpress's own cut (text.split(separator)) is the same except for a context ending in '#'
    for context in ("plain", "# Title\nbody", "ends with ##"):
        sep = "#" * (len(context) + 10)
        prompt = ours.apply_chat_template([{"role": "user", "content": context + sep}])
        ours_split = split_context_question(template, context, bos_token=ours.bos_token, eos_token=ours.eos_token)
        kvpress_split = tuple(prompt.split(sep))
        assert (ours_split == kvpress_split) == (not context.endswith("#"))


def test_split_matches_kvpress_pipeline(ours, hf_tok):
    """Token ids of the context and question parts equal kvpress's own preprocessing."""
    kvpipe = pytest.importorskip("kvpress.pipeline")

    class _Fake:
        tokenizer = hf_tok

    context, questions = "The cat sat on the mat.\nIt was 12 years old. ", ["How old?", "Where did it sit?"]
    ref = kvpipe.KVPressTextGenerationPipeline.preprocess(_Fake(), context, questions, "Answer:", 10 ** 6)
    ctx, suffix = split_context_question(ours.chat_template, context, bos_token=ours.bos_token, eos_token=ours.eos_token)
    assert ours.encode(ctx) == ref["context_ids"][0].tolist()
    for q, ref_q in zip(questions, ref["questions_ids"]):
        assert ours.encode(q + suffix + "Answer:") == ref_q[0].tolist()


# ---- synthetic byte-level BPE vocabularies ---------------------------------------------------------
BYTE_MAP = _bytes_to_unicode()  # GPT-2's byte -> printable character table
CORPUS = ("The quick brown fox jumps over the lazy dog. the theory of the thing is that there is nothing there. "
          "Hello world! hello there, world. 12345 67890 1000000 3.14 don't won't I'm they're we've "
          "   indented code(x) + y == z; return None\n\n\ndef main():\n    pass\n naïve café 日本語 日本 ")


def _split(text, regexes):
    pieces = [text]
    for rx in regexes:
        out = []
        for p in pieces:
            pos = 0
            for m in regex.finditer(rx, p):
                if m.start() > pos:
                    out.append(p[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(p):
                out.append(p[pos:])
        pieces = out
    return pieces


def _train_byte_bpe(words, n_merges):
    """Naive BPE training (most frequent adjacent pair, ties by first seen): vocab list + merges."""
    vocab = [BYTE_MAP[b] for b in range(256)]
    seqs = [[BYTE_MAP[b] for b in w.encode()] for w in words]
    merges = []
    for _ in range(n_merges):
        counts = {}
        for s in seqs:
            for a, b in zip(s, s[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        (a, b), c = max(counts.items(), key=lambda kv: kv[1])
        if c < 2:
            break
        merges.append((a, b))
        vocab.append(a + b)
        new = []
        for s in seqs:
            t, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    t.append(a + b)
                    i += 2
                else:
                    t.append(s[i])
                    i += 1
            new.append(t)
        seqs = new
    return vocab, merges


def _split_specials(text, specials):
    if not specials:
        return [(False, text)]
    rx = "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True))
    out, pos = [], 0
    for m in regex.finditer(rx, text):
        if m.start() > pos:
            out.append((False, text[pos:m.start()]))
        out.append((True, m.group()))
        pos = m.end()
    if pos < len(text):
        out.append((False, text[pos:]))
    return out


def _ref_byte_bpe(text, vocab, merges, regexes, specials, ignore_merges=False, nfc=False):
    """Reference byte-level BPE encoder: specials, split, byte map, lowest-rank merge first."""
    ids = {t: i for i, t in enumerate(vocab)}
    ranks = {m: r for r, m in enumerate(merges)}
    out = []
    for is_special, frag in _split_specials(text, specials):
        if is_special:
            out.append(ids[frag])
            continue
        if nfc:
            frag = unicodedata.normalize("NFC", frag)
        for piece in _split(frag, regexes):
            word = "".join(BYTE_MAP[b] for b in piece.encode())
            if ignore_merges and word in ids:
                out.append(ids[word])
                continue
            syms = list(word)
            while len(syms) > 1:
                best = min(range(len(syms) - 1), key=lambda i: (ranks.get((syms[i], syms[i + 1]), 1 << 30), i))
                if (syms[best], syms[best + 1]) not in ranks:
                    break
                syms[best:best + 2] = [syms[best] + syms[best + 1]]
            out += [ids[s] for s in syms]
    return out


R_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
R_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+")
R_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
R_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
            r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
R_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_CASES = {  # GGUF pre name -> (regexes, ignore_merges, nfc)
    "llama-bpe": ([R_LLAMA3], True, False),
    "tekken": ([R_TEKKEN], True, False),
    "llama4": ([R_GPT4O], False, False),
    "qwen2": ([R_QWEN2], False, True),
    "smollm": ([r"\p{N}", R_GPT2], False, False),
    "gpt-2": ([R_GPT2], False, False),
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", R_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False, False),
}
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _synthetic_byte_level(pre):
    regexes = PRE_CASES[pre][0]
    words = _split(CORPUS * 3, regexes)
    vocab, merges = _train_byte_bpe(words, 300)
    tokens = vocab + LLAMA3_SPECIALS + ["<tool>"]
    types = [1] * len(vocab) + [3] * len(LLAMA3_SPECIALS) + [4]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
            "tokenizer.ggml.bos_token_id": tokens.index("<|begin_of_text|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|eot_id|>"), "tokenizer.chat_template": LLAMA3_TEMPLATE}
    return meta, tokens, merges


@pytest.mark.parametrize("pre", sorted(PRE_CASES))
def test_synthetic_byte_level_bpe_matches_reference(pre):
    meta, tokens, merges = _synthetic_byte_level(pre)
    tok = Tokenizer.from_gguf_metadata(meta)
    regexes, ignore_merges, nfc = PRE_CASES[pre]
    rng, seed = _seeded_rng()
    specials = LLAMA3_SPECIALS + ["<tool>"]
    for text in TEXTS + _random_texts(rng, 60, specials) + [CORPUS]:
        ref = _ref_byte_bpe(text, tokens, merges, regexes, specials, ignore_merges, nfc)
        assert tok.encode(text) == ref, f"pre={pre} seed={seed} text={text!r}"
        if not any(s in text for s in specials) and (not nfc or unicodedata.normalize("NFC", text) == text):
            assert tok.decode(tok.encode(text)) == text, f"pre={pre} seed={seed} text={text!r}"
    # user-defined tokens match whole but stay text when decoding
    assert tok.encode("<tool>") == [tokens.index("<tool>")] and tok.decode(tok.encode("a<tool>")) == "a<tool>"


def test_synthetic_qwen2_matches_transformers_converter():
    from transformers.integrations.ggml import convert_gguf_tokenizer
    meta, tokens, merges = _synthetic_byte_level("qwen2")
    # transformers' Qwen2 conversion knows only the three ChatML specials: use those
    tokens = tokens[:-6] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    meta.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * (len(tokens) - 3) + [3, 3, 3],
                 "tokenizer.ggml.bos_token_id": len(tokens) - 3, "tokenizer.ggml.eos_token_id": len(tokens) - 1})
    ref, _ = convert_gguf_tokenizer("qwen2", {"tokens": tokens, "merges": meta["tokenizer.ggml.merges"],
                                              "token_type": meta["tokenizer.ggml.token_type"]})
    tok = Tokenizer.from_gguf_metadata(meta)
    rng, seed = _seeded_rng()
    for text in TEXTS + _random_texts(rng, 60, ["<|im_start|>", "<|im_end|>"]):
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, f"seed={seed} text={text!r}"
    assert tok.stop_ids == {len(tokens) - 1, len(tokens) - 3}  # <|im_end|> (EOS) and <|endoftext|>


def test_llama3_style_stop_tokens_and_bos():
    meta, tokens, _ = _synthetic_byte_level("llama-bpe")
    tok = Tokenizer.from_gguf_metadata(meta)
    eot, eos_text = tokens.index("<|eot_id|>"), tokens.index("<|end_of_text|>")
    bos = tokens.index("<|begin_of_text|>")
    assert {eot, eos_text} <= tok.stop_ids and tok.eos_id == eot
    assert tok.add_bos and tok.bos_id == bos  # llama.cpp's default for Llama-3 vocabularies without the key
    assert tok.encode("hi", add_special_tokens=True) == [bos] + tok.encode("hi")
    meta["tokenizer.ggml.add_bos_token"] = False
    assert not Tokenizer.from_gguf_metadata(meta).add_bos
    conv = [{"role": "user", "content": "Hello"}]
    prompt = tok.apply_chat_template(conv, date_string="1 Jan 2025")
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system") and prompt.endswith("assistant<|end_header_id|>\n\n")
    ids = tok.encode(prompt)
    assert ids[0] == bos and ids.count(eot) == 2 and tok.decode(ids) == prompt.replace("<|begin_of_text|>", "") \
        .replace("<|start_header_id|>", "").replace("<|end_header_id|>", "").replace("<|eot_id|>", "")


# ---- synthetic SentencePiece ("llama") vocabulary ----------------------------------------------------
SPM_PIECES = ["▁", "e", "t", "h", "a", "o", "l", "r", "s", "n", "i", "d", "w", "c", "f", "u", ".", ",", "!", "1", "2", "T", "H",
              "é", "▁t", "he", "▁the", "▁a", "ll", "ell", "▁h", "▁hell", "▁hello", "or", "▁w", "▁wor", "ld", "▁world", "in",
              "▁in", "an", "▁an", "nd", "▁and", "er", "re", "▁re", "on", "st", "▁s", "is", "▁is", "es", "at", "▁T", "▁The",
              "▁H", "▁Hello", "▁c", "ca", "▁ca", "▁caf", "▁café", "12", "▁1", "▁12", "..", "▁▁", "▁▁▁▁", "ello", "lo"]


def _synthetic_spm(add_prefix=True):
    # as in a trained SentencePiece model, every character of a piece is a piece itself
    assert all(c in SPM_PIECES for p in SPM_PIECES for c in p)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["[INST]", "[/INST]"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3, 3]
    # scores: longer pieces better, all distinct (a strict order leaves no ties to break)
    scores = [0.0] * 259 + [float(len(p)) * 10 - 0.01 * i for i, p in enumerate(SPM_PIECES)] + [0.0, 0.0]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": add_prefix,
            "tokenizer.chat_template": MISTRAL_TEMPLATE}
    return meta, tokens, scores, types


def _ref_spm(text, tokens, scores, types, add_prefix):
    """Reference SentencePiece-BPE (as llama.cpp runs it): per text fragment, ' ' -> '▁' with a leading
    '▁' at the start and after special tokens; repeatedly join the adjacent pair whose concatenation is the
    best-scored piece (leftmost on ties); pieces not in the vocabulary become byte tokens."""
    ids = {t: i for i, t in enumerate(tokens)}
    specials = [t for t, ty in zip(tokens, types) if ty in (2, 3)]
    out, prev_special = [], True
    for is_special, frag in _split_specials(text, specials):
        if is_special:
            out.append(ids[frag])
            prev_special = True
            continue
        s = ((" " if add_prefix and prev_special else "") + frag).replace(" ", "▁")
        prev_special = False
        syms = list(s)
        while True:
            best = None
            for i in range(len(syms) - 1):
                j = ids.get(syms[i] + syms[i + 1])
                if j is not None and types[j] == 1 and (best is None or scores[j] > best[0]):
                    best = (scores[j], i)
            if best is None:
                break
            i = best[1]
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        for sym in syms:
            if sym in ids and types[ids[sym]] == 1:
                out.append(ids[sym])
            else:
                out += [ids[f"<0x{b:02X}>"] for b in sym.encode()]
    return out


SPM_TEXTS = ["Hello world", "hello hello", "The theory", "  two  spaces ", "café 12 1.2..", "日本 é ü", "", " ", "a\nb",
             "[INST] hi [/INST]", "<s>Hello</s>", "the<s>the", "Hhe!!ll,o"]


@pytest.mark.parametrize("add_prefix", [True, False])
def test_synthetic_spm_matches_reference(add_prefix):
    meta, tokens, scores, types = _synthetic_spm(add_prefix)
    tok = Tokenizer.from_gguf_metadata(meta)
    rng, seed = _seeded_rng()
    pool_specials = ["<s>", "</s>", "[INST]", "[/INST]"]
    for text in SPM_TEXTS + _random_texts(rng, 80, pool_specials):
        ref = _ref_spm(text, tokens, scores, types, add_prefix)
        assert tok.encode(text) == ref, f"seed={seed} add_prefix={add_prefix} text={text!r}"
        if not any(s in text for s in pool_specials):
            assert tok.decode(tok.encode(text)) == text, f"seed={seed} text={text!r}"
    assert tok.add_bos and tok.encode("hi", add_special_tokens=True)[0] == 1  # SentencePiece default: BOS
    assert tok.stop_ids == {2}


def test_synthetic_spm_matches_transformers_converter():
    from transformers.integrations.ggml import convert_gguf_tokenizer
    meta, tokens, scores, types = _synthetic_spm(True)
    ref, _ = convert_gguf_tokenizer("llama", {"tokens": tokens, "scores": scores, "token_type": types,
                                              "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0})
    tok = Tokenizer.from_gguf_metadata(meta)
    rng, seed = _seeded_rng()
    for text in SPM_TEXTS + _random_texts(rng, 40):
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, f"seed={seed} text={text!r}"


def test_gguf_errors():
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})
    with pytest.raises(NotImplementedError, match="not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    meta, *_ = _synthetic_byte_level("gpt-2")
    with pytest.raises(ValueError, match="merges"):
        Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.merges": ["nospace"]}))
    with pytest.warns(RuntimeWarning, match="not known"):
        Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.pre": "made-up"}))


# ---- Hugging Face folders ----------------------------------------------------------------------------
def test_hf_folder_llama3_style(tmp_path):
    """tokenizer.json whose post-processor adds BOS, end-of-turn tokens, template in chat_template.jinja,
    EOS list in generation_config.json."""
    meta, tokens, _ = _synthetic_byte_level("llama-bpe")
    gg = Tokenizer.from_gguf_metadata(meta)
    from tokenizers import Tokenizer as HFTokenizer, processors
    hf = HFTokenizer.from_str(gg._tok.to_str())
    bos, eot, eos = (tokens.index(t) for t in ("<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"))
    hf.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    (tmp_path / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, eot]}))
    t = Tokenizer.from_hf_folder(str(tmp_path))
    assert {eos, eot} <= t.stop_ids and t.eos_id == eot and t.bos_id == bos
    assert t.add_bos and t.encode("hi there") == gg.encode("hi there")  # post-processor adds nothing to encode()
    assert t.encode("hi", add_special_tokens=True) == [bos] + gg.encode("hi")
    assert t.chat_template == LLAMA3_TEMPLATE

    # add_bos_token in the config wins; template list in tokenizer_config; tokens from special_tokens_map.json
    os.remove(tmp_path / "chat_template.jinja")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<|begin_of_text|>"},
                                                                   "eos_token": "<|end_of_text|>"}))
    t = Tokenizer.from_hf_folder(str(tmp_path))
    assert not t.add_bos and t.chat_template == "D" and t.bos_id == bos and t.eos_id == eos
    assert {eos, eot} <= t.stop_ids

    # chat_template.json
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert Tokenizer.from_hf_folder(str(tmp_path)).chat_template == "J"

    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(str(tmp_path / "nowhere"))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Tokenizer.from_hf_folder(str(tmp_path))
