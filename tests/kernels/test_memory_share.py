"""benchmarks/memory_share.py, the probe benchmarks/kv_cache_types.py records with its figures: its C driver builds
with this machine's compiler, streams what it is asked and reports it; bad arguments are refused; the bytes' floor
that kv_cache_types.py sets beside each type, and its tables. (The figures are the benchmark's, not asserted
here.)"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import memory_share  # noqa: E402

pytestmark = pytest.mark.skipif(not memory_share.c_compiler(),
                                reason="no C compiler: the probe is skipped as kv_cache_types.py skips it")


def test_probe_streams_and_reports(tmp_path):
    exe = memory_share.build(str(tmp_path))
    alone = memory_share.run_once(exe, 8, 0)
    mixed = memory_share.run_once(exe, 8, 4)
    assert alone["weights_gbs"] > 0 and alone["kv_gbs"] == 0 and alone["step_ms"] > 0
    assert mixed["weights_gbs"] > 0 and mixed["kv_gbs"] > 0 and mixed["step_ms"] > 0
    # the step holds the K/V's own time: its bytes (4 MB cut to whole pages per layer) at its reported rate
    kv_bytes = 4 * 2**20 // 30 // 4096 * 4096 * 30
    assert mixed["step_ms"] * 1e-3 >= kv_bytes / (mixed["kv_gbs"] * 1e9) * 0.999
    cases = memory_share.probe(kv_mbs=(0, 4), exe=exe)
    assert set(cases) == {"weights alone", "with 4 MB of K/V", "memory (512 MB)"}


def test_driver_refuses_missing_arguments(tmp_path):
    exe = memory_share.build(str(tmp_path))
    r = subprocess.run([exe], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_bytes_floor_sets_each_type_beside_its_bytes(tmp_path):
    """kv_cache_types.py's floor: the synthetic step over each type's K/V rows (store bytes less the int64
    positions), the ratio to f32's those bytes allow, and the share of it the measured ratio reaches."""
    import kv_cache_types
    exe = memory_share.build(str(tmp_path))
    cfg = {"n_kv_heads": 3, "n_layers": 30, "weight_bytes": 8 << 20}
    n = 4096  # f32: (1560 - 24) B x 4096 x 30 = 180 MiB of K/V; f16 90; kivi4 ~27
    table = {"f32": {"bytes_per_token_layer": 1560.0, "x_f32": 1.0},
             "f16": {"bytes_per_token_layer": 792.0, "x_f32": 1.4},
             "kivi4": {"bytes_per_token_layer": 265.5, "x_f32": 2.1}}
    kv_cache_types.bytes_floor(table, n, cfg, exe)
    assert abs(table["f32"]["kv_mb_a_step"] - 180.0) < 1e-9 and abs(table["f16"]["kv_mb_a_step"] - 90.0) < 1e-9
    for t, r in table.items():
        assert r["floor_ms"] > 0
        assert abs(r["bytes_ceiling"] - table["f32"]["floor_ms"] / r["floor_ms"]) < 1e-12
        assert abs(r["of_ceiling"] - r["x_f32"] / r["bytes_ceiling"]) < 1e-12
    assert table["f32"]["bytes_ceiling"] == 1.0
    # the floor holds the K/V's bytes: 180 MiB cannot stream in less than it takes at 1 TB/s (a bound no CPU
    # here reaches; the figures themselves are the benchmark's, not asserted)
    assert table["f32"]["floor_ms"] > 180 * 2**20 / 1e12 * 1e3


def test_tables_print_results_with_and_without_floors(capsys):
    """kv_cache_types.print_tables reads the committed results: older files (no floor) print without the floor's
    table, newer ones with it, a cell per type and context."""
    import json

    import kv_cache_types
    results = os.path.join(ROOT, "benchmarks", "results")
    for name, floors in (("kv_cache_types_8k_l3_105mb.json", False), ("kv_cache_types_l3_480mb.json", True)):
        with open(os.path.join(results, name)) as f:
            res = json.load(f)
        kv_cache_types.print_tables(res)
        out = capsys.readouterr().out
        assert ("The bytes' floor" in out) == floors, name
        for t in res["formula_bytes_per_token_layer"]:
            row = [line for line in out.splitlines() if line.startswith(f"| {t} |") and "(" in line]
            assert row, (name, t)
        if floors:
            r = res["decode"]["8192"]["f16"]
            assert f"{1e3 / r['cpu_median']:.1f} / {r['floor_ms']:.1f} ms" in out


def test_decode_runs_time_each_step_and_settle(tmp_path, capsys, monkeypatch):
    """kv_cache_types.py on a short context: each run's steps are timed alone and kept, the run's figures and the
    settled ones (a run's first --settle steps left out) are those step times' own, and a --settle that leaves
    no step to time is refused."""
    import json

    import kv_cache_types
    import kvpress_c
    monkeypatch.setattr(kv_cache_types.memory_share, "build", lambda *a, **k: None)  # no probe: not what is tested
    out = tmp_path / "kv.json"
    steps, settle, repeat = 4, 1, 2
    threads = kvpress_c._core.get_num_threads()
    try:
        kv_cache_types.main(["--contexts", "64", "--steps", str(steps), "--settle", str(settle), "--repeat",
                             str(repeat), "--types", "f32", "q8_0", "--prefill", "--cache-dir", str(tmp_path),
                             "--out", str(out)])
    finally:
        kvpress_c.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert res["settle"] == settle
    for t in ("f32", "q8_0"):
        r = res["decode"]["64"][t]
        assert len(r["step_ms"]) == repeat and all(len(run) == steps for run in r["step_ms"])
        for run, tok_s, settled in zip(r["step_ms"], r["cpu_tok_s"], r["settled_tok_s"]):
            assert all(ms > 0 for ms in run)
            # step times are rounded to the microsecond in the file: at most 0.5 us a step of milliseconds
            assert tok_s == pytest.approx(steps / (sum(run) / 1e3), rel=1e-3, abs=0)
            assert settled == pytest.approx((steps - settle) / (sum(run[settle:]) / 1e3), rel=1e-3, abs=0)
        assert r["settled_median"] == pytest.approx(sorted(r["settled_tok_s"])[0] / 2 + sorted(r["settled_tok_s"])[1] / 2)
    f32, q8 = res["decode"]["64"]["f32"], res["decode"]["64"]["q8_0"]
    assert f32["x_f32_settled"] == 1.0
    ratios = sorted(a / b for a, b in zip(q8["settled_tok_s"], f32["settled_tok_s"]))
    assert q8["x_f32_settled"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert "The same runs without each run's first 1 step (" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        kv_cache_types.main(["--contexts", "64", "--steps", "4", "--settle", "4", "--out", str(tmp_path / "no.json")])
    assert not (tmp_path / "no.json").exists()
