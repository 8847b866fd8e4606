"""Gemma 3 side by side with kvpress 0.5.5 (PyTorch, transformers, CPU fp32): kvpress compresses Gemma 3 on its
full-attention layers only (Gemma3ForConditionalGeneration: its hooks skip the layers with is_sliding), and
so do we. The tiny random text model the test writes is run by kvpress inside a Gemma3ForConditionalGeneration
holding the same language-model weights (no image: the same logits as Gemma3ForCausalLM, asserted); kept sets
on the full layers are compared as tests/press/test_kvpress_parity.py compares them (every difference a
near-tie of kvpress's scores), and the sliding layers must hold every row on both sides.

The scorer presses, then the allocation presses (AdaKV, PyramidKV, CriticalKV, CriticalAdaKV) and the wrappers
(ComposedPress, PerLayerCompressionPress, BlockPress, ChunkKVPress, ChunkPress, KeyRerotationPress).

Where kvpress 0.5.5 itself fails on transformers 5's Gemma 3 (each asserted, then worked around in the test only):
- the presses that ask the rotary embedding for future positions (ExpectedAttention and what wraps it: AdaKV over
  it, CriticalKV, CriticalAdaKV; CAP) call rotary_emb(x, position_ids) without a layer_type, and Gemma 3's
  rotary embedding then reads `None_inv_freq` (AttributeError). kvpress only presses the full layers, so the test
  passes layer_type="full_attention" for it (`full_layer_rope`).
- KeyRerotationPress reads rotary_emb.inv_freq, which Gemma 3's (one buffer per layer type) lacks
  (AttributeError); the test gives it the full layers' buffer.

(kvpress also runs on Gemma3ForCausalLM, "not tested" by its own list: there it compresses the sliding layers'
truncated caches too (transformers keeps their last window - 1 rows), and SnapKV fails with a shape error.)"""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

import kvpress_c  # noqa: E402
from gemma3_models import PERIOD, write_tiny_gemma3  # noqa: E402
from hub_files import match_rows  # noqa: E402
from press_runs import prefill_and_greedy  # noqa: E402
from test_kvpress_parity import PLAIN_SCORES_ONLY, compare, make_press, run_ours  # noqa: E402
from test_wrapper_parity import KINDS, make as make_wrapper  # noqa: E402

N = 200          # prompt tokens (the window is 16); at 0.9 LagKV's sinks + reference rows (<= 4 + 15) fit the budget
WINDOW = 8       # SnapKV's observation window
N_NEW = 10       # greedy tokens compared for the wrappers
NAMES = ["SnapKV", "StreamingLLM", "Knorm", "TOVA", "ObservedAttention", "KeyDiff", "NonCausalAttn", "ExpectedAttention",
         "CUR", "LagKV-cross"]
ALLOCATION = ["AdaKV", "PyramidKV", "AdaKV-ExpectedAttention", "CriticalKV", "CriticalAdaKV"]
LAYERS = 6       # sliding, sliding, full, sliding, sliding, full: two full layers (PyramidKV's budgets differ there)
FULL = [l for l in range(LAYERS) if (l + 1) % PERIOD == 0]
# kvpress 0.5.5 on transformers 5's Gemma 3: rotary_emb(mu, position_ids) passes no layer_type (full_layer_rope)
NEEDS_FULL_LAYER_ROPE = ("ExpectedAttention", "AdaKV-ExpectedAttention", "CriticalKV", "CriticalAdaKV")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_gemma3(str(tmp_path_factory.mktemp("g3parity") / "tiny"), seed=11, layers=LAYERS)
    text = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = transformers.Gemma3Config(text_config=text.config.to_dict(), mm_tokens_per_image=4,
                                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, image_size=28, patch_size=14))
    mm = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    mm.model.language_model.load_state_dict(text.model.state_dict())
    mm.lm_head.weight = mm.model.language_model.embed_tokens.weight
    ids = np.random.default_rng(11).integers(3, 256, N).tolist()
    with torch.no_grad():
        assert torch.equal(text(torch.tensor([ids])).logits, mm(torch.tensor([ids])).logits)
        cache = transformers.DynamicCache()
        mm(torch.tensor([ids]), past_key_values=cache)
    keys = [cache.layers[l].keys[0].clone() for l in range(LAYERS)]
    return mm, kvpress_c.load_model(path), ids, keys


