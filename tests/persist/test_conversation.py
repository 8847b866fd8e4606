"""Conversations over a compressed cache (kvpress_c/conversation.py) and the press scope under them
(csrc/engine/press_scope.c): a press scoped to a call compresses that call's rows only and leaves the rows
held before bit for bit; scoped to the cache it compresses every row again; a refused call is rolled back;
each turn extends the cache by the template's new text; the presses that run their own prefill (TAKE, KVzip,
KVgrad) compress each turn as their documented calls on a session do by hand; save/reload between turns answers
as going on."""
import numpy as np
import pytest

import kvpress_c


def _sess(model, ids, press, scope="cache"):
    s = model.new_session(0)
    s.set_press_scope(scope)
    s.set_press(**press.c_config())
    s.forward(np.asarray(ids, dtype=np.int32), logits="last")
    s.set_press(None)
    return s


def _heads(s, L, Hkv):
    return [[(s.cache_positions(l, h), *s.cache_rows(l, h)) for h in range(Hkv)] for l in range(L)]


def test_scope_call_compresses_only_the_new_rows(default_model, rng):
    m = default_model
    L, Hkv = m.config["n_layers"], m.config["n_kv_heads"]
    first = rng.integers(10, 20000, 90)
    second = rng.integers(10, 20000, 60)
    press = kvpress_c.StreamingLLMPress(compression_ratio=0.5, n_sink=4)
    s = _sess(m, first, press, "call")
    before = _heads(s, L, Hkv)
    s.set_press(**press.c_config())
    s.forward(np.asarray(second, dtype=np.int32), logits="last")
    s.set_press(None)
    alone = _sess(m, second, press)  # what the press keeps of 60 rows (positions 0..59 there, 90..149 here)
    for l in range(L):
        for h in range(Hkv):
            p0, k0, v0 = before[l][h]
            pos = s.cache_positions(l, h)
            k, v = s.cache_rows(l, h)
            n0 = len(p0)
            assert np.array_equal(pos[:n0], p0) and np.array_equal(k[:n0], k0) and np.array_equal(v[:n0], v0)
            assert np.array_equal(pos[n0:], alone.cache_positions(l, h) + 90), (l, h)
    assert s.position == 150


def test_scope_cache_compresses_every_row_again(default_model, rng):
    m = default_model
    press = kvpress_c.StreamingLLMPress(compression_ratio=0.5, n_sink=4)
    s = _sess(m, rng.integers(10, 20000, 90), press, "cache")
    held = int(s.cache_lengths()[0, 0])  # 45
    s.set_press(**press.c_config())
    s.forward(rng.integers(10, 20000, 60).astype(np.int32), logits="last")
    want = kvpress_c._core.press_kept(held + 60, 0, m.config["n_layers"], **press.c_config())
    pos = s.cache_positions(0, 0)
    assert len(pos) == want
    assert list(pos[:4]) == [0, 1, 2, 3] and pos[-1] == 149 and np.all(np.diff(pos[4:]) == 1)


def test_scope_call_refusal_is_rolled_back(default_model, rng):
    m = default_model
    press = kvpress_c.SnapKVPress(compression_ratio=0.5, window_size=16)
    s = _sess(m, rng.integers(10, 20000, 80), press, "call")
    lens, pos = s.cache_lengths().copy(), s.position
    s.set_press(**press.c_config())
    with pytest.raises(ValueError, match="the prompt \\(5 tokens\\) must be longer than the press window \\(16\\)"):
        s.forward(rng.integers(10, 20000, 5).astype(np.int32), logits="last")
    assert np.array_equal(s.cache_lengths(), lens) and s.position == pos
    s.set_press(None)
    s.forward(rng.integers(10, 20000, 5).astype(np.int32), logits="last")  # usable: no reset needed
    assert s.position == pos + 5


def test_uncompressed_conversation_is_the_template_turn_by_turn(default_model):
    m = default_model
    conv = kvpress_c.Conversation(m, max_new_tokens=12)
    a1 = conv("Name a colour.")
    assert a1 == m.generate("Name a colour.", max_new_tokens=12)  # the first turn is a chat prompt
    conv("And another one?")
    text = m.decode(conv._ids + conv._pending, skip_special_tokens=False)
    assert text == conv._rendered  # the cache holds the template's text, turn after turn
    assert conv.session.position == len(conv._ids)
    assert [r["role"] for r in conv.messages] == ["user", "assistant", "user", "assistant"]


OWN_PREFILL = {  # presses that run their own prefill, and what each turn compresses
    "take_new": (lambda: kvpress_c.TAKEPress(budget=16, chunk_size=24), "new"),
    "take_all": (lambda: kvpress_c.TAKEPress(budget=16, chunk_size=24), "all"),
    "kvzip_new": (lambda: kvpress_c.KVzipPress(compression_ratio=0.5, chunk_size=40), "new"),
    "kvzip_all": (lambda: kvpress_c.KVzipPress(compression_ratio=0.3, chunk_size=40, layerwise=True), "all"),
    "kvgrad_new": (lambda: kvpress_c.KVgradPress(compression_ratio=0.5, chunk_size=40), "new"),
}
TURNS = ("My name is Ann. I keep bees in a garden in Oslo and I have a cat named Tom.",
         "Tell me again, please: what is the name of my cat, and what do I keep in my garden?",
         "And in which city is my garden, and what is my own name?")


