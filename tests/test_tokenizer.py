"""Tokenizer built from the GGUF vocabulary against Hugging Face transformers' tokenizer for the same
file; chat templates against transformers' apply_chat_template; kvpress's context/question split."""
import os

import pytest

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world", "Hello 12345 world", "  leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\n\n",
    "Unicode: café, naïve, Ωmega, 日本語, emoji 😀🚀", "def f(x):\n    return x ** 2  # square", "<|im_start|>user\nhi<|im_end|>",
    "numbers 3.14159 and 1,000,000 and -42", "The quick brown fox jumps over the lazy dog. " * 20, "MiXeD CaSe WoRdS",
    "punctuation!!! ??? ... ;;; ---", "a" * 300, "https://example.com/path?q=1&r=2", "don't won't I'm you're they've",
    "", " ", "\n", "中文和English混合", "<|endoftext|> after eos", "Ĳ ĳ ǅ ǆ",
]


@pytest.fixture(scope="module")
def hf_tok(default_gguf):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf))


def test_encode_matches_transformers(default_model, hf_tok):
    ours = default_model.tokenizer
    for text in TEXTS:
        assert ours.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"], repr(text)


def test_decode_round_trip(default_model):
    tok = default_model.tokenizer
    for text in TEXTS:
        if "<|" in text:
            continue
        assert tok.decode(tok.encode(text)) == text, repr(text)


def test_special_and_stop_tokens(default_model):
    tok = default_model.tokenizer
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert {0, 2} <= set(tok.stop_ids)
    assert not tok.add_bos


def test_chat_template_matches_transformers(default_model, hf_tok):
    convs = [[{"role": "user", "content": "Hi!"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]]
    for conv in convs:
        ours = default_model.apply_chat_template(conv)
        ref = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert ours == ref


def test_kvpress_split(default_model):
    from kvpress_c.chat import split_context_question
    tok = default_model.tokenizer
    ctx, suffix = split_context_question(tok.chat_template, "CONTEXT")
    full = default_model.apply_chat_template("CONTEXT" + "QUESTION")
    assert ctx + "QUESTION" + suffix == full
    assert split_context_question(None, "C", bos_token="<s>") == ("<s>C", "\n")


def test_hf_folder_tokenizer_and_llama3_stops(tmp_path, default_model):
    """A folder tokenizer with Llama-3-style end tokens: both are stop ids."""
    import json
    from tokenizers import Tokenizer as HFTokenizer
    from kvpress_c.tokenizer import Tokenizer
    hf = HFTokenizer.from_str(default_model.tokenizer._tok.to_str())  # a copy: the fixture is shared
    hf.add_special_tokens(["<|eot_id|>", "<|end_of_text|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    eot, eos = hf.token_to_id("<|eot_id|>"), hf.token_to_id("<|end_of_text|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|end_of_text|>",
                                                                "chat_template": "{{ messages[0]['content'] }}"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, eot]}))
    t = Tokenizer.from_hf_folder(str(tmp_path))
    assert {eos, eot} <= set(t.stop_ids)
    assert t.chat_template == "{{ messages[0]['content'] }}"
