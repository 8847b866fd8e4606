"""RestoreKVPress (arXiv 2608.01247; csrc/press/restorekv.c over train/rows_grad.c): the restore rows' K/V against a
float64 NumPy forward with the LoRA merged by hand (W + scale B A), the whole press against kvpress 0.5.5's
RestoreKVPress with an adapter written by PEFT itself (restore K/V, kept context rows per (layer, KV head), greedy
ids with the question at the positions after the restore rows, as kvpress's pipeline puts it), the pipeline's
positions, run_many's shared prefill, the files (BF16, rslora) and their errors."""
import json
import os
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

import kvpress_c
from kvpress_c.presses.restorekv import hf_to_adjacent
from restorekv_files import write_restorekv, write_with_peft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")
from kvpress.presses import kvzip_press  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from test_kvpress_parity import RATIOS, hf_default, prompt_ids  # noqa: E402,F401
from test_kvzip_parity import hf_tokenizer_default  # noqa: E402,F401

N_NEW = 10
VARIANTS = {"RestoreKV": {}, "RestoreKV-layerwise": {"layerwise": True}, "RestoreKV+": {"kvzip_plus_normalization": True}}
# restore rows' K/V, max |diff| / max |ref|: fp32 against kvpress's fp32 (measured 2.1e-6 .. 2.9e-6 tiny, 8.9e-6 on the
# default model) and against float64 (2.2e-7 .. 9.6e-7)
KV_RTOL = 1e-4


def run_kvpress(hf, tok, press, adapter, ctx_ids, q_ids, n_new=N_NEW):
    """kvpress's RestoreKV on the context, then the question and greedy decoding at the positions kvpress's pipeline
    gives them (context_length = the cache's length, restore rows included). The question goes in one token at a
    time: kvpress's masking searches one fake key per KV head for all the queries of a call, which a tiny model's
    head dim cannot always give for many queries (the same attention as one call). -> (kept [L][Hkv], restore
    K/V [L] of [Hkv, n, d] each, greedy ids)."""
    press.restore_model_name = f"higokri/RestoreKV-{hf.config.name_or_path.split('/')[-1]}" + (
        "_plus" if press.kvzip_plus_normalization else "")
    press.restore_embeddings = load_file(os.path.join(adapter, "restore_embeddings.safetensors"))["restore_embeddings"]
    if press.adapter_name not in getattr(hf, "peft_config", {}):
        hf.load_adapter(adapter, adapter_name=press.adapter_name)
    hf.disable_adapters()
    n, n_r = len(ctx_ids), press.num_restore_tokens
    cache = transformers.DynamicCache()
    with torch.no_grad(), mock.patch.object(kvzip_press, "AutoTokenizer",
                                            SimpleNamespace(from_pretrained=lambda *a, **k: tok)):
        with press(hf):
            hf.model(input_ids=torch.tensor([ctx_ids]), past_key_values=cache)
        pos = cache.get_seq_length()
        assert pos == n + n_r
        restore = [(cache.layers[l].keys[0, :, n:].double().numpy(), cache.layers[l].values[0, :, n:].double().numpy())
                   for l in range(len(hf.model.layers))]
        for t in q_ids:
            out = hf(torch.tensor([[t]]), past_key_values=cache, position_ids=torch.tensor([[pos]]))
            pos += 1
        gen = []
        for _ in range(n_new):
            gen.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[gen[-1]]]), past_key_values=cache, position_ids=torch.tensor([[pos]]))
            pos += 1
    kept = []
    for layer in hf.model.layers:
        _, heads, seq = layer.self_attn.masked_key_indices
        masked = [set() for _ in range(hf.config.num_key_value_heads)]
        for h, r in zip(heads.tolist(), seq.tolist()):
            masked[h].add(r)
        kept.append([set(range(n)) - m for m in masked])
        layer.self_attn.masked_key_indices = None
    return kept, restore, gen


def run_ours(model, press, ctx_ids, q_ids, n_new=N_NEW):
    s = model.new_session()
    press.prefill(s, np.asarray(ctx_ids, np.int32), model.config)
    n, n_r = len(ctx_ids), press.num_restore_tokens
    assert s.position == n + n_r  # the question continues after the restore rows
    c = model.config
    # a GGUF llama's keys pair RoPE dimensions adjacently: its key dims in Hugging Face's order to compare
    to_hf = np.argsort(hf_to_adjacent(c["head_dim"], c["head_dim"])) if c["rope_pairing"] == "adjacent" else slice(None)
    kept, restore = [], []
    for l in range(c["n_layers"]):
        kept.append([])
        ks, vs = [], []
        for h in range(c["n_kv_heads"]):
            pos = s.cache_positions(l, h)
            assert (pos[-n_r:] == np.arange(n, n + n_r)).all()  # the restore rows are never evicted
            kept[-1].append(set(pos[:-n_r].tolist()))
            k, v = s.cache_rows(l, h)
            ks.append(k[-n_r:][:, to_hf])
            vs.append(v[-n_r:])
        restore.append((np.array(ks, np.float64), np.array(vs, np.float64)))
    logits = s.forward(np.asarray(q_ids, np.int32), logits="last")
    gen = []
    for _ in range(n_new):
        gen.append(int(np.argmax(logits)))
        logits = s.forward(np.array([gen[-1]], np.int32))
    return kept, restore, gen


