"""The harness on a local Ray cluster (2 CPUs, 2 worker actors x 1 thread, the default model, short
prompts): the same metrics.json as the serial run, a worker killed mid-run loses and duplicates
nothing, a sample failing on every try is recorded and the run goes on, an interrupted driver resumes,
and a missing Ray says how to install it. One cluster for the module, shut down at its end."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import ray  # a test dependency (the Makefile installs it); for users an extra: kvpress_c[ray]

import kvpress_c
from kvpress_c import eval as kve
from kvpress_c.eval import niah, ray_runner
from kvpress_c.eval.runner import RunFolders

GRID = dict(presses=["full", "snapkv", "streaming_llm"], budgets=[48], lengths=[300, 500], depths=[0.2, 0.8],
            max_new_tokens=10)
LABELS = ["full", "snapkv-b48", "streaming_llm-b48"]


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _ours():
    return [n for n in ray.util.list_named_actors() if n.startswith(ray_runner.ACTOR_PREFIX)]


@pytest.fixture(autouse=True)
def no_leftover_workers(request):
    yield
    if "cluster" in request.fixturenames:  # every run kills its actors, interrupted or not
        for _ in range(50):
            if not _ours():
                break
            time.sleep(0.1)
        assert _ours() == []


@pytest.fixture(scope="module")
def serial(default_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    kve.run("niah", model=default_model, out=str(out), progress=False, **GRID)
    return out


def _ray_run(out, **kw):
    return kve.run("niah", out=str(out), progress=False, ray="auto", workers=2, threads=1, **GRID, **kw)


def _file(path):
    return open(path, encoding="utf-8").read()


def assert_same_as_serial(out, serial):
    for lab in LABELS:
        assert _file(out / lab / "metrics.json") == _file(serial / lab / "metrics.json"), lab
        assert _file(out / lab / "config.json") == _file(serial / lab / "config.json"), lab
        lines = _file(out / lab / "predictions.jsonl").splitlines()
        rows = [json.loads(x) for x in lines]
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids)) == 4, f"{lab}: {ids}"  # every sample once, none twice
        want = {r["id"]: (r["prediction"], r["score"]) for r in kve.read_predictions(str(serial / lab))}
        assert {r["id"]: (r["prediction"], r["score"]) for r in rows} == want


def test_ray_grid_matches_serial(cluster, serial, tmp_path):
    res = _ray_run(tmp_path)
    assert_same_as_serial(tmp_path, serial)
    s = res.summary
    assert (s["workers"], s["done"], s["failed"], s["retried"], s["worker_deaths"]) == (2, 4, 0, 0, 0)
    assert json.load(open(tmp_path / "ray_summary.json")) == s
    # a rerun finds everything done: no task at all
    again = _ray_run(tmp_path)
    assert (again.summary["skipped"], again.summary["done"]) == (4, 0)
    assert_same_as_serial(tmp_path, serial)


def test_killed_worker_task_is_retried_elsewhere(cluster, serial, tmp_path):
    killed = []

    def kill_first_worker_mid_run():
        pred = tmp_path / "full" / "predictions.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline:  # once the first sample is written, every worker holds a task
            if pred.exists() and pred.stat().st_size > 0:
                name = next(n for n in _ours() if n.endswith(":0"))
                ray.kill(ray.get_actor(name), no_restart=False)  # Ray restarts it; its tasks fail
                killed.append(name)
                return
            time.sleep(0.02)

    t = threading.Thread(target=kill_first_worker_mid_run)
    t.start()
    res = _ray_run(tmp_path)
    t.join()
    assert killed, "the run ended before the worker could be killed"
    s = res.summary
    print("summary after the kill:", s)
    assert s["worker_deaths"] == 1 and s["retried"] >= 1 and s["failed"] == 0 and s["done"] == 4
    assert s["workers_lost"] == 0  # Ray restarted the killed actor and the driver took it back
    for sid, where in s["retried_samples"].items():  # done by another process than the one killed under it
        assert where["done_on"] is not None and where["done_on"] not in where["failed_on"], (sid, where)
    assert_same_as_serial(tmp_path, serial)


def test_sample_failing_every_try_is_recorded(cluster, default_model, tmp_path):
    samples = niah.samples(kvpress_c.Pipeline(default_model), [300], [0.2, 0.5, 0.8])
    bad = dict(samples[1], max_new_tokens=-1)  # run_many refuses it on every worker
    specs = kve.press_specs(["full"])
    run = lambda ss: ray_runner.evaluate_on_ray("auto", "niah", specs, str(tmp_path), samples=ss, workers=2,
                                                threads=1, max_attempts=2, progress=False)
    res = run([samples[0], bad, samples[2]])
    s = res.summary
    assert (s["done"], s["failed"], s["retried"]) == (2, 1, 1)
    errors = [json.loads(x) for x in _file(tmp_path / "full" / "errors.jsonl").splitlines()]
    assert [(e["id"], e["attempts"]) for e in errors] == [(bad["id"], 2)]
    assert "max_new_tokens must be >= 0" in errors[0]["error"]
    m = res.rows[0]
    assert m["n_samples"] == 2 and m["n_failed"] == 1 and not m["complete"]
    # a rerun tries it again; fixed, it completes and the failure is no longer counted
    res = run(samples)
    assert (res.summary["skipped"], res.summary["done"]) == (2, 1)
    m = json.load(open(tmp_path / "full" / "metrics.json"))
    assert m["n_samples"] == 3 and m["complete"] and "n_failed" not in m


def test_resume_after_interrupted_driver(cluster, serial, tmp_path, monkeypatch):
    real, calls = RunFolders.write, []

    def interrupt_on_fourth_row(self, lab, row):
        calls.append(lab)
        if len(calls) == 4:  # the first sample's 3 rows are written, the second sample's first is not
            raise KeyboardInterrupt
        return real(self, lab, row)
    monkeypatch.setattr(RunFolders, "write", interrupt_on_fourth_row)
    with pytest.raises(KeyboardInterrupt):
        _ray_run(tmp_path)
    monkeypatch.setattr(RunFolders, "write", real)
    written = {lab: len(_file(tmp_path / lab / "predictions.jsonl").splitlines()) for lab in LABELS}
    assert sum(written.values()) == 3
    res = _ray_run(tmp_path)
    assert (res.summary["skipped"], res.summary["done"]) == (1, 3)
    assert_same_as_serial(tmp_path, serial)


def test_ray_missing_or_misused_says_what_to_do(tmp_path):
    code = ("import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
            "from kvpress_c.__main__ import main\n"
            f"sys.exit(main(['eval', 'niah', '--press', 'full', '--out', {str(tmp_path)!r}, '--ray']))")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(kvpress_c.__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "pip install 'kvpress_c[ray]'" in r.stderr, r.stderr
    with pytest.raises(ValueError, match="drop --shard"):
        kve.run("niah", presses=["full"], out=str(tmp_path), ray="auto", shard=(0, 2))


def test_workers_that_cannot_be_placed_are_refused(cluster, tmp_path):
    with pytest.raises(ValueError, match="largest node of the cluster has 2 CPUs"):
        kve.run("niah", presses=["full"], out=str(tmp_path), ray="auto", threads=3, progress=False)
