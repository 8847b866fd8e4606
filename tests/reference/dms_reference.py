"""Float64 NumPy reference of DMSPress's schedule (kvpress 0.5.5 dms_press.py; docs/METHODS.md, "DMSPress")."""
import numpy as np


def dms_reference(call_scores, window, threshold):
    """Kept row indices of one head after calls with these scores (float64 [rows of the call] each), in order:
    the queue of unjudged scores; a row leaving the last `window` is kept iff its score >= threshold."""
    kept, queue = [], []
    row = 0
    for sc in call_scores:
        for s in sc:
            queue.append((row, s))
            row += 1
        while len(queue) > window:
            r, s = queue.pop(0)
            if not s < threshold:
                kept.append(r)
    return kept + [r for r, _ in queue]


def knorm(k):
    """KnormPress's score of each row: -||k||."""
    return -np.linalg.norm(np.asarray(k, np.float64), axis=-1)
