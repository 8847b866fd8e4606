"""The reuse evaluation (kvpress_c/eval/reuse.py): contexts with several questions each, the question-free
context shared by all of them; with the full cache (nothing depends on the question) the reuse mode answers
exactly as the per-question mode."""
import kvpress_c
from kvpress_c.eval import reuse


def test_groups_hold_every_needle_once_and_a_question_free_context(default_model_native):
    pipe = kvpress_c.Pipeline(default_model_native)
    for kind in reuse.KINDS:
        (g,) = reuse.groups(pipe, kind, 600, 1, n_needles=3, seed=7)
        assert len(g["questions"]) == 3
        for q in g["questions"]:
            for a in q["answers"]:
                assert g["context"].count(a) == 1, (kind, a)  # every answer is in the shared context, once
            assert q["question"] not in g["context"]
        n = sum(len(x) for x in pipe.split_prompt(g["context"], g["questions"][0]["question"],
                                                    g["questions"][0]["answer_prefix"]))
        assert 400 < n <= 600, (kind, n)
        keys = [q["question"] for q in g["questions"]]
        assert len(set(keys)) == 3


def test_full_cache_reuse_equals_per_question(default_model_native, tmp_path):
    pipe = kvpress_c.Pipeline(default_model_native)
    contexts = reuse.groups(pipe, "ruler_multikey", 500, 1, n_needles=2, seed=3)
    for q in contexts[0]["questions"]:
        q["max_new_tokens"] = 8
    rows = reuse.run(default_model_native, contexts, {"full": None}, folder=str(tmp_path))
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["reuse"]["predictions"] == by_mode["per_question"]["predictions"]  # the same greedy answers
    assert by_mode["reuse"]["kept_tokens"] == by_mode["per_question"]["kept_tokens"] - (
        by_mode["per_question"]["prompt_tokens"] - by_mode["reuse"]["prompt_tokens"])
    assert "| ruler_multikey | full |" in reuse.table(rows)
    assert not list(tmp_path.iterdir())  # the saved caches are removed after use
