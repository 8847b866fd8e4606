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


@pytest.mark.slow  # every press through run_many and again alone on the default model: left out of make test-fast
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


def test_decoding_press_with_given_statistics_through_the_pipeline(default_model, prompt, tmp_path):
    """DecodingPress(ExpectedAttentionStatsPress): the Pipeline hands each session the statistics (before_decoding),
    alone and in run_many; they change what is kept against ExpectedAttention's own buffered queries."""
    from hub_files import random_stats, write_stats
    context, question = prompt
    c = default_model.config
    folder = write_stats(tmp_path / "stats", *random_stats(np.random.default_rng(3), c["n_layers"], c["n_heads"],
                                                           c["head_dim"]))
    calls = []

    class Spy(K.DecodingPress):
        def before_decoding(self, session, config):
            calls.append(session)
            super().before_decoding(session, config)

    kw = dict(compression_interval=6, target_size=120)
    given = Spy(K.ExpectedAttentionStatsPress(stats_folder=folder), **kw)
    own = K.DecodingPress(K.ExpectedAttentionPress(), **kw)
    pipe = K.Pipeline(default_model)
    alone = pipe(context, question, press=given, max_new_tokens=24)
    assert len(calls) == 1
    many = pipe.run_many(context, question, presses=[given, own], max_new_tokens=24)
    assert len(calls) == 2
    assert many[0].answers == alone.answers
    assert many[1].answers == pipe(context, question, press=own, max_new_tokens=24).answers
    # the same session steps with and without the statistics keep different rows
    ids = np.asarray(default_model.encode(context)[:200], np.int32)
    kept = []
    for press in (given, own):
        s = default_model.new_session()
        s.set_decoding_press(**press.decoding_config())
        press.before_decoding(s, c)
        s.forward(ids, logits="last")
        for t in range(12):
            s.forward(np.array([ids[t]], np.int32), logits="last")
        assert s.decoding_compressions > 0
        kept.append([s.cache_positions(l, 0) for l in range(c["n_layers"])])
    assert any(not np.array_equal(a, b) for a, b in zip(*kept))


def test_decoding_expected_attention_needs_more_rows_than_n_sink():
    with pytest.raises(ValueError, match="must exceed n_sink"):
        K.DecodingPress(K.ExpectedAttentionPress(n_sink=4), compression_interval=4)
    with pytest.raises(ValueError, match="must exceed n_sink"):
        K.CompressionRatioDecodingPress(K.ExpectedAttentionPress(), compression_interval=8, hidden_states_buffer_size=2)
    K.DecodingPress(K.ExpectedAttentionPress(n_sink=4), compression_interval=5)
    K.DecodingPress(K.ExpectedAttentionPress(n_sink=0), compression_interval=1, hidden_states_buffer_size=0)
