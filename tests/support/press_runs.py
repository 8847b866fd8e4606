"""One press run of ours as the parity tests compare it with kvpress: a prefill with the press attached,
the kept positions per (layer, KV head), then greedy decoding on the compressed cache."""
import numpy as np


def rotations(ids, tries=4):
    """The prompt, then it rotated by 37, 74, ... tokens (tries in all): for a test whose check needs a property
    of the random prompt that a few seeds lack (ragged Ada-KV heads, no near-tie selection flip), each a
    different prompt of the same tokens; the test breaks out at the first that has it."""
    for k in range(tries):
        yield np.roll(ids, 37 * k)


def prefill_and_greedy(model, press, ids, n_new=8):
    """-> (kept[layer][kv_head] sets of positions, greedy ids, logits of the prefill and each step, session)."""
    s = model.new_session()
    s.set_press(**press.c_config())
    press.before_prefill(s, len(ids), model.config)
    logits = [s.forward(np.asarray(ids, np.int32), logits="last")]
    s.set_press(None)
    kept = [[set(s.cache_positions(l, h).tolist()) for h in range(model.config["n_kv_heads"])]
            for l in range(model.config["n_layers"])]
    out = []
    for _ in range(n_new):
        out.append(int(np.argmax(logits[-1])))
        logits.append(s.forward(np.array([out[-1]], np.int32)))
    return kept, out, logits, s
