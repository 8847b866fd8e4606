"""The presses with hub files through the Pipeline: one run_many (a shared prefill, each press compressing its own
copy of every layer's K/V; Fast KVzip scores every layer, then evicts over all of them, in its own session) gives
each press the answers and kept rows of its own run, also wrapped (Ada-KV, CriticalKV and LU-KV around
ExpectedAttentionStatsPress: the wrapped press's statistics reach the engine)."""
import numpy as np

import kvpress_c as K
from hub_files import random_curve, random_gates, random_stats, write_gates, write_stats


def test_run_many_equals_separate_runs(tmp_path, rng):
    from hf_models import write_tiny_model
    model = K.load_model(write_tiny_model(str(tmp_path / "tiny"), arch="llama", seed=47))
    c = model.config
    stats = write_stats(tmp_path / "s", *random_stats(rng, c["n_layers"], c["n_heads"], c["head_dim"]))
    np.save(tmp_path / "c.npy", random_curve(rng, c["n_layers"], c["n_kv_heads"]))
    gates = write_gates(tmp_path / "g_sink16.npz", random_gates(rng, c["n_layers"], c["n_kv_heads"], c["hidden"], 2))
    presses = [None,
               K.ExpectedAttentionStatsPress(compression_ratio=0.5, stats_folder=stats),
               K.AdaKVPress(K.ExpectedAttentionStatsPress(compression_ratio=0.6, stats_folder=stats)),
               K.CriticalKVPress(K.ExpectedAttentionStatsPress(compression_ratio=0.6, stats_folder=stats, use_vnorm=False)),
               K.LUKVPress(compression_ratio=0.6, curve_path=str(tmp_path / "c.npy")),
               K.LUKVPress(K.ExpectedAttentionStatsPress(stats_folder=stats), compression_ratio=0.7,
                           curve_path=str(tmp_path / "c.npy")),
               K.FastKVzipPress(compression_ratio=0.5, gates_path=gates),
               K.FastKVzipPress(compression_ratio=0.8, layerwise=True, gates_path=gates),
               K.SnapKVPress(compression_ratio=0.5, window_size=16)]
    context = "".join(chr(int(x)) for x in rng.integers(97, 123, 240))  # the byte tokenizer: one token a letter
    question = " what comes next?"
    pipe = K.Pipeline(model)
    many = pipe.run_many(context, question, presses=presses, max_new_tokens=8, chat=False)
    for press, res in zip(presses, many):
        alone = pipe.run_many(context, question, presses=[press], max_new_tokens=8, chat=False)[0]
        assert res.stats["shared_prefill"], type(press).__name__
        assert alone.answers == res.answers, type(press).__name__
        for a, b in zip(alone.kept_indices, res.kept_indices):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    kept = [r.stats["kept_tokens"] for r in many]
    assert kept[0] == many[0].stats["prompt_tokens"] and all(k < kept[0] for k in kept[1:])
    # the statistics changed the scores: EAStats keeps other rows than ExpectedAttention on the prompt's own queries
    own = pipe.run_many(context, question, presses=[K.ExpectedAttentionPress(compression_ratio=0.5)], chat=False)[0]
    assert any((a != b).any() for la, lb in zip(own.kept_indices, many[1].kept_indices) for a, b in zip(la, lb))