def parity(name, hf, tok, model, adapter, ctx_ids, q_ids, ratio, label=""):
    kw = dict(VARIANTS[name], compression_ratio=ratio)
    theirs, their_kv, their_ids = run_kvpress(hf, tok, kvpress.RestoreKVPress(**kw), adapter, ctx_ids, q_ids)
    ours, our_kv, our_ids = run_ours(model, kvpress_c.RestoreKVPress(**kw, adapter_path=adapter), ctx_ids, q_ids)
    kv_err = max(np.abs(a - b).max() / np.abs(b).max() for x, y in zip(our_kv, their_kv) for a, b in zip(x, y))
    jac = [len(a & b) / len(a | b) for la, lb in zip(ours, theirs) for a, b in zip(la, lb)]
    total = (sum(len(a) for la in ours for a in la), sum(len(b) for lb in theirs for b in lb))
    print(f"{label}{name} @ {ratio}: restore K/V rel err {kv_err:.1e}, mean Jaccard {np.mean(jac):.4f} (min "
          f"{min(jac):.4f}), kept {total[0]} vs {total[1]}, greedy ids equal: {our_ids == their_ids}")
    assert kv_err < KV_RTOL
    assert total[0] == total[1]
    assert np.mean(jac) >= 0.99, jac
    assert our_ids == their_ids, f"{name}: greedy ids differ: ours {our_ids} vs kvpress {their_ids}"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(tmp_path_factory, request):
    from hf_models import write_tiny_model
    from np_llama import NpLlama
    root = tmp_path_factory.mktemp("restorekv")
    path = write_tiny_model(str(root / "tiny"), arch=request.param, seed=11)
    model = kvpress_c.load_model(path)
    adapter = str(root / "adapter")
    write_restorekv(adapter, model.config, np.random.default_rng(3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    rng = np.random.default_rng(11)
    ctx, q = rng.integers(3, hf.config.vocab_size, 200).tolist(), rng.integers(3, hf.config.vocab_size, 6).tolist()
    return dict(hf=hf, tok=transformers.AutoTokenizer.from_pretrained(path), model=model, ref=NpLlama(path), path=path,
                root=root, adapter=adapter, ctx=ctx, q=q)


@pytest.fixture(scope="module")
def peft_adapters(tiny):
    """Adapters written by PEFT itself (kvpress loads them through PEFT): RestoreKV's and RestoreKV+'s."""
    pytest.importorskip("peft")
    return {plus: write_with_peft(str(tiny["root"] / f"peft{'_plus' if plus else ''}"), tiny["path"], seed=3 + plus)
            for plus in (False, True)}


# the KVzip+ variant loads a second adapter (kvpress's "restorekv_plus") next to the first: PEFT warns, as it would there
@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute")
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiny_model_restorekv_matches_kvpress(name, ratio, tiny, peft_adapters):
    t = tiny
    adapter = peft_adapters[VARIANTS[name].get("kvzip_plus_normalization", False)]
    parity(name, t["hf"], t["tok"], t["model"], adapter, t["ctx"], t["q"], ratio, label=f"{t['model'].config['arch']} ")


@pytest.fixture(scope="module")
def default_adapter(tmp_path_factory, default_model):
    """An adapter for the default model in PEFT's format, with Hugging Face's (half-split) q/k row order."""
    path = str(tmp_path_factory.mktemp("restorekv_default"))
    write_restorekv(path, default_model.config, np.random.default_rng(5), std=0.05)
    return path


@pytest.mark.parametrize("ratio", RATIOS)
def test_default_model_restorekv_matches_kvpress(ratio, hf_default, hf_tokenizer_default, default_model, prompt_ids,
                                                 default_adapter):
    """The GGUF's llama q/k rows pair RoPE dimensions adjacently: lora_B's q/k rows are permuted on load. (Files
    written by hand in PEFT's format, loaded by kvpress through PEFT.)"""
    pytest.importorskip("peft")
    q_ids = default_model.encode("What is the magic number?")
    parity("RestoreKV", hf_default, hf_tokenizer_default, default_model, default_adapter, list(prompt_ids), q_ids, ratio,
           label="default ")


def np_restore_rows(ref, ctx_ids, files):
    """The restore rows' K/V per layer [Hkv, n, d] from the float64 model with W + scale B A."""
    cache = ref.empty_cache()
    ref.forward(ref.embed(ctx_ids), np.arange(len(ctx_ids)), cache)
    mods = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    lora = {f"model.layers.{l}.{mods[m]}.{m}.weight": files["scale"] * b @ a for (l, m), (a, b) in files["lora"].items()}
    n, n_r = len(ctx_ids), len(files["emb"])
    ref.forward(np.asarray(files["emb"], np.float64), n + np.arange(n_r), cache, lora=lora)
    return [(np.array([cache[l][h]["k"][n:] for h in range(ref.Hkv)]), np.array([cache[l][h]["v"][n:] for h in range(ref.Hkv)]))
            for l in range(ref.L)]


@pytest.mark.parametrize("variant", ["all, F32", "q+v, rslora, BF16", "mlp only, layers 1-2"])
def test_restore_rows_match_float64_merged_lora(tiny, rng, tmp_path, variant):
    t, cfg = tiny, tiny["model"].config
    kw = {"all, F32": {}, "q+v, rslora, BF16": dict(targets=("q_proj", "v_proj"), rslora=True, dtype="BF16", r=3),
          "mlp only, layers 1-2": dict(targets=("gate_proj", "up_proj", "down_proj"), layers=[1, 2])}[variant]
    files = write_restorekv(str(tmp_path), cfg, rng, n_restore=int(rng.integers(1, 9)), **kw)
    ctx = rng.integers(3, cfg["vocab"], int(rng.integers(20, 80))).tolist()
    press = kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=str(tmp_path))
    s = t["model"].new_session()
    s.forward(np.asarray(ctx, np.int32), logits="none")
    emb, lora = press.restore_inputs(s.model)
    s.append_embeddings(emb, lora=lora)
    n_r = len(files["emb"])
    assert s.position == len(ctx) + n_r and (s.cache_lengths() == len(ctx) + n_r).all()
    ref = np_restore_rows(t["ref"], ctx, files)
    err = 0.0
    for l in range(cfg["n_layers"]):
        for h in range(cfg["n_kv_heads"]):
            k, v = s.cache_rows(l, h)
            err = max(err, np.abs(k[len(ctx):] - ref[l][0][h]).max() / np.abs(ref[l][0][h]).max(),
                      np.abs(v[len(ctx):] - ref[l][1][h]).max() / np.abs(ref[l][1][h]).max())
            np.testing.assert_array_equal(s.cache_positions(l, h)[len(ctx):], len(ctx) + np.arange(n_r))
    print(f"{cfg['arch']} {variant}: restore K/V vs float64 merged LoRA: {err:.2e}")
    assert err < KV_RTOL
    # without the adapter the rows differ (the adapter was active), and the model is untouched afterwards
    s2 = t["model"].new_session()
    s2.forward(np.asarray(ctx, np.int32), logits="none")
    s2.append_embeddings(emb)
    assert not np.allclose(s2.cache_rows(cfg["n_layers"] - 1, 0)[0][len(ctx):], s.cache_rows(cfg["n_layers"] - 1, 0)[0][len(ctx):])
    s3 = t["model"].new_session()
    s3.forward(np.asarray(ctx, np.int32), logits="none")
    s3.append_embeddings(emb)
    np.testing.assert_array_equal(s3.cache_rows(0, 0)[0], s2.cache_rows(0, 0)[0])


def test_pipeline_positions_and_shared_prefill(tiny):
    """The pipeline's question starts after the restore rows; run_many shares the prefill and gives the same result."""
    t = tiny
    pipe = kvpress_c.Pipeline(t["model"])
    context, question = "the quick brown fox jumps over the lazy dog " * 6, "what jumps?"
    press = kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=t["adapter"])
    one = pipe(context, question, press=press, max_new_tokens=6)
    n = one.stats["prompt_tokens"]
    for row in one.kept_indices:
        for pos in row:
            np.testing.assert_array_equal(pos[-8:], n + np.arange(8))
    # the same by hand: prefill, compress, the question at n + 8 on
    ctx_ids, q_ids = pipe.split_prompt(context, question)
    s = t["model"].new_session()
    press.prefill(s, np.asarray(ctx_ids, np.int32), t["model"].config)
    assert s.position == len(ctx_ids) + 8
    out = kvpress_c.model.greedy_many([s], [s.forward(np.asarray(q_ids, np.int32), logits="last")], 6,
                                      set(t["model"].tokenizer.stop_ids))[0]
    assert t["model"].decode(out) == one.answer
    many = pipe.run_many(context, question, presses=[None, press, kvpress_c.KVzipPress(0.5)], max_new_tokens=6)
    assert many[1].stats["shared_prefill"] and many[1].answers == one.answers
    for a, b in zip(many[1].kept_indices, one.kept_indices):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    # ratio 0: kvpress runs nothing (no restore rows either)
    none = pipe(context, question, press=kvpress_c.RestoreKVPress(adapter_path=t["adapter"]), max_new_tokens=6)
    assert none.answers == many[0].answers and none.stats["kept_tokens_total"] == many[0].stats["kept_tokens_total"]


