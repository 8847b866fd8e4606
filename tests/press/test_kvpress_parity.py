"""Side by side with NVIDIA kvpress 0.5.5 (PyTorch, HF transformers, CPU fp32) on the same model and the
same token ids: the kept index sets per layer and KV head, the greedy continuation and the decode logits.

kvpress runs through its own hook mechanics (`with press(model): model(ids, past_key_values=cache)`).
Its kept positions are read from what it really left behind: the compressed cache rows are matched to
the rows of an uncompressed prefill (the prefill itself is not changed by the press, so the keys are
identical), and for AdaKVPress, which masks instead of evicting, from `module.masked_key_indices`.
Ours come from a session with the press attached (`session.cache_positions(layer, head)`).

Where the sets differ, every differing position must be a near-tie in kvpress's own scores (within
TIE_TOL of a cut of its ranking): the two implementations compute the same function in a different
order (GGUF adjacent vs HF half RoPE pairing, another GEMM), so scores agree to ~1e-6, not bitwise.

kvpress's AdaKV masks the evicted keys (fake keys with exp(q k) = 0) and decodes over the full cache;
we evict for real and decode over a ragged cache: equal logits = "ragged decode equals the masked
reference". Models: (a) the default GGUF, loaded by transformers too; (b) a tiny random HF llama.
"""
import contextlib
import os
import time
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

import kvpress_c  # noqa: E402
from press_reference import adakv_protect  # noqa: E402
from hub_files import match_rows  # noqa: E402  (also imported from here by the other parity tests)

RATIOS = [0.5, 0.9]  # 0.9: the regime of evaluations (budget 128 of a few thousand tokens)
N_NEW = 12          # greedy tokens compared
LOGITS_RTOL = 1e-3  # max |ours - theirs| / max |theirs| per decode step
TIE_TOL = 1e-5      # near-tie: |score - cut| <= TIE_TOL x the largest unprotected score of the layer
SCORE_RTOL = 1e-4   # our scores vs kvpress's: max |difference| / largest unprotected score
NAMES = ["SnapKV", "PyramidKV", "StreamingLLM", "Knorm", "TOVA", "ObservedAttention", "AdaKV",
         # issue 16: kvpress's scorers
         "KeyDiff", "LagKV", "LagKV-cross", "ExpectedAttention", "AdaKV-ExpectedAttention", "CriticalKV", "CriticalAdaKV",
         "NonCausalAttn", "LeverageScore", "CUR", "CUR-random", "Compactor",
         # issue 16p
         "Cap"]
# scorers that give protected rows (window, sinks, LagKV's reference partition) the top score
TOP_PROTECTED = ("Cap", "CUR", "CUR-random", "Compactor", "SnapKV", "PyramidKV", "AdaKV", "TOVA", "LagKV", "LagKV-cross", "ExpectedAttention",
                 "AdaKV-ExpectedAttention", "CriticalKV")
# kvpress's CriticalAdaKVPress transforms its inner press's scores inside compress(): what we capture of it is the
# inner press's plain scores, which are neither our recorded scores (the two-stage ones, compared by "CriticalKV")
# nor the ranking it cuts; for it the kept sets, Jaccard and greedy ids are compared, not the scores or the ties.
PLAIN_SCORES_ONLY = ("CriticalAdaKV",)
# LagKV's scores are ranks inside each partition (k / lag_size): every value repeats once per partition and the
# sinks and reference rows all score 1, so the cut usually falls inside a group of exactly equal scores. kvpress
# then keeps what torch.topk's unspecified tie order gives (at 0.9 on the tiny model it drops its own sinks);
# ours keeps the lower rows. And two continuous partition scores within rounding of each other can swap ranks
# (the continuous scores themselves are compared by "LagKV-cross"). Parity there: ranks equal or one step
# (1 / lag_size) apart, every differing kept row within one step of a cut; Jaccard and greedy ids reported only.
EXACT_TIES = ("LagKV",)
# kvpress computes LeverageScore's sketched Gram matrix, Cholesky and solve in float32, ours in float64: on the default
# model's layer 0 (cond(X^T X) ~ 3e6) kvpress's float32 z-scores differ from the same computation in float64 by 2.2e-3
# of the largest (measured with kvpress's own compute_leverage_scores on the same keys and sketch; other layers
# <= 3e-4). There the score tolerance and the near-tie tolerance are that rounding of kvpress's, not ours.
FP32_SCORE_RTOL = {"LeverageScore": 5e-3, "Compactor": 5e-3}
LAG = 32


