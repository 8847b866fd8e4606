"""CapPress (CAPKV) against a float64 NumPy reference on fresh random inputs (tests/reference/
kvpress_scorers_reference.py cap_scores), its settings against kvpress's dataclass, and its errors. Parity with
kvpress on models: test_kvpress_parity.py ("Cap"); the emulated device: tests/device/test_device.py."""
import dataclasses

import numpy as np
import pytest

import kvpress_c
from capi import SCORERS, CError, press_compute, press_config
from kvpress_scorers_reference import cap_scores
from method_reference import topk_rows

CAP = SCORERS["cap"]


@pytest.mark.parametrize("n,past,H,Hkv,d,tau,eps,n_future,n_sink", [
    (120, 0, 4, 2, 16, 5.0, 1e-6, 512, 4), (64, 50, 6, 2, 32, 5.0, 1e-6, 100, 4), (80, 0, 4, 4, 16, 1.0, 0.0, 512, 0),
    (80, 0, 4, 1, 16, 20.0, 0.1, 7, 8)])
def test_cap_matches_reference(rng, n, past, H, Hkv, d, tau, eps, n_future, n_sink):
    q = rng.standard_normal((n, H, d)) * 0.5 + rng.standard_normal((1, H, d))  # a non-zero mean query
    k, v = rng.standard_normal((Hkv, past + n, d)), rng.standard_normal((Hkv, past + n, d))
    cfg = press_config(scorer=CAP, window=0, kernel=1, compression_ratio=0.5, n_future=n_future, n_sink=n_sink,
                       cap_tau=tau, epsilon=eps)
    scores, kept = press_compute(cfg, q, k, v)
    ref = cap_scores(q, k, v, n_sink, n_future, tau, eps)
    # fp32 inputs, float64 arithmetic, fp32 scores: measured max error 6.1e-8 of the largest score (9 draws)
    np.testing.assert_allclose(scores, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    if n_sink:
        assert (scores[:, :n_sink] > scores[:, n_sink:].max()).all(), "the sinks are always kept"
    for h, rows in enumerate(kept):
        want = set(topk_rows(ref[h], (past + n) // 2).tolist())
        cut = np.sort(ref[h])[::-1][(past + n) // 2 - 1]
        assert all(abs(ref[h, r] - cut) <= 1e-5 * np.abs(ref).max() for r in set(rows.tolist()) ^ want)


def test_cap_has_kvpress_names_and_defaults():
    kvpress = pytest.importorskip("kvpress")
    theirs = {f.name: f.default for f in dataclasses.fields(kvpress.CapPress)}
    ours = {f.name: f.default for f in dataclasses.fields(kvpress_c.CapPress)}
    assert {k: v for k, v in ours.items() if k != "budget"} == theirs


def test_cap_errors(rng):
    with pytest.raises(ValueError, match="tau"):
        kvpress_c.CapPress(tau=float("nan"))
    q, k, v = rng.standard_normal((3, 2, 8)), rng.standard_normal((1, 3, 8)), rng.standard_normal((1, 3, 8))
    with pytest.raises(CError, match="n_sink"):
        press_compute(press_config(scorer=CAP, window=0, kernel=1, compression_ratio=0.5, n_sink=4), q, k, v)
