"""Needle retrieval on the embedded default model: a magic number at 4 depths of a ~3k-token haystack,
every method at budgets 128 and 256 (question-agnostic: the question comes after the compressed
context, except TAKE which uses its default probe, the last context tokens).

The floor: SmolLM2-135M answers 4/4 with the full cache. A press keeps the needle when its tokens
survive; with 128-256 of ~3000 tokens (4-8%) and a question it cannot see, the methods that score by
attention keep the needle sentence in most cases, and we assert that each method answers at least
half of the depths at budget 256 and that, across methods, the needle is answered in most runs.
StreamingLLM (recency only) is reported but held to no floor: it keeps the needle only when the needle
sits at the end, which is the point of the baseline."""
import numpy as np
import pytest

import kvpress_c
from kvpress_c.demo import needle_prompt

DEPTHS = [0.1, 0.35, 0.6, 0.85]


def presses(budget):
    k = kvpress_c
    return {
        "SnapKV": k.SnapKVPress(budget=budget, window_size=32, kernel_size=7, pooling="max"),
        "AdaKV": k.AdaKVPress(k.SnapKVPress(budget=budget, window_size=32, kernel_size=7, pooling="max"), safeguard="floor"),
        "ChunkKV": k.ChunkKVPress(k.SnapKVPress(budget=budget, window_size=32), chunk_length=10),
        "EDIE": k.EDIEPress(budget=budget),
        "TADA(EDIE)": k.TADAPress(k.EDIEPress(budget=budget)),
        "PyramidKV": k.PyramidKVPress(budget=budget, window_size=32),
        "TAKE": k.TAKEPress(budget=budget, chunk_size=1024),
        "StreamingLLM": k.StreamingLLMPress(budget=budget),
    }


@pytest.fixture(scope="module")
def prompts(default_model):
    return [needle_prompt(default_model, n_tokens=3000, depth=d, seed=i) for i, d in enumerate(DEPTHS)]


def test_needle_accuracy(default_model, prompts):
    pipe = kvpress_c.Pipeline(default_model)
    full = [answer in pipe(c, question=q, max_new_tokens=24).answer for c, q, answer in prompts]
    print(f"full cache: {sum(full)}/{len(full)}")
    assert sum(full) >= 3, "the full-cache baseline should find the needle"
    table = {}
    for budget in (128, 256):
        for name, press in presses(budget).items():
            hits = [answer in pipe(c, question=q, press=press, max_new_tokens=24).answer for c, q, answer in prompts]
            table[(name, budget)] = sum(hits)
    print("\nneedle accuracy (of 4 depths):")
    for name in presses(128):
        print(f"  {name:<14} budget 128: {table[(name, 128)]}/4   budget 256: {table[(name, 256)]}/4")
    scored = [n for n in presses(128) if n != "StreamingLLM"]
    for name in scored:
        assert table[(name, 256)] >= 2, f"{name} answers fewer than half the depths at budget 256"
    total = sum(table[(n, b)] for n in scored for b in (128, 256))
    assert total >= 0.6 * len(scored) * 2 * 4, f"needle answered in {total} of {len(scored) * 8} runs"