@contextlib.contextmanager
def full_layer_rope(mm):
    """kvpress's rotary_emb(x, position_ids) without a layer_type, answered for the full layers (the only ones it
    presses on Gemma 3), as transformers answers rotary_emb(x, position_ids, "full_attention")."""
    rotary = mm.model.language_model.rotary_emb
    forward = rotary.forward
    rotary.forward = lambda x, position_ids, layer_type=None: forward(x, position_ids, layer_type or "full_attention")
    try:
        yield
    finally:
        del rotary.forward


def run_kvpress(mm, press, ids, keys):
    """kvpress's prefill with `press`: kept [L][Hkv] sets and its scores of the full layers (CriticalKV's own two-stage
    scores; the inner press's for the other wrappers)."""
    inner = press if isinstance(press, kvpress.CriticalKVPress) else getattr(press, "press", press)
    scores, orig = [None] * LAYERS, inner.score

    def score(module, *args, **kw):
        s = orig(module, *args, **kw)
        scores[module.layer_idx] = s[0].detach().double().numpy().copy()  # before AdaKV's in-place scatter
        return s

    inner.score = score
    cache = transformers.DynamicCache()
    try:
        with torch.no_grad(), press(mm):
            mm(torch.tensor([ids]), past_key_values=cache)
    finally:
        inner.score = orig
    kept = []
    for l, layer in enumerate(mm.model.language_model.layers):
        if isinstance(press, (kvpress.AdaKVPress, kvpress.CriticalAdaKVPress)) and l in FULL:  # masked, not evicted
            _, heads, seq = layer.self_attn.masked_key_indices
            masked = [set() for _ in range(keys[l].shape[0])]
            for h, r in zip(heads.tolist(), seq.tolist()):
                masked[h].add(r)
            kept.append([set(range(N)) - m for m in masked])
        else:
            kept.append(match_rows(cache.layers[l].keys[0], keys[l]))
    return kept, scores


def check_sliding_layers_whole(theirs, ours):
    for l in range(LAYERS):
        if l not in FULL:
            assert all(k == set(range(N)) for k in theirs[l]), f"kvpress compressed sliding layer {l}"
            assert all(k == set(range(N)) for k in ours[l]), f"we compressed sliding layer {l}"


def scorer_parity(name, ratio, tiny):
    mm, model, ids, keys = tiny
    press = make_press(kvpress, name, WINDOW, ratio)
    mm.set_attn_implementation("eager" if name == "ObservedAttention" else "sdpa")
    try:
        if name in NEEDS_FULL_LAYER_ROPE:
            with pytest.raises(AttributeError, match="None_inv_freq"):
                run_kvpress(mm, make_press(kvpress, name, WINDOW, ratio), ids, keys)
            with full_layer_rope(mm):
                theirs, their_scores = run_kvpress(mm, press, ids, keys)
        else:
            theirs, their_scores = run_kvpress(mm, press, ids, keys)
    finally:
        mm.set_attn_implementation("sdpa")
    ours = run_ours(model, make_press(kvpress_c, name, WINDOW, ratio), ids, n_new=1)[0]
    check_sliding_layers_whole(theirs, ours)
    assert all(their_scores[l] is None for l in range(LAYERS) if l not in FULL)
    from kvpress.utils import compute_n_kept
    n_kept = [press.get_layer_budget(mm.model.language_model.layers[l].self_attn, N) if name == "PyramidKV"
              else compute_n_kept(N, ratio) for l in FULL]
    if name not in PLAIN_SCORES_ONLY and not name.startswith("AdaKV"):
        assert all(len(b) == k for l, k in zip(FULL, n_kept) for b in theirs[l])
    mean, exact, total = compare(name, [ours[l] for l in FULL], [theirs[l] for l in FULL],
                                 [their_scores[l] for l in FULL], n_kept)
    print(f"{name} @ {ratio}: full layers {FULL}, mean Jaccard {mean:.4f}, exact heads {exact}/{total}, rows kept per "
          f"head {[len(a) for l in FULL for a in ours[l]]}")
    assert mean >= 0.99


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("name", NAMES)
def test_gemma3_matches_kvpress(name, ratio, tiny):
    scorer_parity(name, ratio, tiny)


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("name", ALLOCATION)
def test_gemma3_allocation_presses_match_kvpress(name, ratio, tiny):
    """PyramidKV's budgets follow the layer's index among all the model's layers (kvpress's get_layer_budget reads
    layer_idx and num_hidden_layers): the full layers 2 and 5 of 6 keep the budgets of those depths."""
    scorer_parity(name, ratio, tiny)


# -- the wrappers: kept sets, and greedy continuations where every head kept kvpress's rows -------------------

WRAPPERS = KINDS + ["chunkkv_snapkv", "chunk_snapkv", "rerotation_snapkv"]


