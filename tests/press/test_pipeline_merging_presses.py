"""The value-merging and threshold presses (MergingPress, CAMPress, CapPress, DMSPress, KVComposePress) through the Pipeline: one run_many
(shared prefill, batched decode) gives every press the same answers and kept rows as its own run."""
import numpy as np
import pytest

import kvpress_c as K


@pytest.mark.slow  # every press through run_many and again alone on the default model: left out of make test-fast
def test_run_many_equals_separate_runs(default_model):
    from kvpress_c.demo import needle_prompt
    context, question, _ = needle_prompt(default_model, n_tokens=250)
    ps = [None,
          K.MergingPress(K.SnapKVPress(compression_ratio=0.5, window_size=16)),
          K.CAMPress(K.KnormPress(), compression_interval=8, target_size=100, merge_budget=8),
          K.CapPress(compression_ratio=0.7),
          K.DMSPress(K.KnormPress(), threshold=-9.0, sliding_window_size=32),
          K.DMSPress(K.KnormPress(), threshold=-9.0, sliding_window_size=32, decoding=True),
          K.KVComposePress(compression_ratio=0.6), K.KVComposePress(structured=False, compression_ratio=0.6)]
    pipe = K.Pipeline(default_model)
    many = pipe.run_many(context, question, presses=ps, max_new_tokens=24)
    for press, res in zip(ps, many):
        alone = pipe(context, question, press=press, max_new_tokens=24)
        assert alone.answers == res.answers, type(press).__name__
        for a, b in zip(alone.kept_indices, res.kept_indices):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    kept = [r.stats["kept_tokens"] for r in many]
    assert kept[0] == many[0].stats["prompt_tokens"]
    assert kept[1] < kept[0] and kept[3] < kept[0] and kept[4] < kept[0] and kept[6] < kept[0], kept
    assert ps[4].compression_ratio > 0
