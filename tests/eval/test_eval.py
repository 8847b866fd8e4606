"""The evaluation harness on the default model: generators (lengths within 2%, needles where they
claim to be), LongBench loading rules, resume, shards + merge, report, and a small end-to-end run of
each benchmark."""
import json
import os
import re
import subprocess
import sys

import pytest

import kvpress_c
from kvpress_c import eval as kve
from kvpress_c.eval import longbench, niah, ruler
from kvpress_c.pipeline import Pipeline

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def pipe(default_model):
    return Pipeline(default_model)


@pytest.mark.parametrize("haystack", ["pydoc", "noise"])
def test_niah_lengths_and_depths(pipe, haystack, rng):
    lengths = sorted(int(x) for x in rng.integers(300, 2500, size=2))
    depths = [0.0, float(rng.uniform(0.1, 0.9)), 1.0]
    tok = pipe.model.tokenizer
    for s in niah.samples(pipe, lengths, depths, haystack=haystack):
        n, d = s["meta"]["length"], s["meta"]["depth"]
        ctx, q = pipe.split_prompt(s["context"], s["question"])
        assert abs(len(ctx) + len(q) - n) <= 0.02 * n, (n, len(ctx) + len(q))
        assert s["context"].count(niah.NEEDLE) == 1
        # the needle's token depth: at the sentence boundary at or before the requested depth
        book = s["context"].split("<book> ", 1)[1].rsplit(" </book>", 1)[0]
        head, tail = (part.strip() for part in book.split(niah.NEEDLE))
        before, after = len(tok.encode(head)), len(tok.encode(tail))
        got = before / (before + after)
        assert abs(got - s["meta"]["needle_depth_tokens"]) < 0.01
        assert got <= d + 0.01, (n, d, got)
        # ... and no sentence ends between the needle and the requested depth (in a short haystack one
        # sentence can span a tenth of it); 2 tokens of slack for re-tokenisation at the joins
        gap = tok.decode(tok.encode(tail)[: max(0, int(d * (before + after)) - before - 2)])
        assert not re.search(r"[.!?]\s+|\n", gap), (n, d, got, gap)


@pytest.mark.parametrize("length", [1024, 3000])
def test_ruler_tasks_fit_their_length(pipe, length, rng):
    gen = ruler.Generator(pipe, squad=os.path.join(FIXTURES, "squad_tiny.json"),
                          hotpotqa=os.path.join(FIXTURES, "hotpotqa_tiny.json"))
    index = int(rng.integers(0, 1000))
    for task in ruler.TASKS:
        s = gen.sample(task, length, index)
        family = "niah" if task.startswith("niah") else task.split("_")[0]
        budget = length - ruler.TOKENS_TO_GENERATE[family]
        text = s["context"] + s["question"]
        ctx, q = pipe.split_prompt(s["context"], s["question"], s["answer_prefix"])
        assert len(ctx) + len(q) == s["meta"]["prompt_tokens"]
        if family != "qa":  # the tiny QA fixture cannot fill a long prompt
            assert budget * 0.98 <= s["meta"]["prompt_tokens"] <= budget, (task, s["meta"]["prompt_tokens"], budget)
        if family == "niah":
            for v in s["answers"]:
                assert text.count(v) == 1, (task, v)
            assert s["meta"]["n_needles"] == len(s["answers"]) or task in ("niah_multikey_1", "niah_multiquery")
        elif family == "vt":
            value = s["question"].split("value ")[1].split(" ")[0]
            assert f"VAR {s['answers'][0]} = {value}." in text
            for a, b in zip(s["answers"], s["answers"][1:]):  # the chain in order
                assert text.index(f"VAR {b} = VAR {a} .") > text.index(f"VAR {a} ")
        elif family == "cwe":
            words = [line.split(". ", 1)[1] for line in s["context"].strip().split("\n")[1:] if ". " in line]
            counts = {w: words.count(w) for w in set(words)}
            top = sorted(counts, key=lambda w: -counts[w])[:10]
            assert set(top) == set(s["answers"]) and all(counts[w] == s["meta"]["freq_cw"] for w in s["answers"])
        elif family == "fwe":
            words = s["context"].split("Find the three most frequently appeared coded words. ")[1].split()
            counts = {w: words.count(w) for w in set(words) if w != "...."}
            top = sorted(counts, key=lambda w: -counts[w])[:3]
            assert [counts[w] for w in top] == [counts[w] for w in s["answers"]]
        else:
            assert any(a in text for a in s["answers"]) or task == "qa_2"
    with pytest.raises(ValueError, match="--squad"):
        ruler.Generator(pipe).sample("qa_1", 1024, 0)


