"""Phi-3 (fused projections, LongRoPE) side by side with kvpress 0.5.5 (PyTorch, transformers, CPU fp32) for the
allocation and wrapper presses, on the tiny random model of tests/support/phi3_models.py (original context 64).

Where the rest of Phi-3's parity lives: the scorer presses and AdaKV, PyramidKV, CriticalKV, CriticalAdaKV on a
200-token prompt (past the original context: the long factors) in test_kvpress_parity.py (its tiny fixture's
"phi3"); ChunkPress, FinchPress, SimLayerKV and EntropyGatedChunkKV through test_wrapper_parity.py's tiny_archs.
Here: ComposedPress, PerLayerCompressionPress, BlockPress, ChunkKVPress and KeyRerotationPress past the original
context, and the scorers that turn rows on the host on a prompt before it (the call's rows turned with the short
factors, ExpectedAttention's and CAP's 512 future positions past it: the long ones there, as transformers' rotary
embedding gives them to kvpress), and kvpress's own ExpectedAttention run by the engine (from_kvpress)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

import kvpress_c  # noqa: E402
from phi3_models import ORIGINAL_CONTEXT  # noqa: E402
from test_kvpress_parity import (PHI3_KVPRESS_READS_HEAD_DIM, compare, full_cache_keys, kept_counts,  # noqa: E402
                                 make_press, parity as scorer_parity, phi3_head_dim_for_kvpress, run_kvpress)
from test_wrapper_parity import KINDS, parity, rerotation_parity, write_tiny  # noqa: E402

SHORT = 60  # a prompt before the original context (64): every row of the call turned with the short factors


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    hf, model, ids, keys, path = write_tiny(tmp_path_factory, "phi3")
    assert len(ids) > ORIGINAL_CONTEXT and model.config["rope_long_context"] == ORIGINAL_CONTEXT
    return hf, model, ids, keys, path


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("kind", KINDS + ["chunkkv_snapkv"])
def test_phi3_wrappers_match_kvpress(phi3, kind, ratio):
    hf, model, ids, keys, _ = phi3
    parity(hf, model, ids, keys, kind, ratio, window=16)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("base", ["Knorm", "SnapKV"])
def test_phi3_key_rerotation_matches_kvpress(phi3, base, ratio):
    """Kept keys turned by their distance with the frequencies the prefill turned them with (LongRoPE's long ones
    past the original context: kvpress reads rotary_emb.inv_freq, which transformers' longrope update set to them)."""
    hf, model, ids, _, _ = phi3
    rerotation_parity(hf, model, ids, 16, base, ratio)


HOST_ROPE = ["ExpectedAttention", "AdaKV-ExpectedAttention", "Cap", "LeverageScore", "Compactor", "CriticalKV",
             "CriticalAdaKV"]


# 0.5 and 0.75: at 0.9 of 60 tokens the budget (6 rows) lies inside what the presses protect with a top score
# (ExpectedAttention's and Compactor's 4 sinks, CriticalKV's first stage), where exact ties decide on both sides
@pytest.mark.parametrize("ratio", [0.5, 0.75])
@pytest.mark.parametrize("name", HOST_ROPE)
def test_phi3_host_rope_before_the_original_context_matches_kvpress(phi3, name, ratio):
    hf, model, ids, _, _ = phi3
    ids = ids[:SHORT]
    if name in PHI3_KVPRESS_READS_HEAD_DIM and not hasattr(hf.config, "head_dim"):
        phi3_head_dim_for_kvpress(hf, name, ids)
    scorer_parity(name, hf, model, ids, full_cache_keys(hf, ids), window=16, ratio=ratio)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_phi3_from_kvpress_expected_attention_matches_kvpress(phi3, ratio):
    """kvpress's ExpectedAttention run by the engine (from_kvpress) past the original context: the stand-in's rotary
    embedding carries the call's frequencies (the long ones) and the attention factor. (Before the original context
    kvpress's future positions would pass it, long factors there, where the stand-in keeps the call's short ones:
    from_kvpress's docstring says so.)"""
    hf, model, ids, keys, _ = phi3
    theirs_press = make_press(kvpress, "ExpectedAttention", 16, ratio)
    theirs, their_scores, _, _ = run_kvpress(hf, theirs_press, ids, keys, n_new=1)
    s = model.new_session()
    s.set_press(**kvpress_c.from_kvpress(make_press(kvpress, "ExpectedAttention", 16, ratio)).c_config())
    s.forward(np.asarray(ids, np.int32), logits="none")
    c = model.config
    ours = [[set(s.cache_positions(l, h).tolist()) for h in range(c["n_kv_heads"])] for l in range(c["n_layers"])]
    mean, exact, total = compare("ExpectedAttention", ours, theirs, their_scores,
                                 kept_counts("ExpectedAttention", theirs_press, hf, len(ids), ratio))
    print(f"from_kvpress(ExpectedAttention) on Phi-3 @ {ratio}: mean Jaccard {mean:.4f}, exact heads {exact}/{total}")
    assert mean >= 0.99, mean
