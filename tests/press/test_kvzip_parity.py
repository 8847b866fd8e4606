"""KVzipPress side by side with kvpress 0.5.5's (test_kvpress_parity.py's harness, models and tolerances).

kvpress's KVzipPress runs its reconstruction forwards when its context manager exits and masks the evicted
rows (module.masked_key_indices, fake keys at decode), so the decode runs after the `with` block. It reads
its tokenizer with AutoTokenizer.from_pretrained(model.config.name_or_path); the test hands it the HF
tokenizer of the same model instead (the GGUF's, or the tiny model's tokenizer.json). Both sides' chunked
reconstruction prompts are asserted equal token for token, then the scores (before kvpress sets its sinks
to max + 1), the kept sets (every difference a near-tie of kvpress's global cut), the greedy ids and logits.
"""
import os
import time
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")
from kvpress.presses import kvzip_press  # noqa: E402

import kvpress_c  # noqa: E402
from test_kvpress_parity import (LOGITS_RTOL, N_NEW, RATIOS, SCORE_RTOL, TIE_TOL,  # noqa: E402
                                 hf_default, prompt_ids)

VARIANTS = {"KVzip": {}, "KVzip-layerwise": {"layerwise": True}, "KVzip+": {"kvzip_plus_normalization": True},
            # 128: several chunks (a later chunk's prompt carries the previous chunk's last 8 tokens)
            "KVzip-chunked": {"chunk_size": 128}}


def run_kvpress(hf, tok, press, ids, n_new=N_NEW):
    """kvpress's prefill + reconstruction + masking; (kept [L][Hkv] sets, scores float64 [L, Hkv, n],
    reconstruction ids per chunk, greedy ids, logits per step)."""
    got = {}
    orig_prepare, orig_post = press.prepare, press.compress_post

    def prepare(*a, **k):
        got["chunks"] = [r[0].tolist() for _, r in orig_prepare(*a, **k)]
        return orig_prepare(*a, **k)

    def compress_post(model):
        got["scores"] = press.score_val[:, 0].double().numpy().copy()  # before the sinks get max + 1
        return orig_post(model)

    press.prepare, press.compress_post = prepare, compress_post
    n = len(ids)
    cache = transformers.DynamicCache()
    with torch.no_grad(), mock.patch.object(kvzip_press, "AutoTokenizer",
                                            SimpleNamespace(from_pretrained=lambda *a, **k: tok)):
        with press(hf):
            res = hf(torch.tensor([ids]), past_key_values=cache)
        logits, out_ids = [], []
        for step in range(n_new):  # the first logits are the prefill's (before any compression, as ours)
            logits.append(res.logits[0, -1].double().numpy())
            out_ids.append(int(np.argmax(logits[-1])))
            if step == n_new - 1:
                break
            pos = n + step
            res = hf(torch.tensor([[out_ids[-1]]]), past_key_values=cache, cache_position=torch.tensor([pos]),
                     position_ids=torch.tensor([[pos]]))
    kept = []
    for layer in hf.model.layers:
        _, heads, seq = layer.self_attn.masked_key_indices
        masked = [set() for _ in range(hf.config.num_key_value_heads)]
        for h, r in zip(heads.tolist(), seq.tolist()):
            masked[h].add(r)
        kept.append([set(range(n)) - m for m in masked])
        layer.self_attn.masked_key_indices = None  # not left for the next test's model use
    return kept, got["scores"], got["chunks"], out_ids, logits


def run_ours(model, press, ids, n_new=N_NEW):
    s = model.new_session()
    arr = np.asarray(ids, dtype=np.int32)
    logits = [s.forward(arr, logits="last").astype(np.float64)]
    scores = press.scores(s, arr).astype(np.float64)
    s.kvzip_evict(scores.astype(np.float32), press.compression_ratio, layerwise=press.layerwise, n_sink=press.n_sink)
    c = model.config
    kept = [[set(s.cache_positions(l, h).tolist()) for h in range(c["n_kv_heads"])] for l in range(c["n_layers"])]
    out = []
    for step in range(n_new):
        out.append(int(np.argmax(logits[-1])))
        if step == n_new - 1:
            break
        logits.append(s.forward(np.array([out[-1]], dtype=np.int32)).astype(np.float64))
    chunks = [r.tolist() for _, _, r in press.chunks(model.tokenizer, ids)]
    return kept, scores, chunks, out, logits