def make_press(lib, name, window, ratio):
    p = lib
    RATIO = ratio
    snap = dict(compression_ratio=RATIO, window_size=window)
    return {"SnapKV": lambda: p.SnapKVPress(**snap), "PyramidKV": lambda: p.PyramidKVPress(**snap),
            "StreamingLLM": lambda: p.StreamingLLMPress(compression_ratio=RATIO),
            "Knorm": lambda: p.KnormPress(compression_ratio=RATIO), "TOVA": lambda: p.TOVAPress(compression_ratio=RATIO),
            "ObservedAttention": lambda: p.ObservedAttentionPress(compression_ratio=RATIO),
            "AdaKV": lambda: p.AdaKVPress(p.SnapKVPress(**snap)),
            "KeyDiff": lambda: p.KeyDiffPress(compression_ratio=RATIO),
            "LagKV": lambda: p.LagKVPress(compression_ratio=RATIO, lag_size=LAG),
            # lag 8: the sinks + the reference rows (<= 4 + 15) fit the budget at 0.9, the cut falls in continuous scores
            "LagKV-cross": lambda: p.LagKVPress(compression_ratio=RATIO, lag_size=8, cross_scoring=True),
            "ExpectedAttention": lambda: p.ExpectedAttentionPress(compression_ratio=RATIO),
            "AdaKV-ExpectedAttention": lambda: p.AdaKVPress(p.ExpectedAttentionPress(compression_ratio=RATIO)),
            # 64: several chunks, the last one padded (200 and ~370 tokens)
            "NonCausalAttn": lambda: p.NonCausalAttnPress(compression_ratio=RATIO, chunk_size=64),
            "CriticalKV": lambda: p.CriticalKVPress(p.ExpectedAttentionPress(compression_ratio=RATIO, use_vnorm=False)),
            "CriticalAdaKV": lambda: p.CriticalAdaKVPress(p.ExpectedAttentionPress(compression_ratio=RATIO,
                                                                                 use_vnorm=False)),
            "ChunkKV": lambda: p.ChunkKVPress(p.SnapKVPress(**snap), chunk_length=20),
            # ours draws its sketch from `seed`; kvpress's torch.randn is handed the same (same_sketch)
            "LeverageScore": lambda: p.LeverageScorePress(compression_ratio=RATIO,
                                                          **({"seed": SKETCH_SEED} if p is kvpress_c else {})),
            "CUR": lambda: p.CURPress(compression_ratio=RATIO),
            "Cap": lambda: p.CapPress(compression_ratio=RATIO),
            # 64: several non-causal chunks over the rows between the sinks
            "Compactor": lambda: p.CompactorPress(compression_ratio=RATIO, chunk_size=64,
                                                  **({"seed": SKETCH_SEED} if p is kvpress_c else {})),
            "CUR-random": lambda: p.CURPress(compression_ratio=RATIO, use_random_leverage=True,
                                             **({"seed": SKETCH_SEED} if p is kvpress_c else {}))}[name]()


SKETCH_SEED = 1234


