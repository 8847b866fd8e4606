"""One prefill, many caches (Session.forward_shared / Pipeline.run_many): each follower's cache, its
kept positions and its decode logits equal a separate compressed prefill with the same press."""
import numpy as np
import pytest

import kvpress_c


def _presses():
    return [
        None,
        kvpress_c.SnapKVPress(budget=48, window_size=16),
        kvpress_c.StreamingLLMPress(compression_ratio=0.5),
        kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(budget=40, window_size=16)),
        kvpress_c.ChunkKVPress(kvpress_c.SnapKVPress(budget=50, window_size=16), chunk_length=5, reuse_layers=2),
        kvpress_c.PyramidKVPress(compression_ratio=0.6, window_size=16),
        kvpress_c.KnormPress(budget=30),
        # issue 16: kvpress's scorers (the positions and W_o a follower reads are the leader's)
        kvpress_c.KeyDiffPress(budget=40),
        kvpress_c.LagKVPress(budget=40, lag_size=16),
        kvpress_c.ExpectedAttentionPress(budget=40),
        kvpress_c.CriticalAdaKVPress(kvpress_c.ExpectedAttentionPress(budget=40, use_vnorm=False)),
        kvpress_c.NonCausalAttnPress(budget=40, chunk_size=64),
        kvpress_c.LeverageScorePress(budget=40, sketch_dimension=16, seed=3),
        kvpress_c.CURPress(budget=40, use_random_leverage=True, seed=3),
        kvpress_c.CompactorPress(budget=40, chunk_size=64, seed=3),
        kvpress_c.TADAPress(kvpress_c.EDIEPress(budget=40, window_size=16)),
        kvpress_c.TAKEPress(budget=40, chunk_size=64),
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import write_tiny_model
    return kvpress_c.load_model(write_tiny_model(str(tmp_path_factory.mktemp("shared") / "llama"), arch="llama", seed=5))


def _positions(session, cfg):
    return [[session.cache_positions(l, h) for h in range(cfg["n_kv_heads"])] for l in range(cfg["n_layers"])]


def test_followers_equal_separate_prefills(tiny, rng):
    cfg = tiny.config
    ids = rng.integers(0, cfg["vocab"], size=150).astype(np.int32)
    step = rng.integers(0, cfg["vocab"], size=3).astype(np.int32)
    presses = [p for p in _presses()[1:-2]]  # scorer presses that attach to a session
    separate = []
    for p in presses:
        s = tiny.new_session()
        s.set_press(**p.c_config())
        s.forward(ids, logits="none")
        s.set_press(None)
        nbytes = s.cache_bytes
        separate.append((nbytes, _positions(s, cfg), s.forward(step, logits="all")))
    leader = tiny.new_session()
    followers = []
    for p in presses:
        s = tiny.new_session()
        s.set_press(**p.c_config())
        followers.append(s)
    full_logits = tiny.new_session().forward(ids, logits="last")
    logits = leader.forward_shared(ids, followers)
    np.testing.assert_allclose(logits, full_logits, rtol=0, atol=1e-5)
    assert int(leader.cache_lengths().min()) == len(ids)  # the leader keeps the full cache
    # each session times its own press (benchmarks read it); a session without one spent nothing
    assert leader.press_seconds == 0.0
    assert all(f.press_seconds > 0.0 for f in followers)
    for p, f, (nbytes, pos, step_logits) in zip(presses, followers, separate):
        assert f.position == len(ids)
        got = _positions(f, cfg)
        for l in range(cfg["n_layers"]):
            for h in range(cfg["n_kv_heads"]):
                np.testing.assert_array_equal(got[l][h], pos[l][h], err_msg=f"{p} layer {l} head {h}")
        assert f.cache_bytes == nbytes
        f.set_press(None)
        spent = f.press_seconds
        np.testing.assert_allclose(f.forward(step, logits="all"), step_logits, rtol=0, atol=1e-5,
                                   err_msg=repr(p))
        assert f.press_seconds == spent  # no press attached: the clock stands still
        f.reset()
        assert f.press_seconds == 0.0