def make(lib, kind, ratio):
    if kind == "chunk_snapkv":  # chunks of 50, window 4: each chunk keeps (5 at 0.9) at least its window's equal top
        # scores (test_chunk_press.py's chunk_for: fewer, and both sides pick among exact ties)
        return lib.ChunkPress(lib.SnapKVPress(compression_ratio=ratio, window_size=4), chunk_length=50)
    return make_wrapper(lib, kind, ratio, LAYERS, WINDOW)


@contextlib.contextmanager
def full_layer_inv_freq(mm):
    """kvpress's KeyRerotationPress reads rotary_emb.inv_freq: Gemma 3's has one buffer per layer type; the full
    layers' is the one of the layers it presses."""
    rotary = mm.model.language_model.rotary_emb
    rotary.inv_freq = rotary.full_attention_inv_freq
    try:
        yield
    finally:
        del rotary.inv_freq


def run_kvpress_greedy(mm, press, ids, keys, kept_from_scores):
    """kvpress's prefill with `press` and N_NEW greedy tokens after it; kept sets from its cache (KeyRerotation's,
    whose keys no longer match the uncompressed ones: from its scores' top-k, what its compress keeps)."""
    from kvpress.utils import compute_n_kept
    chosen = [None] * LAYERS
    if kept_from_scores:
        orig = press.press.score

        def score(module, hidden_states, k, *a, **kw):
            s = orig(module, hidden_states, k, *a, **kw)
            idx = s[0].topk(compute_n_kept(k.shape[2], press.press.compression_ratio), dim=-1).indices
            chosen[module.layer_idx] = [set(r.tolist()) for r in idx]
            return s
        press.press.score = score
    cache, out = transformers.DynamicCache(), []
    with torch.no_grad(), press(mm):
        res = mm(torch.tensor([ids]), past_key_values=cache)
    kept = [chosen[l] if chosen[l] is not None else match_rows(cache.layers[l].keys[0], keys[l]) for l in range(LAYERS)]
    with torch.no_grad():
        for step in range(N_NEW):
            out.append(int(torch.argmax(res.logits[0, -1])))
            p = len(ids) + step
            res = mm(torch.tensor([[out[-1]]]), past_key_values=cache, cache_position=torch.tensor([p]),
                     position_ids=torch.tensor([[p]]))
    return kept, out


@pytest.mark.parametrize("ratio", [0.5, 0.9])
@pytest.mark.parametrize("kind", WRAPPERS)
def test_gemma3_wrappers_match_kvpress(kind, ratio, tiny):
    mm, model, ids, keys = tiny
    rerotation = kind == "rerotation_snapkv"
    if rerotation:
        with pytest.raises(AttributeError, match="inv_freq"):
            run_kvpress_greedy(mm, make(kvpress, kind, ratio), ids, keys, True)
        with full_layer_inv_freq(mm):
            theirs, their_ids = run_kvpress_greedy(mm, make(kvpress, kind, ratio), ids, keys, True)
    else:
        theirs, their_ids = run_kvpress_greedy(mm, make(kvpress, kind, ratio), ids, keys, False)
    ours, our_ids = prefill_and_greedy(model, make(kvpress_c, kind, ratio), ids, N_NEW)[:2]
    check_sliding_layers_whole(theirs, ours)
    assert [len(a) for l in FULL for a in ours[l]] == [len(b) for l in FULL for b in theirs[l]], "kept counts differ"
    jac = [len(a & b) / len(a | b) for l in FULL for a, b in zip(ours[l], theirs[l])]
    if kind.endswith("_knorm"):  # exact ties of equal key norms (repeated tokens): a difference must swap such rows
        for l in FULL:
            for h, (a, b) in enumerate(zip(ours[l], theirs[l])):
                norms = keys[l][h].double().norm(dim=-1).numpy()
                for r in a ^ b:
                    assert min(abs(norms[r] - norms[q]) for q in (b - a if r in a else a - b)) <= 1e-5 * norms.max(), \
                        f"layer {l} head {h}: position {r} differs and has no equal-norm partner"
    print(f"{kind} @ {ratio}: full layers {FULL}, mean Jaccard {np.mean(jac):.4f}, min {np.min(jac):.4f}, "
          f"greedy equal {our_ids == their_ids}")
    assert np.mean(jac) >= 0.99 or kind.endswith("_knorm"), f"mean Jaccard {np.mean(jac):.4f}"
    if min(jac) == 1.0:  # the same kept rows (re-rotated alike): the same continuation
        assert our_ids == their_ids, f"greedy continuation differs: {our_ids} vs {their_ids}"
