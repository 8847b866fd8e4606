"""Host memory of loading a model on a device, measured in a fresh process (so nothing loaded before
counts): its peak and final resident memory beyond what it held before the load (VmHWM, VmRSS). The
emulated device's buffers are host memory too; they are subtracted (the backend's own count), so the
figure is what a GPU load would cost the host. Used by tests/device and benchmarks/device_load_memory.py.

    python load_probe.py MODEL_PATH DEVICE    # prints one JSON line
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _probe(path: str, device: str) -> dict:
    import kvpress_c
    before = _status("VmRSS")
    t0 = time.perf_counter()
    m = kvpress_c.load_model(path, device=device)
    seconds = time.perf_counter() - t0
    dev = kvpress_c.memory_stats(device) if device != "cpu" else {"current": 0, "weights": 0}
    own = dev["current"] if device == "emulated" else 0
    return {"device": device, "seconds": seconds, "host_peak_beyond_device": _status("VmHWM") - before - own,
            "host_after_beyond_device": _status("VmRSS") - before - own, "device_bytes": dev["current"],
            "device_weights": dev["weights"], "weight_bytes": m.config["weight_bytes"]}


def measure(path: str, device: str) -> dict:
    """The probe's figures, or {"device", "error"} with the child's last line of stderr."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), path, device], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    if out.returncode != 0:
        return {"device": device, "error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(_probe(sys.argv[1], sys.argv[2])))