@pytest.mark.slow  # 2 x 20 presses, each also run alone, on 500 tokens of the default model: left out of make test-fast
def test_run_many_equals_one_press_at_a_time(default_model):
    from kvpress_c.demo import needle_prompt
    context, question, _ = needle_prompt(default_model, n_tokens=500, seed=3)
    pipe = kvpress_c.Pipeline(default_model)
    # these share the prefill through a full-cache copy (soft rows; probes of a one-chunk prompt)
    # (KVzip always scores the full cache after the prefill)
    full_copy = lambda: [kvpress_c.JudgeQPress.default_for(default_model, budget=64), kvpress_c.TAKEPress(budget=64),
                         kvpress_c.KVzipPress(compression_ratio=0.7)]
    for aware in (False, True):
        presses = _presses() + full_copy()
        many = pipe.run_many(context, question, presses=presses, max_new_tokens=8, query_aware=aware)
        for press, res in zip(_presses() + full_copy(), many):
            one = pipe(context, question, press=press, max_new_tokens=8, query_aware=aware)
            assert res.answers == one.answers, (press, aware)
            assert res.stats["kept_tokens_total"] == one.stats["kept_tokens_total"], (press, aware)
            # TAKE on 500 tokens in chunks of 64 changes the forward: its own prefill
            take = isinstance(press, kvpress_c.TAKEPress)
            assert res.stats["shared_prefill"] == (not take or press.chunk_size >= 500), press
            for a, b in zip(res.kept_indices, one.kept_indices):
                for x, y in zip(a, b):
                    np.testing.assert_array_equal(x, y)


def test_forward_shared_rejects_bad_followers(tiny, rng):
    ids = rng.integers(0, tiny.config["vocab"], size=20).astype(np.int32)
    leader, used = tiny.new_session(), tiny.new_session()
    used.forward(ids[:3], logits="none")
    with pytest.raises(ValueError, match="not empty"):
        leader.forward_shared(ids, [used])
    assert leader.position == 0 and int(leader.cache_lengths().max()) == 0
    with pytest.raises(TypeError, match="not a Session"):
        leader.forward_shared(ids, ["x"])
    f = tiny.new_session()
    with pytest.raises(ValueError, match="listed twice"):
        leader.forward_shared(ids, [f, f])
    with pytest.raises(ValueError, match="leader itself"):
        leader.forward_shared(ids, [leader])
    other = kvpress_c.load_model(tiny.path) if hasattr(tiny, "path") else None
    if other is not None:
        with pytest.raises(ValueError, match="another model"):
            leader.forward_shared(ids, [other.new_session()])
    # a follower whose press fails (window longer than the prompt) resets every follower
    bad = tiny.new_session()
    bad.set_press(**kvpress_c.SnapKVPress(budget=64, window_size=64).c_config())
    good = tiny.new_session()
    with pytest.raises(ValueError):
        leader.forward_shared(ids, [good, bad])
    assert good.position == 0 and int(good.cache_lengths().max()) == 0
    leader.reset()
    leader.forward_shared(ids, [good])
    assert good.position == len(ids)


def test_forward_batch_equals_one_session_at_a_time(tiny, rng):
    """Batched decode over sessions with different (compressed) caches and positions = each session
    decoding alone."""
    from kvpress_c import _core
    from kvpress_c.model import greedy_many
    cfg = tiny.config
    presses = [None, kvpress_c.SnapKVPress(budget=30, window_size=8), kvpress_c.KnormPress(budget=20),
               kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(budget=25, window_size=8))]
    pairs = []
    for k, p in enumerate(presses):
        n = int(rng.integers(40, 90))
        ids = rng.integers(0, cfg["vocab"], size=n).astype(np.int32)
        a, b = tiny.new_session(), tiny.new_session()
        for s in (a, b):
            if p is not None:
                s.set_press(**p.c_config())
            s.forward(ids, logits="none")
            s.set_press(None)
        pairs.append((a, b))
    for step in range(4):
        toks = rng.integers(0, cfg["vocab"], size=len(pairs)).astype(np.int32)
        batched = _core.forward_batch([a for a, _ in pairs], toks)
        for row, ((_, b), t) in enumerate(zip(pairs, toks)):
            np.testing.assert_allclose(batched[row], b.forward(np.array([t], np.int32), logits="last"),
                                       rtol=0, atol=2e-5, err_msg=f"step {step} session {row}")
    for a, b in pairs:
        assert a.position == b.position
        np.testing.assert_array_equal(a.cache_lengths(), b.cache_lengths())
    # greedy_many = greedy on each session
    from kvpress_c.model import greedy
    firsts = [a.forward(np.array([1], np.int32), logits="last") for a, _ in pairs]
    firsts_b = [b.forward(np.array([1], np.int32), logits="last") for _, b in pairs]
    many = greedy_many([a for a, _ in pairs], firsts, 6, stop_ids=set())
    for (_, b), f, out in zip(pairs, firsts_b, many):
        assert greedy(b, [1], 6, set(), first_logits=f).ids == out
    with pytest.raises(ValueError, match="press attached"):
        s = tiny.new_session()
        s.set_press(**kvpress_c.KnormPress(budget=4).c_config())
        _core.forward_batch([s], [1])
    with pytest.raises(ValueError, match="listed twice"):
        _core.forward_batch([pairs[0][0], pairs[0][0]], [1, 2])
    with pytest.raises(ValueError, match="2 sessions but 1"):
        _core.forward_batch([pairs[0][0], pairs[1][0]], [1])
    with pytest.raises(ValueError, match="vocabulary"):
        _core.forward_batch([pairs[0][0]], [cfg["vocab"]])
    with pytest.raises(TypeError, match="not a Session"):
        _core.forward_batch(["x"], [1])


