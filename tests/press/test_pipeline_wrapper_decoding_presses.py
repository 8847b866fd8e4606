"""The wrapper, ThinK, DuoAttention and decoding presses through the Pipeline: one run_many (shared prefill, batched decode) gives every
press the same answers and kept rows as its own run, and the decoding presses keep compressing while the
answers are generated (several questions each start from the compressed context)."""
import json

import numpy as np
import pytest

import kvpress_c as K


@pytest.fixture(scope="module")
def prompt(default_model):
    from kvpress_c.demo import needle_prompt
    context, question, _ = needle_prompt(default_model, n_tokens=250)
    return context, question


def presses(tmp_path):
    c = K.load_model().config
    (tmp_path / "duo").mkdir(exist_ok=True)
    (tmp_path / "duo" / "config.json").write_text(json.dumps({"sink_size": 4, "recent_size": 32}))
    np.savetxt(tmp_path / "duo" / "full_attention_heads.tsv",
               np.random.default_rng(0).uniform(0, 1, (c["n_layers"], c["n_kv_heads"])), delimiter="\t")
    return [None,
            K.ComposedPress([K.SnapKVPress(compression_ratio=0.3, window_size=16), K.KnormPress(compression_ratio=0.3)]),
            K.PerLayerCompressionPress(K.SnapKVPress(window_size=16), compression_ratios=[0.5] * 15 + [0.7] * 15),
            K.BlockPress(K.KnormPress(compression_ratio=0.5), block_size=64),
            K.KeyRerotationPress(K.SnapKVPress(compression_ratio=0.5, window_size=16)),
            K.ComposedPress([K.SnapKVPress(compression_ratio=0.5, window_size=16), K.ThinKPress(0.5, window_size=16)]),
            K.DuoAttentionPress(0.5, pattern_path=str(tmp_path / "duo")),
            K.PrefillDecodingPress(K.SnapKVPress(compression_ratio=0.5, window_size=16),
                                   K.DecodingPress(K.KnormPress(), compression_interval=8, target_size=100))]


def test_run_many_equals_separate_runs(default_model, prompt, tmp_path):
    context, question = prompt
    pipe = K.Pipeline(default_model)
    ps = presses(tmp_path)
    many = pipe.run_many(context, question, presses=ps, max_new_tokens=24)
    for press, res in zip(ps, many):
        alone = pipe(context, question, press=press, max_new_tokens=24)
        assert alone.answers == res.answers, type(press).__name__
        for a, b in zip(alone.kept_indices, res.kept_indices):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    kept = [r.stats["kept_tokens"] for r in many]
    assert kept[0] == many[0].stats["prompt_tokens"] and all(k < kept[0] for k in kept[1:6])


def test_decoding_press_through_several_questions(default_model, prompt):
    """Each question starts from the compressed context, not from what the previous answer left."""
    context, question = prompt
    qs = [question, "Summarize the text."]
    press = K.DecodingPress(K.KnormPress(), compression_interval=4, target_size=120)
    pipe = K.Pipeline(default_model)
    both = pipe(context, questions=qs, press=press, max_new_tokens=30)
    alone = [pipe(context, q, press=press, max_new_tokens=30).answers[0] for q in qs]
    assert both.answers == alone