def test_longbench_loading_rules(default_model):
    tok = default_model.tokenizer
    samples = longbench.load(os.path.join(FIXTURES, "longbench"), ["hotpotqa", "trec", "passage_count", "lcc"],
                             max_length=8192, tokenizer=tok)
    by = {s["task"]: s for s in samples}
    assert by["hotpotqa"]["chat"] and not by["trec"]["chat"] and not by["lcc"]["chat"]
    assert by["hotpotqa"]["max_new_tokens"] == 32 and by["lcc"]["max_new_tokens"] == 64
    h = by["hotpotqa"]
    assert h["context"].endswith("founded by Otto Brann.") and h["question"].startswith("\n\nAnswer the question")
    assert h["context"] + h["question"] == longbench.PROMPTS["hotpotqa"].format(
        **json.loads(open(os.path.join(FIXTURES, "longbench", "hotpotqa.jsonl")).readline()))
    assert by["passage_count"]["answers"] == ["2"]
    # middle truncation keeps the first and last max_length/2 tokens
    item = json.loads(open(os.path.join(FIXTURES, "longbench", "hotpotqa.jsonl")).readline())
    item["context"] = " ".join(f"w{i}" for i in range(3000))
    s = longbench.make_sample("hotpotqa", item, 200, tok, 0)
    full = tok.encode(longbench.PROMPTS["hotpotqa"].format(**item))
    assert s["meta"]["truncated"]
    assert tok.encode(s["context"] + s["question"])[:90] == full[:90]
    assert s["question"].endswith("Answer:") and "Question: Which river" in s["question"]
    e = longbench.load(os.path.join(FIXTURES, "longbench"), ["trec"], 8192, tok, longbench_e=True)
    assert e[0]["task"] == "trec_e"
    with pytest.raises(FileNotFoundError, match="data.zip"):
        longbench.load("/nonexistent", ["trec"], 8192, tok)
    with pytest.raises(ValueError, match="not part of LongBench-E"):
        longbench.load(os.path.join(FIXTURES, "longbench"), ["narrativeqa"], 8192, tok, longbench_e=True)


def _niah_run(model, out, **kw):
    return kve.run("niah", model=model, presses=["full", "snapkv", "streaming_llm"], budgets=[48], out=out,
                   lengths=[400], depths=[0.2, 0.8], progress=False, max_new_tokens=12, **kw)


def test_resume_skips_done_samples(default_model, tmp_path, monkeypatch):
    res = _niah_run(default_model, str(tmp_path))
    assert {r["label"] for r in res.rows} == {"full", "snapkv-b48", "streaming_llm-b48"}
    assert all(r["n_samples"] == 2 and r["complete"] for r in res.rows)
    assert os.path.exists(tmp_path / "full" / "heatmap.png")
    # cut the last line of one label (as an interrupted run leaves it) and rerun: only that is redone
    path = tmp_path / "snapkv-b48" / "predictions.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1][:20])
    calls = []
    real = Pipeline.run_many

    def spy(self, *a, **k):
        calls.append(len(k["presses"]))
        return real(self, *a, **k)
    monkeypatch.setattr(Pipeline, "run_many", spy)
    res2 = _niah_run(default_model, str(tmp_path))
    assert calls == [1]  # one sample, one press
    before = {r["label"]: r["score"] for r in res.rows}
    assert {r["label"]: r["score"] for r in res2.rows} == before
    calls.clear()
    _niah_run(default_model, str(tmp_path))
    assert calls == []
    with pytest.raises(ValueError, match="different configuration"):
        kve.run("niah", model=default_model, presses=["snapkv"], budgets=[48], out=str(tmp_path),
                    lengths=[400], depths=[0.2, 0.8], progress=False, max_new_tokens=12, query_aware=True)


def test_shards_merge_to_the_unsharded_run(default_model, tmp_path):
    whole = _niah_run(default_model, str(tmp_path / "whole"))
    for i in range(2):
        r = _niah_run(default_model, str(tmp_path / "sharded"), shard=(i, 2))
        assert r.rows == []
    merged = kve.merge(str(tmp_path / "sharded"))
    key = lambda rows: {r["label"]: (r["score"], r["n_samples"]) for r in rows}
    assert key(merged.rows) == key(whole.rows)
    a = {r["id"]: r["prediction"] for r in kve.read_predictions(str(tmp_path / "whole" / "snapkv-b48"))}
    b = {r["id"]: r["prediction"] for r in kve.read_predictions(str(tmp_path / "sharded" / "snapkv-b48"))}
    assert a == b
    assert not list((tmp_path / "sharded" / "snapkv-b48").glob("*.shard-*"))
    csv_text = merged.to_csv(str(tmp_path / "m.csv"))
    assert csv_text.splitlines()[0].startswith("label,press,budget")