@contextlib.contextmanager
def same_sketch(name, seed=SKETCH_SEED):
    """LeverageScore (CURPress(use_random_leverage=True): torch.randn(d, 20)) draws a Gaussian sketch per layer
    with torch.randn(1, Hkv, d, k) (kvpress) or from `seed`
    with the generator of docs/METHODS.md (ours). For parity torch.randn is replaced, while kvpress runs, by a
    function returning our sketch of the next layer (the calls come in layer order, one per layer; the shape
    is asserted); kvpress then scales it by 1/sqrt(k) as it scales its own."""
    if name not in ("LeverageScore", "CUR-random", "Compactor"):
        yield
        return
    from kvpress_scorers_reference import gaussian_sketch
    layer = [0]

    def randn(*shape, device=None, dtype=None):
        assert shape[0] == 1 if len(shape) == 4 else len(shape) == 2, f"unexpected torch.randn{shape} inside kvpress"
        z = gaussian_sketch(seed, layer[0], int(np.prod(shape))).reshape(shape)
        layer[0] += 1
        return torch.from_numpy(z).to(dtype=dtype or torch.float32)

    with mock.patch.object(torch, "randn", randn):
        yield
    assert layer[0] > 0, "kvpress drew no sketch"


# -- kvpress side --------------------------------------------------------------------------------------

def run_kvpress(hf, press, ids, full_keys, n_new=N_NEW):
    """kvpress prefill with `press` on `ids`; returns (kept [L][Hkv] sets, scores [L] float64 [Hkv, n],
    greedy ids, logits per step (prefill's last, then each decode step))."""
    L, n = hf.config.num_hidden_layers, len(ids)
    # CriticalKVPress's own score() is the two-stage one; the other wrappers score with their inner press
    inner = press if isinstance(press, kvpress.CriticalKVPress) else getattr(press, "press", press)
    scores = [None] * L
    orig = inner.score

    def score(module, *args, **kw):
        s = orig(module, *args, **kw)
        scores[module.layer_idx] = s[0].detach().double().numpy().copy()  # before AdaKV's in-place scatter
        return s

    inner.score = score
    cache = transformers.DynamicCache()
    logits, out_ids = [], []
    try:
        with torch.no_grad(), press(hf):
            res = hf(torch.tensor([ids]), past_key_values=cache)
            for step in range(n_new):
                logits.append(res.logits[0, -1].double().numpy())
                nxt = int(np.argmax(logits[-1]))
                out_ids.append(nxt)
                if step == n_new - 1:
                    break
                pos = n + step
                res = hf(torch.tensor([[nxt]]), past_key_values=res.past_key_values,
                         cache_position=torch.tensor([pos]), position_ids=torch.tensor([[pos]]))
    finally:
        inner.score = orig
    kept = []
    for l, layer in enumerate(hf.model.layers):
        if isinstance(press, (kvpress.AdaKVPress, kvpress.CriticalAdaKVPress)):
            _, heads, seq = layer.self_attn.masked_key_indices
            masked = [set() for _ in range(full_keys[l].shape[0])]
            for h, r in zip(heads.tolist(), seq.tolist()):
                masked[h].add(r)
            kept.append([set(range(n)) - m for m in masked])
        else:
            comp = cache.layers[l].keys[0, :, :cache.layers[l].keys.shape[2] - (n_new - 1)]
            kept.append(match_rows(comp, full_keys[l]))
    return kept, scores, out_ids, logits


# -- our side ------------------------------------------------------------------------------------------

def run_ours(model, press, ids, n_new=N_NEW):
    """Our prefill with `press`; returns (kept [L][Hkv] sets, scores [L] [Hkv, n], greedy ids, logits)."""
    s = model.new_session()
    s.set_press(record_scores=True, **press.c_config())
    logits = [s.forward(np.array(ids, dtype=np.int32), logits="last").astype(np.float64)]
    c = model.config
    L, Hkv = c["n_layers"], c["n_kv_heads"]
    scores = [np.stack([s.press_scores(l, h) for h in range(Hkv)]).astype(np.float64) for l in range(L)]
    s.set_press(None)
    kept = [[set(s.cache_positions(l, h).tolist()) for h in range(Hkv)] for l in range(L)]
    out = []
    for step in range(n_new):
        out.append(int(np.argmax(logits[-1])))
        if step == n_new - 1:
            break
        logits.append(s.forward(np.array([out[-1]], dtype=np.int32)).astype(np.float64))
    return kept, scores, out, logits


