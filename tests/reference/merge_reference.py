"""Float64 NumPy references of value merging on eviction, written from kvpress 0.5.5's MergingPress.merge and
CAMPress.compress (docs/METHODS.md, "Value merging on eviction"), and CaM's Bernoulli stream of kvpress_c."""
import numpy as np

EPS = 1e-6
M64 = (1 << 64) - 1


def merge_similar(k, v, keep, threshold=0.0, fraction=1.0):
    """One head: k, v [n, d], keep (increasing) -> the kept rows' values [n_keep, d] after MergingPress's merge."""
    k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    n = len(k)
    keep = np.asarray(keep)
    ev = np.setdiff1d(np.arange(n), keep)
    out = v[keep].copy()
    if len(ev) == 0 or len(keep) == 0:
        return out
    unit = k / np.maximum(np.linalg.norm(k, axis=1, keepdims=True), EPS)
    sim = unit[ev] @ unit[keep].T
    target, best = sim.argmax(axis=1), sim.max(axis=1)
    ok = best >= threshold
    if fraction < 1 and ok.any():
        gated = np.sort(np.where(ok, best, -np.inf))
        pos = (1 - fraction) * (len(ev) - 1)
        lo, hi = int(np.floor(pos)), int(np.ceil(pos))
        w = pos - lo
        with np.errstate(invalid="ignore"):  # torch.lerp's formula, -inf and NaN included
            cut = gated[lo] + w * (gated[hi] - gated[lo]) if w < 0.5 else gated[hi] - (gated[hi] - gated[lo]) * (1 - w)
            ok &= best >= cut
    vn = np.linalg.norm(v, axis=1)
    wgt = np.maximum(best, 0) * ok * vn[ev] / (vn[ev] + vn[keep][target] + EPS)
    acc = np.zeros_like(out)
    wsum = np.zeros(len(keep))
    np.add.at(acc, target, wgt[:, None] * v[ev])
    np.add.at(wsum, target, wgt)
    got = wsum > 0
    out[got] = (out[got] + acc[got]) / (1 + wsum[got, None])
    return out


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def cam_uniform(seed, layer, event, h, j):
    """CAMPress's draw for merge candidate j of KV head h at the layer's event-th merging compression."""
    key = ((layer << 48) ^ (event << 32) ^ (h << 24) ^ j) & M64
    return (_splitmix64(seed ^ _splitmix64(key)) >> 11) * 2.0 ** -53


def cam_uniforms(seed, layer, event, Hkv, m):
    return np.array([[cam_uniform(seed, layer, event, h, j) for j in range(m)] for h in range(Hkv)])


def cam_merge(scores, attn, v, target, n_merge, merge_budget, seed=0, layer=0, event=0):
    """scores, attn [Hkv, n], v [Hkv, n, d] -> (keep [target] increasing, values [Hkv, target, d])."""
    scores, attn, v = (np.asarray(a, np.float64) for a in (scores, attn, v))
    Hkv, n = scores.shape
    mean = scores.mean(axis=0)
    order = np.lexsort((np.arange(n), -mean))  # higher score, then lower row
    keep = np.sort(order[:target])
    ev = order[target:]
    ev = ev[np.lexsort((-ev, -mean[ev]))]  # higher score, then later row
    cand = np.sort(ev[:n_merge])
    u = cam_uniforms(seed, layer, event, Hkv, len(cand))
    out = v[:, keep].copy()
    for j, c in enumerate(cand):
        start = np.searchsorted(keep, c, side="right")
        win = np.arange(start, min(start + merge_budget, target))
        if len(win) == 0:
            continue
        for h in range(Hkv):
            with np.errstate(divide="ignore", invalid="ignore"):
                p = attn[h, c] / attn[h, keep[win]].mean()
            p = 0.0 if np.isnan(p) else 1.0 if np.isinf(p) else min(max(p, 0.0), 1.0)
            if u[h, j] < p:
                out[h, win] += v[h, c] / len(win)
    return keep, out
