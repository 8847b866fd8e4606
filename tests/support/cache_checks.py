"""Checks shared by the CPU and GPU tests of Session.copy_cache_from."""
import numpy as np

import kvpress_c


def ragged_copy(model, ids):
    """A session compressed by Ada-SnapKV (heads of different lengths) and a copy of it made by
    copy_cache_from, checked to hold the same lengths, positions and next position."""
    cfg = model.config
    src = model.new_session()
    src.set_press(**kvpress_c.AdaKVPress(kvpress_c.SnapKVPress(budget=len(ids) // 3, window_size=8)).c_config())
    src.forward(ids, logits="none")
    src.set_press(None)
    dst = model.new_session()
    dst.copy_cache_from(src)
    assert dst.position == src.position == len(ids)
    np.testing.assert_array_equal(dst.cache_lengths(), src.cache_lengths())
    for l in range(cfg["n_layers"]):
        for h in range(cfg["n_kv_heads"]):
            np.testing.assert_array_equal(dst.cache_positions(l, h), src.cache_positions(l, h))
    return src, dst
