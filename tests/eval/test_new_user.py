"""What a new user hit: prompts past the model's context (refused by the harness unless asked for,
warned about by Pipeline and generate) and a missing matplotlib (an extra: eval and report print the
table and say how to get the plots)."""
import json
import os
import subprocess
import sys
import warnings

import pytest

import kvpress_c
from kvpress_c import eval as kve
from kvpress_c.eval import niah


def test_harness_refuses_prompts_past_the_context(default_model, monkeypatch, tmp_path):
    pipe = kvpress_c.Pipeline(default_model)
    samples = niah.samples(pipe, [300], [0.5])
    monkeypatch.setitem(default_model.config, "max_context", 200)
    with pytest.raises(ValueError, match="context of 200.*--allow-long-context"):
        kve.check_context(pipe, samples)
    kve.check_context(pipe, samples, allow_long_context=True)
    with pytest.raises(ValueError, match="1 of 1 samples"):
        kve.run("niah", model=default_model, presses=["full"], out=str(tmp_path), lengths=[300], depths=[0.5],
                progress=False)
    assert not (tmp_path / "full").exists()  # refused before anything ran or was written
    monkeypatch.setitem(default_model.config, "max_context", 8192)
    kve.check_context(pipe, samples)


def test_pipeline_and_generate_warn_past_the_context(default_model, monkeypatch):
    context, question = "The sky is blue. " * 20, "What colour is the sky?"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the context: no warning
        kvpress_c.Pipeline(default_model)(context, question=question, max_new_tokens=2)
    monkeypatch.setitem(default_model.config, "max_context", 64)
    with pytest.warns(RuntimeWarning, match="exceed the model's context of 64"):
        kvpress_c.Pipeline(default_model)(context, question=question, max_new_tokens=2)
    with pytest.warns(RuntimeWarning, match="max_position_embeddings"):
        default_model.generate(context, max_new_tokens=2)


def test_eval_and_report_without_matplotlib(tmp_path, default_gguf):
    out = str(tmp_path / "run")
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # as if the extra were not installed
            "from kvpress_c.__main__ import main\n"
            f"rc = main(['eval', 'niah', '--model', {default_gguf!r}, '--press', 'full', '--lengths', '300', "
            f"'--depths', '0.5', '--max-new-tokens', '8', '--no-progress', '--out', {out!r}])\n"
            f"sys.exit(rc or main(['report', {out!r}]))")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(kvpress_c.__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("niah (question-agnostic)") == 2  # eval's table, report's table
    assert "no heatmaps: matplotlib is not installed" in r.stdout
    assert "no plot: matplotlib is not installed (pip install 'kvpress_c[eval]'" in r.stdout
    assert os.path.exists(os.path.join(out, "report.csv")) and not os.path.exists(os.path.join(out, "report.png"))
    assert os.path.exists(os.path.join(out, "full", "metrics.json"))
    assert not os.path.exists(os.path.join(out, "full", "heatmap.png"))


def test_demo_shows_the_needle_with_less_memory():
    # `make demo` needs neither torch nor ray: block both
    code = ("import sys; sys.modules['torch'] = sys.modules['ray'] = None\n"
            "from kvpress_c.__main__ import main\nsys.exit(main(['demo']))")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(kvpress_c.__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith(("full cache", "ChunkKV", "TAKE"))]
    assert len(rows) == 3 and all("(correct)" in line for line in rows), r.stdout  # measured: all three correct
    share = [int(line.split("%")[0].split()[-1]) for line in rows]
    assert share[0] == 100 and share[1] < 60 and share[2] < 30, share  # measured: 100, 50, 23


def test_eval_device_flag(tmp_path, default_gguf, capsys):
    # --device reaches the model (emulated: the CUDA path on the CPU, bf16) and config.json; the same
    # folder on another device is another experiment
    from kvpress_c.__main__ import main
    args = ["eval", "niah", "--model", default_gguf, "--press", "full", "--lengths", "300", "--depths", "0.5",
            "--max-new-tokens", "8", "--no-progress", "--out", str(tmp_path)]
    threads = kvpress_c._core.get_num_threads()
    try:
        assert main(args + ["--device", "emulated", "--threads", "1"]) == 0
    finally:
        kvpress_c.set_num_threads(threads)
    cfg = json.load(open(tmp_path / "full" / "config.json"))
    assert cfg["device"] == "emulated" and cfg["model"] == default_gguf
    assert json.load(open(tmp_path / "full" / "metrics.json"))["n_samples"] == 1
    assert main(args) == 2  # cpu now: refused, with the reason on stderr
    assert "differs in device" in capsys.readouterr().err
