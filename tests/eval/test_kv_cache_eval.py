"""The evaluation harness's K/V cache types (issue 27's table): kv_cache reaches the sessions, is recorded per
label and resumes per (press, budget, type); presses in several types share one prefill and get the caches,
kept rows and answers of one run per type (Pipeline.run_many(kv_caches=...))."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvpress_c
from kvpress_c import eval as kve
from kvpress_c.eval.presets import make_press
from kvpress_c.eval.report import kv_cache_table, table
from kvpress_c.kv_cache import kv_cache_from_name, kv_cache_name, kv_format
from kvpress_c.pipeline import Pipeline


def _niah(model, out, kv_cache, presses=("full", "snapkv")):
    return kve.run("niah", model=model, presses=list(presses), budgets=[48], out=str(out), lengths=[400],
                   depths=[0.5], progress=False, max_new_tokens=6, kv_cache=kv_cache)


def _spy_sessions(monkeypatch) -> list:
    made = []
    real = Pipeline.new_session

    def spy(self, *a, **k):
        s = real(self, *a, **k)
        made.append(s)
        return s
    monkeypatch.setattr(Pipeline, "new_session", spy)
    return made


def test_kv_cache_reaches_the_sessions_and_the_records(default_model, tmp_path, monkeypatch):
    made = _spy_sessions(monkeypatch)
    res = _niah(default_model, tmp_path, "q8_0")
    assert {r["label"] for r in res.rows} == {"full-q8_0", "snapkv-b48-q8_0"}
    assert made and {tuple(s.kv_format()) for s in made} == {kv_format("q8_0")}
    for lab in ("full-q8_0", "snapkv-b48-q8_0"):
        for name in ("config.json", "metrics.json"):
            assert json.loads((tmp_path / lab / name).read_text())["kv_cache"] == "q8_0"
    assert all(r["kv_cache"] == "q8_0" for r in res.rows)
    # another type in the same folder runs beside it; each label resumes on its own
    made.clear()
    calls = []
    real = Pipeline.run_many

    def count(self, *a, **k):
        calls.append(len(k["presses"]))
        return real(self, *a, **k)
    monkeypatch.setattr(Pipeline, "run_many", count)
    res2 = _niah(default_model, tmp_path, ["q8_0", kvpress_c.QuantizedCache(4)])
    assert calls == [2]  # the kivi4 labels only
    assert {tuple(s.kv_format()) for s in made} == {kv_format(kvpress_c.QuantizedCache(4))}
    assert {r["label"]: r["kv_cache"] for r in res2.rows} == {
        "full-q8_0": "q8_0", "snapkv-b48-q8_0": "q8_0", "full-kivi4": "kivi4", "snapkv-b48-kivi4": "kivi4"}
    text = table(res2.rows)
    assert "snapkv kivi4" in text and "full q8_0" in text
    score = {r["label"]: r["score"] for r in res2.rows}
    md = kv_cache_table(res2.rows, ("kivi4", "q8_0")).splitlines()
    assert "| press | budget | q8_0 | kivi4 | kivi4 - q8_0 |" in md
    assert f"| full | - | {score['full-q8_0']:.1f} | {score['full-kivi4']:.1f} | " \
           f"{score['full-kivi4'] - score['full-q8_0']:+.1f} |" in md


def test_cli_kv_cache(tmp_path, default_gguf):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(kvpress_c.__file__)))
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvpress_c", *a], env=env, capture_output=True, text=True)
    out = tmp_path / "niah"
    r = run("eval", "niah", "--model", default_gguf, "--lengths", "300", "--depths", "0.5", "--press", "full",
            "--kv-cache", "kivi2-g32-r16", "f16", "--max-new-tokens", "4", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "full-kivi2-g32-r16" / "config.json").read_text())["kv_cache"] == "kivi2-g32-r16"
    assert json.loads((out / "full-f16" / "metrics.json").read_text())["kv_cache"] == "f16"
    r = run("report", str(out), "--kv-cache-table", "kivi2-g32-r16", "f16")
    assert r.returncode == 0, r.stderr
    assert "| press | budget | f16 | kivi2-g32-r16 | kivi2-g32-r16 - f16 |" in r.stdout
    r = run("eval", "niah", "--model", default_gguf, "--press", "full", "--kv-cache", "q4", "--out", str(out))
    assert r.returncode != 0 and "kivi4" in r.stderr


def test_runs_without_a_type_record_the_models_own(default_model, tmp_path):
    res = _niah(default_model, tmp_path, None, presses=("full",))
    assert [r["label"] for r in res.rows] == ["full"]
    assert json.loads((tmp_path / "full" / "config.json").read_text())["kv_cache"] == "native"
    # a folder written before the type was recorded resumes as the device's own type
    cfg = json.loads((tmp_path / "full" / "config.json").read_text())
    del cfg["kv_cache"]
    (tmp_path / "full" / "config.json").write_text(json.dumps(cfg))
    _niah(default_model, tmp_path, None, presses=("full",))


def test_kv_cache_names_round_trip_and_refuse():
    for kv in ["f32", "f16", "bf16", "q8_0", kvpress_c.QuantizedCache(4), kvpress_c.QuantizedCache(2),
               kvpress_c.QuantizedCache(2, 32, 16)]:
        assert kv_cache_from_name(kv_cache_name(kv)) == kv
    assert kv_cache_name(kvpress_c.QuantizedCache(2, 32, 16)) == "kivi2-g32-r16"
    assert kv_cache_from_name("native") is None
    for bad in ["q4", "kivi3", "kivi4-g32"]:
        with pytest.raises(ValueError, match="f16.*kivi4"):
            kv_cache_from_name(bad)
    with pytest.raises(ValueError, match="twice"):
        kve.press_specs(["full"], kv_cache=["kivi4", kvpress_c.QuantizedCache(4)])


def test_types_share_one_prefill_as_separate_runs(default_model, rng):
    """Presses in several K/V types in one run_many: one forward for all (a call's own rows are read exact,
    so the forward does not depend on the type), each session storing in its type; full caches in another
    type than the leader's are filled as followers, and a press that copies the full cache (TAKE on one
    chunk) copies one in its own type (made for it where no full entry has that type). Kept rows, bytes
    and answers equal one run per type (7 sessions at most decode together here: above 12, a native-weight
    model's batched decode takes the GEMM path, whose rounding differs: docs/ARCHITECTURE.md)."""
    vocab = default_model.config["vocab"]
    ids = rng.integers(200, vocab - 1, 360)
    context = default_model.decode(ids.tolist())
    question = "What was said first?"
    names = ["full", "snapkv", "take"]
    presses = {n: make_press(n, budget=None if n == "full" else 48, model=default_model) for n in names}
    plan = [("full", "q8_0"), ("snapkv", "q8_0"), ("take", "q8_0"), ("full", kvpress_c.QuantizedCache(4)),
            ("snapkv", kvpress_c.QuantizedCache(4)), ("take", kvpress_c.QuantizedCache(4)), ("take", "f16")]
    mixed = Pipeline(default_model).run_many(context, question, presses=[presses[n] for n, _ in plan],
                                             max_new_tokens=8, query_aware=True, kv_caches=[kv for _, kv in plan])
    assert all(r.stats["shared_prefill"] for r in mixed)
    # one run per type with all three presses: TAKE copies that run's full cache there too (alone, it would run
    # its own prefill, whose probes read the chunk's rows exact rather than in the stored type)
    separate = {}
    for kv in ("q8_0", kvpress_c.QuantizedCache(4), "f16"):
        runs = Pipeline(default_model, kv_cache=kv).run_many(context, question, presses=list(presses.values()),
                                                             max_new_tokens=8, query_aware=True)
        separate.update({(n, kv_cache_name(kv)): r for n, r in zip(names, runs)})
    for (name, kv), got in zip(plan, mixed):
        want = separate[name, kv_cache_name(kv)]
        for lg, lw in zip(got.kept_indices, want.kept_indices):
            for hg, hw in zip(lg, lw):
                np.testing.assert_array_equal(hg, hw, err_msg=f"{name} {kv}")
        assert got.stats["cache_bytes"] == want.stats["cache_bytes"], (name, kv)
        assert got.answers == want.answers, (name, kv)
    with pytest.raises(ValueError, match="one per press"):
        Pipeline(default_model).run_many(context, question, presses=[None], kv_caches=["f16", "q8_0"])
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        Pipeline(default_model).run_many(context, question, presses=[None], kv_caches=["q4"])