def _full_cache_presses(kind, cfg, rng):
    if kind == "judgeq":
        soft = rng.normal(0, 1, size=(6, cfg["hidden"])).astype(np.float32)
        return [kvpress_c.JudgeQPress(soft_embeddings=soft, budget=b) for b in (20, 40, 90)]
    probe = rng.integers(0, cfg["vocab"], size=7).astype(np.int32)
    return [kvpress_c.TAKEPress(budget=b, probe=probe, kernel_size=3) for b in (20, 40, 90)] + \
        [kvpress_c.TAKEPress(budget=30, warmup_layers=1), kvpress_c.TAKEPress(budget=30, delayed=False, alpha=0.5)]


@pytest.mark.parametrize("kind", ["judgeq", "take"])
def test_a_press_on_a_shared_prefill_equals_its_own_prefill(tiny, rng, kind):
    """Judge Q's soft rows, or TAKE's probes on a one-chunk prompt, run after a shared prefill on a
    copy of the full cache: the same kept tokens and decode logits as the press's own prefill of
    prompt + extra rows (the prompt's K/V do not depend on rows after it), several budgets from one
    forward."""
    cfg = tiny.config
    ids = rng.integers(0, cfg["vocab"], size=160).astype(np.int32)
    step = rng.integers(0, cfg["vocab"], size=3).astype(np.int32)
    presses = _full_cache_presses(kind, cfg, rng)
    assert all(p.compresses_full_cache(ids) for p in presses)
    own = []
    for p in presses:
        s = tiny.new_session()
        logits = p.prefill(s, ids, cfg)
        own.append((logits, _positions(s, cfg), s.forward(step, logits="all")))
    leader = tiny.new_session()
    followers = [tiny.new_session() for _ in presses]
    logits = leader.forward_shared(ids, followers)
    for p, f, (own_logits, pos, step_logits) in zip(presses, followers, own):
        np.testing.assert_allclose(logits, own_logits, rtol=0, atol=1e-5)
        p.compress_full_cache(f, ids, cfg)
        assert f.position == len(ids)
        got = _positions(f, cfg)
        for l in range(cfg["n_layers"]):
            for h in range(cfg["n_kv_heads"]):
                assert len(got[l][h]) == p.budget
                np.testing.assert_array_equal(got[l][h], pos[l][h], err_msg=f"{p} layer {l} head {h}")
        np.testing.assert_allclose(f.forward(step, logits="all"), step_logits, rtol=0, atol=1e-4)
    # the pipeline takes this path when the press shares a sample with other presses
    assert kvpress_c.Pipeline._shares_prefill(presses[0], ids)


def test_when_a_press_cannot_share_the_prefill(tiny, rng):
    cfg = tiny.config
    ids = rng.integers(0, cfg["vocab"], size=160).astype(np.int32)
    soft = rng.normal(0, 1, size=(1, cfg["hidden"])).astype(np.float32)
    # a single soft row or probe would read as a decode step to the press hook
    assert not kvpress_c.JudgeQPress(soft_embeddings=soft, budget=20).compresses_full_cache(ids)
    assert not kvpress_c.TAKEPress(budget=20, probe=[5]).compresses_full_cache(ids)
    assert not kvpress_c.TAKEPress(budget=20).compresses_full_cache(ids, question_ids=[5])
    assert kvpress_c.TAKEPress(budget=20).compresses_full_cache(ids, question_ids=[5, 6])
    # a prompt of several chunks: later chunks attend only to the pruned past, so TAKE changes the forward
    take = kvpress_c.TAKEPress(budget=20, chunk_size=100)
    assert not take.compresses_full_cache(ids) and not kvpress_c.Pipeline._shares_prefill(take, ids)
    # an inner scorer that reads every query of the forward call would see the probes alone
    observed = kvpress_c.TAKEPress(budget=20, press=kvpress_c.ObservedAttentionPress(budget=20))
    assert not observed.compresses_full_cache(ids)
    assert kvpress_c.TAKEPress(budget=20, press=kvpress_c.SnapKVPress(budget=20, window_size=8)).compresses_full_cache(ids)