# -- comparison ----------------------------------------------------------------------------------------

def cuts(name, s, n_kept, alpha=0.2):
    """Score values at which kvpress's ranking of one layer is cut, per head."""
    Hkv, n = s.shape
    if name.startswith("AdaKV"):
        n_safe = max(1, int(n_kept * alpha))
        per_head = [np.sort(s[h])[::-1][n_safe - 1:n_safe + 1] for h in range(Hkv)]
        prot = np.zeros_like(s, dtype=bool)
        for h in range(Hkv):
            prot[h, np.argsort(-s[h], kind="stable")[:n_safe]] = True
        rest = np.sort(s[~prot])[::-1]
        k = Hkv * n_kept - prot.sum()
        glob = rest[max(0, k - 1):k + 1]
        return [np.r_[per_head[h], glob] for h in range(Hkv)]
    return [np.sort(s[h])[::-1][n_kept - 1:n_kept + 1] for h in range(Hkv)]


def compare(name, ours, theirs, their_scores, kept_per_layer):
    """Mean Jaccard and exact-head count; asserts every difference is a near-tie of kvpress's scores."""
    jac, exact = [], 0
    for l, (a_l, b_l) in enumerate(zip(ours, theirs)):
        s = their_scores[l]
        if name == "StreamingLLM":
            assert a_l == b_l, f"{name} layer {l}: StreamingLLM has no ties to excuse a difference"
        free = s[s < s.max()] if name in TOP_PROTECTED else s
        tol = 1.0 / LAG if name in EXACT_TIES else np.inf if name in PLAIN_SCORES_ONLY else \
            FP32_SCORE_RTOL.get(name, TIE_TOL) * np.abs(free).max()
        c = cuts(name, s, kept_per_layer[l]) if s is not None else None
        for h, (a, b) in enumerate(zip(a_l, b_l)):
            jac.append(len(a & b) / len(a | b))
            exact += a == b
            for r in a ^ b:
                gap = np.abs(c[h] - s[h, r]).min()
                assert gap <= tol, (f"{name} layer {l} head {h}: position {r} differs (kvpress score {s[h, r]:.6g}, "
                                    f"{gap:.3g} from a cut, tolerance {tol:.3g}): not a near-tie")
    return float(np.mean(jac)), exact, len(jac)


def check_logits(name, ours, theirs):
    errs = [np.abs(a - b).max() / np.abs(b).max() for a, b in zip(ours, theirs)]
    assert max(errs) < LOGITS_RTOL, f"{name}: decode logits differ, relative errors per step {np.round(errs, 6)}"
    return max(errs)


def kept_counts(name, press, hf, n, ratio):
    if name == "PyramidKV":
        return [press.get_layer_budget(layer.self_attn, n) for layer in hf.model.layers]
    from kvpress.utils import compute_n_kept
    return [compute_n_kept(n, ratio)] * hf.config.num_hidden_layers


