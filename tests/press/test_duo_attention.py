"""DuoAttentionPress with pattern files this test writes (the DuoAttention repository's layout: config.json
with sink_size / recent_size, full_attention_heads.tsv [layers, KV heads]): clear errors when they are
missing or do not fit the model, kvpress parity (kvpress's loader is pointed at the same scores; it masks
the streaming heads' middle keys, we evict them: kept sets and greedy continuation must be equal), and
the emulated device against the CPU."""
import json

import numpy as np
import pytest

import kvpress_c
from press_runs import prefill_and_greedy  # noqa: E402

SINK, RECENT = 4, 24


def write_patterns(path, layers, kv_heads, seed):
    rng = np.random.default_rng(seed)
    print(f"pattern seed {seed}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"sink_size": SINK, "recent_size": RECENT}))
    scores = rng.uniform(-0.1, 1.1, (layers, kv_heads))  # clipped to [0, 1] on load, as in kvpress
    np.savetxt(path / "full_attention_heads.tsv", scores, delimiter="\t")
    return np.clip(scores, 0, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import write_tiny_model
    path = write_tiny_model(str(tmp_path_factory.mktemp("duo") / "tiny"), arch="llama", seed=17)
    ids = np.random.default_rng(17).integers(3, 256, 150).tolist()
    return path, kvpress_c.load_model(path), ids


def kept_ours(model, press, ids, n_new=8):
    kept, out, _, s = prefill_and_greedy(model, press, ids, n_new)
    return kept, out, s


def test_missing_or_wrong_pattern_files_are_clear_errors(tmp_path, tiny):
    with pytest.raises(ValueError, match="pattern_path"):
        kvpress_c.DuoAttentionPress(head_compression_ratio=0.5)
    with pytest.raises(FileNotFoundError, match="full_attention_heads.tsv"):
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "config.json").write_text(json.dumps({"sink_size": 4, "recent_size": 8}))
        kvpress_c.DuoAttentionPress(head_compression_ratio=0.5, pattern_path=str(tmp_path / "x"))
    write_patterns(tmp_path / "wrong", 3, 2, seed=1)
    press = kvpress_c.DuoAttentionPress(head_compression_ratio=0.5, pattern_path=str(tmp_path / "wrong"))
    _, model, _ = tiny
    s = model.new_session()
    s.set_press(**press.c_config())
    with pytest.raises(ValueError, match="3 layers x 2 KV heads; this model has 4 x 2"):
        press.before_prefill(s, 10, model.config)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_duo_attention_matches_kvpress(tmp_path, tiny, ratio):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kvpress = pytest.importorskip("kvpress")
    from kvpress.presses import duo_attention_press as duo
    path, model, ids = tiny
    c = model.config
    scores = write_patterns(tmp_path / "patterns", c["n_layers"], c["n_kv_heads"], seed=int(ratio * 100))
    ours, our_ids, s = kept_ours(model, kvpress_c.DuoAttentionPress(ratio, pattern_path=str(tmp_path / "patterns")), ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    saved = duo.DuoAttentionPress.load_attention_pattern
    duo.DuoAttentionPress.load_attention_pattern = staticmethod(lambda m: (SINK, RECENT, scores))
    try:
        press = kvpress.DuoAttentionPress(head_compression_ratio=ratio)
        cache, their_ids = transformers.DynamicCache(), []
        with torch.no_grad(), press(hf):
            res = hf(torch.tensor([ids]), past_key_values=cache)
            for step in range(8):
                their_ids.append(int(torch.argmax(res.logits[0, -1])))
                p = len(ids) + step
                res = hf(torch.tensor([[their_ids[-1]]]), past_key_values=cache, cache_position=torch.tensor([p]),
                         position_ids=torch.tensor([[p]]))
    finally:
        duo.DuoAttentionPress.load_attention_pattern = saved
    theirs = []
    for layer in hf.model.layers:
        masked = [set() for _ in range(c["n_kv_heads"])]
        if hasattr(layer.self_attn, "masked_key_indices"):
            _, heads, seq = layer.self_attn.masked_key_indices
            for h, r in zip(heads.tolist(), seq.tolist()):
                masked[h].add(r)
        theirs.append([set(range(len(ids))) - m for m in masked])
    assert ours == theirs  # positional: no near-ties, the sets are equal
    n_stream = int(np.asarray([[len(k) < len(ids) for k in row] for row in ours]).sum())
    assert n_stream == round(scores.size * ratio)
    assert our_ids == their_ids, (our_ids, their_ids)  # masked attention == real eviction
    print(f"DuoAttention ratio {ratio}: {n_stream} streaming heads, kept sets equal, greedy equal; cache "
          f"{s.cache_bytes} bytes")


def test_duo_attention_on_the_emulated_device_matches_cpu(tmp_path, tiny):
    path, cpu, ids = tiny
    c = cpu.config
    write_patterns(tmp_path / "p", c["n_layers"], c["n_kv_heads"], seed=3)
    press = kvpress_c.DuoAttentionPress(0.5, pattern_path=str(tmp_path / "p"))
    a = kept_ours(cpu, press, ids)[0]
    b = kept_ours(kvpress_c.load_model(path, device="emulated"), press, ids)[0]
    assert a == b