def test_take_on_a_cache_it_cannot_use_is_an_error(tiny, rng):
    """prompt_cached checks the session really holds the prompt's full cache; a refusal loses nothing."""
    cfg = tiny.config
    ids = rng.integers(0, cfg["vocab"], size=120).astype(np.int32)
    probe = ids[-6:]
    s = tiny.new_session()
    s.forward(ids, logits="none")
    with pytest.raises(ValueError, match="more than one chunk"):
        s.prefill_take(ids, probe, 30, chunk_size=100, prompt_cached=True)
    with pytest.raises(ValueError, match="at least 2 probe tokens"):
        s.prefill_take(ids, probe[:1], 30, prompt_cached=True)
    with pytest.raises(ValueError, match="full cache of the 100 prompt tokens"):
        s.prefill_take(ids[:100], probe, 30, prompt_cached=True)
    observed = kvpress_c.ObservedAttentionPress(budget=30).c_config()
    with pytest.raises(ValueError, match="observed-attention scorer"):
        s.prefill_take(ids, probe, 30, inner=observed, prompt_cached=True)
    assert s.position == len(ids) and s.cache_lengths().min() == s.cache_lengths().max() == len(ids)
    compressed = tiny.new_session()
    compressed.set_press(**kvpress_c.SnapKVPress(budget=40, window_size=8).c_config())
    compressed.forward(ids, logits="none")
    compressed.set_press(None)
    with pytest.raises(ValueError, match="full cache"):
        compressed.prefill_take(ids, probe, 30, prompt_cached=True)
    assert compressed.cache_lengths().max() == 40
    assert s.prefill_take(ids, probe, 30, prompt_cached=True) is None
    assert s.position == len(ids) and s.cache_lengths().max() == 30


def test_a_window_longer_than_the_forward_call_is_an_error(tiny, rng):
    cfg = tiny.config
    s = tiny.new_session()
    s.forward(rng.integers(0, cfg["vocab"], size=100).astype(np.int32), logits="none")
    s.set_press(**kvpress_c.SnapKVPress(budget=20, window_size=16).c_config())
    with pytest.raises(ValueError, match="longer than this forward call"):
        s.forward(rng.integers(0, cfg["vocab"], size=8).astype(np.int32), logits="none")
    assert s.cache_lengths().min() == 100  # nothing lost


def test_copy_cache_from_gives_an_exact_independent_copy(tiny, rng):
    """Session.copy_cache_from: the same rows, positions and next position as the source (a ragged
    compressed cache here), the same logits afterwards, and errors that leave both sessions intact."""
    from cache_checks import ragged_copy
    cfg = tiny.config
    ids = rng.integers(0, cfg["vocab"], size=90).astype(np.int32)
    step = rng.integers(0, cfg["vocab"], size=3).astype(np.int32)
    src, dst = ragged_copy(tiny, ids)
    assert len(set(src.cache_lengths().ravel().tolist())) > 1  # Ada-KV: heads of different lengths
    np.testing.assert_array_equal(dst.forward(step, logits="all"), src.forward(step, logits="all"))
    dst.forward(step[:1], logits="none")  # the copy is independent: the source does not move
    assert src.position == len(ids) + 3 and dst.position == len(ids) + 4
    with pytest.raises(ValueError, match="not empty"):
        dst.copy_cache_from(src)
    assert dst.position == len(ids) + 4
    with pytest.raises(ValueError, match="onto itself"):
        src.copy_cache_from(src)
    with pytest.raises(TypeError, match="takes a Session"):
        tiny.new_session().copy_cache_from("x")
    empty = tiny.new_session()
    empty.copy_cache_from(tiny.new_session())
    assert empty.position == 0 and int(empty.cache_lengths().max()) == 0 and empty.cache_bytes == 0
    other = kvpress_c.load_model(tiny.path)
    with pytest.raises(ValueError, match="different models"):
        other.new_session().copy_cache_from(src)
