"""benchmarks/memory_share.py, the probe benchmarks/kv_cache_types.py records with its figures: its C driver builds
with this machine's compiler, streams what it is asked and reports it; bad arguments are refused. (Its figures
are the benchmark's, not asserted here.)"""
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