def _turn_by_hand(m, s, press, ids, first, scope):
    """One turn's compression by the press's documented calls on a session: TAKE's chunked prefill with the turn's
    last tokens as probes (the press scope says which rows it scores); KVzip/KVgrad's forward, the reconstruction
    of the text being compressed (the turn's, or the whole conversation's) chunk by chunk, and the eviction of the
    rows held at those positions."""
    from kvpress_c.presses.kvzip import FIRST_PROMPT, NEXT_PROMPT
    new = np.asarray(ids[first:], dtype=np.int32)
    if isinstance(press, kvpress_c.TAKEPress):
        n = len(new)
        return s.prefill_take(new, new[-32:], press.budget, chunk_size=press.chunk_size, kernel=7, alpha=0.2,
                              warmup_budget=min(n, max(4 * press.budget, n // 12)), warmup_layers=-1, delayed=True)
    logits = s.forward(new, logits="last")
    lo = first if scope == "call" else 0
    tok = m.tokenizer
    prefix, suffix = press.template_parts(tok)
    c = m.config
    scores = np.zeros((c["n_layers"], c["n_kv_heads"], len(ids) - lo), dtype=np.float32)
    for start in range(max(lo, len(prefix)), len(ids), press.chunk_size):
        end = min(start + press.chunk_size, len(ids))
        ask = tok.encode(FIRST_PROMPT) if start == len(prefix) else tok.encode(NEXT_PROMPT) + list(ids[start - 8:start])
        rep = np.asarray(ask + suffix + list(ids[start:end]), dtype=np.int32)
        score = s.kvgrad_score if isinstance(press, kvpress_c.KVgradPress) else s.kvzip_score
        scores[:, :, start - lo:end - lo] = score(rep, start, end, n_sink=4)
    s.kvzip_evict(scores, press.compression_ratio, layerwise=press.layerwise, n_sink=4, first=lo)
    return logits


@pytest.mark.parametrize("case", list(OWN_PREFILL))
def test_own_prefill_turns_equal_the_calls_by_hand(default_model, case):
    """Three turns of a Conversation against the same token ids run by hand on a session (the press's calls, then
    greedy decoding): the same answers, the same cache bit for bit; after each turn's compression the cache's
    bytes are exactly its rows' (the evicted rows' memory is gone)."""
    from kvpress_c.model import greedy_many
    m = default_model
    make, mode = OWN_PREFILL[case]
    conv = kvpress_c.Conversation(m, press=make(), compress=mode, max_new_tokens=6)
    turns = []  # (every id the turn's prefill follows, the turn's ids, the answer's tokens)
    for text in TURNS:
        held = list(conv._ids)
        conv(text)
        k = conv.last_turn["prompt_tokens"]
        turns.append((held, conv._ids[len(held):len(held) + k], conv._ids[len(held) + k:] + conv._pending))
        assert conv.last_turn["compressed"], conv.last_turn["why"]
    c, press, scope = m.config, make(), "call" if mode == "new" else "cache"
    row_bytes = 2 * c["head_dim"] * 4 + 8  # K and V in f32, the position
    s = m.new_session(0)
    s.set_press_scope(scope)
    for held, ids, answer in turns:
        rows = int(s.cache_lengths().sum())
        logits = _turn_by_hand(m, s, press, held + ids, len(held), scope)
        kept = int(s.cache_lengths().sum())
        evicted = rows + len(ids) * c["n_layers"] * c["n_kv_heads"] - kept
        assert evicted > 0 and s.cache_bytes == kept * row_bytes, (evicted, s.cache_bytes, kept)
        out = greedy_many([s], [logits], 6, set(m.tokenizer.stop_ids))[0]
        assert out == answer
    assert s.position == conv.session.position and s.cache_bytes == conv.session.cache_bytes
    L, Hkv = c["n_layers"], c["n_kv_heads"]
    for x, y in zip(sum(_heads(s, L, Hkv), []), sum(_heads(conv.session, L, Hkv), [])):
        assert all(np.array_equal(u, w) for u, w in zip(x, y))
    if mode == "all" and case.startswith("take"):
        assert (s.cache_lengths() <= 16 + 6).all()  # the budget holds the whole cache (and the last answer's rows)


@pytest.mark.parametrize("case", ["snapkv_new", "snapkv_all_budget", "think_all", "decoding", "adakv_new",
                                  "take_new", "take_all", "kvzip_new", "kvzip_all"])
def test_save_between_turns_goes_on_as_before(default_model, tmp_path, case):
    m = default_model
    K = kvpress_c
    press, mode = {
        "snapkv_new": (K.SnapKVPress(compression_ratio=0.5, window_size=8), "new"),
        "snapkv_all_budget": (K.SnapKVPress(budget=64, window_size=8), "all"),
        "think_all": (K.ThinKPress(key_channel_compression_ratio=0.25, window_size=8), "all"),
        "decoding": (K.DecodingPress(base_press=K.KnormPress(), compression_interval=6, target_size=48), "new"),
        "adakv_new": (K.AdaKVPress(K.SnapKVPress(compression_ratio=0.5, window_size=8)), "new"),
        **{k: (make(), mode) for k, (make, mode) in OWN_PREFILL.items()},
    }[case]
    conv = K.Conversation(m, press=press, compress=mode, max_new_tokens=16)
    conv("My name is Ann. I keep bees in a garden in Oslo and I have a cat named Tom.")
    rows1 = conv.last_turn["cache_rows"]
    conv.save(tmp_path / "c.kvc")
    again = K.Conversation.load(m, tmp_path / "c.kvc", press=press)
    assert again.messages == conv.messages and again.session.position == conv.session.position
    q = "Tell me again: what is the name of my cat, and where is my garden?"
    a, b = conv(q), again(q)
    timing = ("prefill_s", "decode_s", "cache_bytes")  # bytes: the arenas' spare room differs, not the rows
    assert a == b and {k: v for k, v in conv.last_turn.items() if k not in timing} == \
        {k: v for k, v in again.last_turn.items() if k not in timing}
    L, Hkv = m.config["n_layers"], m.config["n_kv_heads"]
    ca, cb = m.new_session(0), m.new_session(0)  # copies: arenas sized to the rows held
    ca.copy_cache_from(conv.session)
    cb.copy_cache_from(again.session)
    assert ca.cache_bytes == cb.cache_bytes
    for x, y in zip(sum(_heads(ca, L, Hkv), []), sum(_heads(cb, L, Hkv), [])):
        assert all(np.array_equal(u, w) for u, w in zip(x, y))
    nxt = np.asarray(m.encode(" Thanks!", add_bos=False), dtype=np.int32)
    assert np.array_equal(ca.forward(nxt, logits="all"), cb.forward(nxt, logits="all"))  # bit-equal logits
    if case == "snapkv_all_budget":
        assert conv.last_turn["cache_rows"] <= rows1 + 16 * 3 * m.config["n_layers"]
    if case == "snapkv_new":
        assert conv.last_turn["compressed"] and rows1 < conv.last_turn["cache_rows"]


def test_refusals(default_model, tmp_path):
    m = default_model
    with pytest.raises(ValueError, match="compress must be 'new'"):
        kvpress_c.Conversation(m, compress="some")
    with pytest.raises(NotImplementedError, match="runs its own prefill"):
        kvpress_c.Conversation(m, press=kvpress_c.KVComposePress(compression_ratio=0.5))
    from restorekv_files import write_restorekv
    write_restorekv(str(tmp_path / "rkv"), m.config, np.random.default_rng(0))
    with pytest.raises(NotImplementedError, match="restore rows"):
        kvpress_c.Conversation(m, press=kvpress_c.RestoreKVPress(compression_ratio=0.5, adapter_path=str(tmp_path / "rkv")))
    s = m.new_session(0)
    s.forward(np.arange(10, 30, dtype=np.int32), logits="last")
    s.save(str(tmp_path / "p.kvc"))
    with pytest.raises(ValueError, match="holds neither a conversation"):
        kvpress_c.Conversation.load(m, tmp_path / "p.kvc")
    conv = kvpress_c.Conversation(m, press=kvpress_c.ThinKPress(key_channel_compression_ratio=0.25, window_size=8),
                                  compress="new", max_new_tokens=4)
    conv("My name is Ann. I keep bees in a garden in Oslo and I have a cat named Tom.")
    with pytest.raises(NotImplementedError, match="one channel set"):
        conv("And what else do you know about my garden in the north?")


def test_conversation_from_a_compressed_context(default_model, tmp_path):
    """A context compressed alone (Pipeline.compress, query-agnostic) and saved: a conversation's first message is
    its question, answered as the pipeline answers that question from the same file."""
    m = default_model
    pipe = kvpress_c.Pipeline(m)
    ctx = "Ann keeps bees in Oslo. Her cat is called Tom. Bob plays the violin in Rome. " * 4
    pipe.compress(ctx, press=kvpress_c.SnapKVPress(compression_ratio=0.5)).save_cache(tmp_path / "ctx.kvc")
    q = "What is the cat called?"
    want = pipe(question=q, cache=tmp_path / "ctx.kvc", max_new_tokens=10).answer
    conv = kvpress_c.Conversation.load(m, tmp_path / "ctx.kvc", max_new_tokens=10)
    assert conv(q) == want
    assert conv.messages[0]["content"] == ctx + q
    conv("And who plays the violin?")  # the next turn extends the same cache
    assert conv.session.position == len(conv._ids)