def cut_values(scores, ratio, layerwise, n_sink):
    """kvpress's cut(s) of its ranking: the values around the int(numel ratio) lowest (per layer when layerwise)."""
    s = scores.copy()
    s[..., :n_sink] = s.max() + 1
    parts = [s[l].ravel() for l in range(len(s))] if layerwise else [s.ravel()]
    cuts = []
    for p in parts:
        k = int(p.size * ratio)
        srt = np.sort(p)
        cuts.append(srt[max(0, k - 1):k + 1])
    return [cuts[l] if layerwise else cuts[0] for l in range(len(s))]


def parity(name, hf, tok, model, ids, ratio, variants=VARIANTS, cls="KVzipPress", score_rtol=SCORE_RTOL):
    """kvpress's press `cls` against ours of the same name (KVzipPress, or a press built on it: KVgradPress)."""
    kw = dict(variants[name], compression_ratio=ratio)
    t0 = time.perf_counter()
    theirs, their_scores, their_chunks, their_ids, their_logits = run_kvpress(hf, tok, getattr(kvpress, cls)(**kw), ids)
    t1 = time.perf_counter()
    press = getattr(kvpress_c, cls)(**kw)
    ours, our_scores, our_chunks, our_ids, our_logits = run_ours(model, press, ids)
    t2 = time.perf_counter()
    assert our_chunks == their_chunks, f"{name}: reconstruction prompts differ"
    assert len(our_chunks) > 1 if "chunk_size" in kw else len(our_chunks) == 1
    score_err = np.abs(our_scores - their_scores).max() / np.abs(their_scores).max()
    assert score_err < score_rtol, f"{name}: scores differ from kvpress's by {score_err:.3g} (relative)"
    cuts = cut_values(their_scores, ratio, press.layerwise, press.n_sink)
    tol = TIE_TOL * np.abs(their_scores).max()
    jac, exact = [], 0
    for l, (a_l, b_l) in enumerate(zip(ours, theirs)):
        for h, (a, b) in enumerate(zip(a_l, b_l)):
            jac.append(len(a & b) / len(a | b))
            exact += a == b
            for r in a ^ b:
                gap = np.abs(cuts[l] - their_scores[l, h, r]).min()
                assert gap <= tol, f"{name} layer {l} head {h}: position {r} differs ({gap:.3g} from the cut): not a near-tie"
    assert sum(len(a) for a_l in ours for a in a_l) == sum(len(b) for b_l in theirs for b in b_l)
    mean = float(np.mean(jac))
    err = max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(our_logits, their_logits))
    print(f"{name} @ {ratio}: scores rel err {score_err:.1e}, mean Jaccard {mean:.4f}, exact heads {exact}/{len(jac)}, "
          f"greedy ids equal: {our_ids == their_ids}, max logit rel err {err:.1e} (kvpress {t1 - t0:.1f}s, "
          f"ours {t2 - t1:.1f}s)")
    if exact == len(jac):
        assert err < LOGITS_RTOL, f"{name}: decode logits differ ({err:.3g})"
    assert mean >= 0.99, f"{name}: mean Jaccard {mean:.4f}"
    assert our_ids == their_ids, f"{name}: greedy continuation differs: ours {our_ids} vs kvpress {their_ids}"


@pytest.fixture(scope="module")
def hf_tokenizer_default(default_gguf):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_gguf),
                                                      gguf_file=os.path.basename(default_gguf))


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_default_model_kvzip_matches_kvpress(name, ratio, hf_default, hf_tokenizer_default, default_model, prompt_ids):
    parity(name, hf_default, hf_tokenizer_default, default_model, prompt_ids, ratio)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(tmp_path_factory, request):
    from hf_models import write_tiny_model
    path = write_tiny_model(str(tmp_path_factory.mktemp("kvzip") / "tiny"), arch=request.param, seed=11)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = np.random.default_rng(11).integers(3, hf.config.vocab_size, 200).tolist()
    return hf, transformers.AutoTokenizer.from_pretrained(path), kvpress_c.load_model(path), ids


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiny_model_kvzip_matches_kvpress(name, ratio, tiny):
    hf, tok, model, ids = tiny
    parity(name, hf, tok, model, ids, ratio)