def parity(name, hf, model, ids, full_keys, window, ratio, ties_expected=False):
    """ties_expected: every differing row is still asserted to be a near-tie, but the Jaccard and greedy
    targets are not held (a model whose scores are near-equal by construction)."""
    theirs_press = make_press(kvpress, name, window, ratio)
    hf.set_attn_implementation("eager" if name == "ObservedAttention" else "sdpa")
    try:
        t0 = time.perf_counter()
        with same_sketch(name):
            theirs, their_scores, their_ids, their_logits = run_kvpress(hf, theirs_press, ids, full_keys)
        t1 = time.perf_counter()
    finally:
        hf.set_attn_implementation("sdpa")
    ours, our_scores, our_ids, our_logits = run_ours(model, make_press(kvpress_c, name, window, ratio), ids)
    t2 = time.perf_counter()
    n_kept = kept_counts(name, theirs_press, hf, len(ids), ratio)
    if name.startswith("AdaKV"):  # our reference of kvpress's AdaKVPress, on kvpress's own scores
        for l in range(len(theirs)):
            want = adakv_protect(their_scores[l], n_kept[l], 0.2)
            assert [set(w.tolist()) for w in want] == theirs[l], f"AdaKV reference != kvpress at layer {l}"
    elif name not in PLAIN_SCORES_ONLY:
        for l in range(len(theirs)):
            assert all(len(b) == n_kept[l] for b in theirs[l])
    score_err = float("nan")
    if name != "StreamingLLM" and name not in PLAIN_SCORES_ONLY:
        score_err = 0.0  # its scores are an encoding of the order on both sides
        for l, (a, b) in enumerate(zip(our_scores, their_scores)):
            free = b < b.max() if name in TOP_PROTECTED else np.ones_like(b, dtype=bool)
            score_err = max(score_err, np.abs(a - b)[free].max() / np.abs(b[free]).max())
        if name in EXACT_TIES:  # ranks: equal or one step apart
            assert score_err <= 1.0 / (LAG - 1) + 1e-9, f"{name}: ranks differ by more than one step ({score_err:.3g})"
        else:
            assert score_err < FP32_SCORE_RTOL.get(name, SCORE_RTOL), f"{name}: scores differ from kvpress's by {score_err:.3g} (relative)"
    mean, exact, total = compare(name, ours, theirs, their_scores, n_kept)
    # the same kept rows must give the same logits; a near-tie resolved the other way keeps another row
    # (legitimately), which moves the decode logits by more than rounding: then only the ids are compared
    err = check_logits(name, our_logits, their_logits) if exact == total else \
        max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(our_logits, their_logits))
    same = our_ids == their_ids
    if name.startswith("AdaKV") or name == "CriticalAdaKV":  # ours really evicted: heads of different lengths, decoded without padding
        assert any(len({len(k) for k in row}) > 1 for row in ours), "Ada-KV should leave ragged heads"
    print(f"{name} @ {ratio}: scores rel err {score_err:.1e}, mean Jaccard {mean:.4f}, exact heads {exact}/{total}, "
          f"greedy ids equal: {same}, max logit rel err {err:.1e} (kvpress {t1 - t0:.1f}s, ours {t2 - t1:.1f}s)")
    if name in EXACT_TIES or ties_expected:
        return
    if exact < total and total - exact <= max(1, total // 8):
        # A cut within fp32 rounding of kvpress's own scores (every differing row asserted a near-tie in compare)
        # goes one way or the other with the machine's float kernels: measured on an AVX2 machine (built-in GEMM
        # and torch's AVX2 kernels), one head of 8 on the tiny models at 0.9 (CUR, LeverageScore), Jaccard
        # 0.9875; an AVX-512 machine kept the same rows as kvpress there. One swapped row then changes a tiny
        # random model's continuation, so the ids are compared only where every head kept kvpress's rows.
        return
    assert mean >= 0.99, f"{name}: mean Jaccard {mean:.4f}"
    assert same, f"{name}: greedy continuation differs: ours {our_ids} vs kvpress {their_ids}"


def full_cache_keys(hf, ids):
    with torch.no_grad():
        cache = transformers.DynamicCache()
        hf(torch.tensor([ids]), past_key_values=cache)
    return [cache.layers[l].keys[0].clone() for l in range(hf.config.num_hidden_layers)]


# -- (a) the default model -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_default(default_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    from kvpress_c.demo import needle_prompt
    context, question, _ = needle_prompt(default_model, n_tokens=350)
    return default_model.encode(default_model.apply_chat_template(context + "\n\n" + question))


@pytest.fixture(scope="module")
def default_full_keys(hf_default, prompt_ids):
    return full_cache_keys(hf_default, prompt_ids)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", NAMES)
def test_default_model_matches_kvpress(name, ratio, hf_default, default_model, prompt_ids, default_full_keys):
    parity(name, hf_default, default_model, prompt_ids, default_full_keys, window=32, ratio=ratio)


@pytest.mark.parametrize("ratio", RATIOS)
def test_chunkkv_matches_kvpress(ratio, hf_default, default_model, prompt_ids, default_full_keys):
    """kvpress ChunkKVPress gathers whole chunks into the cache; their positions come from key matching."""
    press = make_press(kvpress, "ChunkKV", 32, ratio)
    with torch.no_grad(), press(hf_default):
        comp = transformers.DynamicCache()
        hf_default(torch.tensor([prompt_ids]), past_key_values=comp)
    ours = run_ours(default_model, make_press(kvpress_c, "ChunkKV", 32, ratio), prompt_ids, n_new=1)[0]
    jac = []
    for l in range(hf_default.config.num_hidden_layers):
        theirs = match_rows(comp.layers[l].keys[0], default_full_keys[l])
        jac += [len(a & b) / len(a | b) for a, b in zip(ours[l], theirs)]
    print(f"ChunkKV @ {ratio}: mean Jaccard {np.mean(jac):.4f}")
    assert np.mean(jac) >= 0.99


# -- (b) tiny random Hugging Face llama and qwen3 (per-head q/k norms) models ----------------------------

# kvpress 0.5.5's CriticalKVPress reads module.config.head_dim, which Phi3Config lacks: on Phi-3 kvpress raises that
# AttributeError (asserted), and the comparison runs with the attribute set on the config (hidden / heads, the value
# Phi-3's attention uses). The scorers that turn keys or queries on the host (ExpectedAttention's and CAP's future
# positions, LeverageScore's and Compactor's pre-RoPE keys) follow LongRoPE's rule as the forward does: on the
# 200-token prompt, past the original context (64), the long factors and the attention factor.
PHI3_KVPRESS_READS_HEAD_DIM = ("CriticalKV", "CriticalAdaKV")


def phi3_head_dim_for_kvpress(hf, name, ids):
    """kvpress fails on Phi-3 for PHI3_KVPRESS_READS_HEAD_DIM (checked); then the config gets head_dim for it."""
    with pytest.raises(AttributeError, match="head_dim"):
        run_kvpress(hf, make_press(kvpress, name, 16, 0.5), ids, None, n_new=1)
    hf.config.head_dim = hf.config.hidden_size // hf.config.num_attention_heads


@pytest.fixture(scope="module", params=["llama", "qwen3", "phi3"])
def tiny(tmp_path_factory, request):
    from hf_models import write_tiny_model
    from phi3_models import write_tiny_phi3
    folder = str(tmp_path_factory.mktemp("parity") / "tiny")
    # phi3: fused projections and LongRoPE, the 200-token prompt past the original context (64): the long factors.
    # The whole head turns (Phi-3 / Phi-3.5): kvpress 0.5.5's query reconstruction assumes it (a partial rotary
    # factor fails inside kvpress's SnapKV / ExpectedAttention with a shape error)
    path = write_tiny_phi3(folder, seed=11) if request.param == "phi3" else \
        write_tiny_model(folder, arch=request.param, seed=11)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = np.random.default_rng(11).integers(3, hf.config.vocab_size, 200).tolist()
    return hf, kvpress_c.load_model(path), ids, full_cache_keys(hf, ids)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_matches_kvpress(name, ratio, tiny):
    hf, model, ids, keys = tiny
    if model.config["arch"] == "phi3" and name in PHI3_KVPRESS_READS_HEAD_DIM and not hasattr(hf.config, "head_dim"):
        phi3_head_dim_for_kvpress(hf, name, ids)
    # Qwen3's k_norm gives every key head the same RMS (times the norm weights): Knorm's -||k|| scores are
    # near-equal by construction, and at 0.9 the cut falls among near-ties (measured: 7/8 heads exact,
    # mean Jaccard 0.9875, every differing row within TIE_TOL of kvpress's cut)
    ties = name == "Knorm" and model.config["arch"] == "qwen3"
    parity(name, hf, model, ids, keys, window=16, ratio=ratio, ties_expected=ties)
