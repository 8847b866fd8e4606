"""benchmarks/kv_step_kernels.py, the decode kernels' benchmark: its C driver builds with this machine's compiler
against the engine's kernels (the typed tiles' and the whole decode attention, attention.c with what it calls), each
type and part runs and reports its line, and bad arguments are refused (f32 has the attention alone). The figures are
the benchmark's, not asserted here."""
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import kv_step_kernels  # noqa: E402
from memory_share import c_compiler  # noqa: E402

pytestmark = pytest.mark.skipif(not c_compiler(), reason="no C compiler: the benchmark's driver cannot build")


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return kv_step_kernels.build(ROOT, str(tmp_path_factory.mktemp("kernels") / "kv_step_kernels"))


@pytest.mark.parametrize("t", list(kv_step_kernels.TYPES))
def test_each_type_times_its_parts(exe, t):
    """Each part prints its line (type, keys, part, ns a key, GB/s) and a finite checksum of what it computed, or,
    for a type this build does not read in place (no vector path), says so; f32 has the attention alone."""
    parts = ["attention"] if t == "f32" else list(kv_step_kernels.PARTS)
    for p in parts:
        r = subprocess.run([exe, str(kv_step_kernels.TYPES[t]), "4096", "2", str(kv_step_kernels.PARTS[p])],
                           capture_output=True, text=True)
        assert r.returncode == 0, (t, p, r.stderr)
        if "decodes such tiles" in r.stdout:
            assert t != "f32" and kv_step_kernels.run_once(exe, t, 4096, 2, p) is None
            continue
        name, keys, part, ns, gbs = r.stdout.split()
        assert (name, part) == (t, p) and int(keys) == 4032  # whole tiles in each of the 3 heads
        assert float(ns) > 0 and float(gbs) > 0
        assert math.isfinite(float(r.stderr.split("checksum")[1].strip(" )\n"))), r.stderr
        assert kv_step_kernels.run_once(exe, t, 4096, 2, p) > 0


def test_driver_refuses_bad_arguments(exe):
    r = subprocess.run([exe], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
    for args in (["0", "4096", "2", "0"],  # f32: no typed tiles, the attention alone
                 ["6", "4096", "2", "0"],  # no such type
                 ["3", "4096", "2", "4"],  # no such part
                 ["3", "4096", "0", "0"]):  # no pass
        r = subprocess.run([exe, *args], capture_output=True, text=True)
        assert r.returncode == 2 and "bad arguments" in r.stderr, args