def test_cli_ruler_longbench_and_report(tmp_path, default_gguf):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(kvpress_c.__file__)))
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvpress_c", *a], capture_output=True, text=True,
                                    env=env, timeout=900)
    r = run("eval", "ruler", "--model", default_gguf, "--press", "full", "ada_snapkv", "--budget", "64",
            "--tasks", "niah_single_1", "qa_1", "--length", "700", "--samples", "1", "--out", str(tmp_path / "ruler"),
            "--squad", os.path.join(FIXTURES, "squad_tiny.json"), "--max-new-tokens", "16", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "ruler (question-agnostic)" in r.stdout and "ada_snapkv" in r.stdout
    m = json.load(open(tmp_path / "ruler" / "ada_snapkv-b64" / "metrics.json"))
    assert set(m["per_task"]) == {"niah_single_1", "qa_1"} and m["complete"]
    r = run("eval", "longbench", "--model", default_gguf, "--press", "full", "snapkv", "--compression-ratio", "0.5",
            "--data", os.path.join(FIXTURES, "longbench"), "--tasks", "trec", "passage_count", "--window-size", "8",
            "--out", str(tmp_path / "lb"), "--max-new-tokens", "8", "--no-progress", "--query-aware")
    assert r.returncode == 0, r.stderr
    m = json.load(open(tmp_path / "lb" / "snapkv-r0.5" / "metrics.json"))
    assert m["query_aware"] and set(m["per_task"]) == {"trec", "passage_count"}
    r = run("report", str(tmp_path / "ruler"), str(tmp_path / "lb"), "--csv", str(tmp_path / "r.csv"),
            "--plot", str(tmp_path / "r.png"))
    assert r.returncode == 0, r.stderr
    assert "longbench (question-aware)" in r.stdout and os.path.getsize(tmp_path / "r.png") > 1000
    assert len(open(tmp_path / "r.csv").read().splitlines()) == 5
    r = run("eval", "longbench", "--press", "snapkv", "--budget", "8", "--out", str(tmp_path / "x"), "--no-progress")
    assert r.returncode != 0 and "--data" in r.stderr
    r = run("eval", "niah", "--press", "snapkv", "--out", str(tmp_path / "y"))
    assert r.returncode != 0 and "--budget" in r.stderr
    r = run("report", str(tmp_path / "nothing"))
    assert r.returncode != 0 and "does not exist" in r.stderr


def test_press_names_build(default_model):
    for name in kve.PRESS_NAMES:
        if name in ("full", "judgeq"):
            continue
        press = kve.make_press(name, budget=32)
        assert press is not None
    assert kve.make_press("full") is None
    with pytest.raises(ValueError, match="unknown press"):
        kve.make_press("nope", budget=4)
    with pytest.raises(ValueError, match="not --compression-ratio"):
        kve.make_press("take", compression_ratio=0.5)


def test_a_run_resumes_with_its_model_under_another_path(tmp_path):
    """config.json records the model's path and its weights' digest; a rerun from another checkout (the embedded
    model in another virtualenv) resumes when the digests agree, whatever the paths, and is another experiment when
    they differ. Folders written before the digest was recorded compare the file's name and, where both paths
    exist, its size."""
    from kvpress_c.eval.runner import _check_config
    a, b, c = (tmp_path / d for d in ("a", "b", "c"))
    for folder, data in ((a, b"x" * 10), (b, b"y" * 10), (c, b"z" * 11)):
        folder.mkdir()
        (folder / "m.gguf").write_bytes(data)

    def cfg(path, digest=None):
        return {"benchmark": "niah", "label": "full", "model": str(path), "n_samples_total": 2,
                **({"model_digest": digest} if digest else {})}

    run = tmp_path / "run"
    run.mkdir()
    _check_config(str(run), cfg(a / "m.gguf", "sha256:1"))
    _check_config(str(run), cfg(tmp_path / "elsewhere" / "w.gguf", "sha256:1"))  # same weights, other path
    with pytest.raises(ValueError, match="differs in model"):
        _check_config(str(run), cfg(tmp_path / "elsewhere" / "w.gguf", "sha256:2"))
    legacy = tmp_path / "legacy"  # written before the digest: name and size
    legacy.mkdir()
    _check_config(str(legacy), cfg(tmp_path / "gone" / "m.gguf"))  # a path that no longer exists
    _check_config(str(legacy), cfg(a / "m.gguf", "sha256:1"))  # the recorded one is gone: the name decides
    _check_config(str(legacy), cfg(b / "m.gguf", "sha256:1"))  # digests agree
    legacy2 = tmp_path / "legacy2"
    legacy2.mkdir()
    _check_config(str(legacy2), cfg(a / "m.gguf"))
    _check_config(str(legacy2), cfg(b / "m.gguf"))  # both exist: same name and size
    with pytest.raises(ValueError, match="differs in model"):
        _check_config(str(legacy2), cfg(c / "m.gguf"))  # another size
    with pytest.raises(ValueError, match="differs in model"):
        _check_config(str(legacy2), cfg(a / "other.gguf"))  # another name