def test_bad_files(tiny, tmp_path, rng):
    t, cfg = tiny, tiny["model"].config
    with pytest.raises(ValueError, match="adapter_path"):
        kvpress_c.RestoreKVPress(compression_ratio=0.5)
    with pytest.raises(FileNotFoundError, match="restore_embeddings.safetensors"):
        kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=str(tmp_path / "none"))

    def folder(name, **kw):
        p = str(tmp_path / name)
        write_restorekv(p, kw.pop("cfg", cfg), np.random.default_rng(0), **kw)
        return p

    def edit_config(p, **changes):
        with open(os.path.join(p, "adapter_config.json")) as f:
            c = json.load(f)
        c.update(changes)
        with open(os.path.join(p, "adapter_config.json"), "w") as f:
            json.dump(c, f)
        return p

    for key, value in (("use_dora", True), ("lora_bias", True), ("rank_pattern", {"q_proj": 8}), ("peft_type", "IA3"),
                       ("modules_to_save", ["lm_head"])):
        with pytest.raises(NotImplementedError, match=key if key != "peft_type" else "IA3"):
            kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=edit_config(folder(key), **{key: value}))
    with pytest.raises(ValueError, match="rank 4"):
        kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=edit_config(folder("rank"), r=8))
    p = folder("no_key")
    from restorekv_files import save
    save({"embeddings": np.zeros((8, cfg["hidden"]))}, os.path.join(p, "restore_embeddings.safetensors"))
    with pytest.raises(ValueError, match="no tensor 'restore_embeddings'"):
        kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=p)
    p = folder("unknown")
    from kvpress_c.presses._tensor_files import read_safetensors
    tensors = read_safetensors(os.path.join(p, "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.fc1.lora_A.weight"] = np.zeros((4, 4))
    save(tensors, os.path.join(p, "adapter_model.safetensors"))
    with pytest.raises(NotImplementedError, match="fc1"):
        kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=p)
    del tensors["base_model.model.model.layers.0.mlp.fc1.lora_A.weight"]
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save(tensors, os.path.join(p, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lora_A only"):
        kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=p)
    # files for another model: the mismatch is named when the press meets this model
    other = dict(cfg, hidden=cfg["hidden"] * 2, ffn=cfg["ffn"] * 2)
    s = t["model"].new_session()
    s.forward(np.asarray(t["ctx"], np.int32), logits="none")
    wide = kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=folder("wide", cfg=other))
    with pytest.raises(ValueError, match="hidden size"):
        wide.compress_full_cache(s, np.asarray(t["ctx"], np.int32), cfg)
    deep = kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=folder("deep", layers=[cfg["n_layers"]]))
    with pytest.raises(ValueError, match="layer"):
        deep.compress_full_cache(s, np.asarray(t["ctx"], np.int32), cfg)
    assert s.position == len(t["ctx"]) and (s.cache_lengths() == len(t["ctx"])).all()  # nothing appended
    # the C checks behind them
    with pytest.raises(ValueError, match="shape"):
        s.append_embeddings(np.zeros((2, cfg["hidden"] + 1), np.float32))
    with pytest.raises(ValueError, match="not finite"):
        s.append_embeddings(np.full((2, cfg["hidden"]), np.nan, np.float32))
    with pytest.raises(ValueError, match="maps"):
        s.append_embeddings(np.zeros((2, cfg["hidden"]), np.float32),
                            lora=[(0, 0, np.zeros((2, cfg["hidden"] + 1)), np.zeros((cfg["hidden"], 2)), 1.0)])
    with pytest.raises(ValueError, match="layer"):
        s.append_embeddings(np.zeros((2, cfg["hidden"]), np.float32),
                            lora=[(99, 0, np.zeros((2, cfg["hidden"])), np.zeros((cfg["hidden"], 2)), 1.0)])
    assert s.position == len(t["ctx"]) and (s.cache_lengths() == len(t["ctx"])).all()
    snap = t["model"].new_session()
    snap.set_press(**kvpress_c.SnapKVPress(0.5, window_size=4).c_config())
    snap.forward(np.asarray(t["ctx"], np.int32), logits="none")
    with pytest.raises(ValueError, match="before any eviction"):
        snap.append_embeddings(np.zeros((2, cfg["hidden"]), np.float32))
