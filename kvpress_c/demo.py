"""A small needle-in-a-haystack prompt for the demo and smoke tests."""
from __future__ import annotations

import random

_FILLER = [
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.",
]


def needle_prompt(model, n_tokens: int = 1000, depth: float = 0.5, seed: int = 0):
    """Return (context, question, answer): a haystack of ~n_tokens with a magic number at `depth`."""
    rng = random.Random(seed)
    number = str(rng.randint(1000000, 9999999))
    needle = f"One of the special magic numbers for the demo is: {number}."
    sentences = []
    while len(model.encode(" ".join(sentences))) < n_tokens:
        sentences.extend(_FILLER)
    sentences.insert(int(len(sentences) * depth), needle)
    context = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n" + " ".join(sentences))
    question = "What is the special magic number for the demo mentioned in the provided text?"
    return context, question, number


def demo_presses():
    """The demo's two presses: ChunkKV over SnapKV removing half the cache, and TAKE keeping 256
    tokens per head (on the default model both still find the needle at 50% depth)."""
    from . import ChunkKVPress, SnapKVPress, TAKEPress
    return {"ChunkKV(SnapKV), 50% removed": ChunkKVPress(SnapKVPress(compression_ratio=0.5), chunk_length=10),
            "TAKE, 256 tokens per head": TAKEPress(budget=256, chunk_size=1024)}


def run_demo(model, n_tokens: int = 1000) -> tuple[dict, list[dict]]:
    """The same needle question answered with the full cache and with each demo press (one shared
    prefill, question-aware). Returns (prompt info, one row per cache: answer, correct, memory)."""
    from .pipeline import Pipeline
    context, question, answer = needle_prompt(model, n_tokens=n_tokens)
    presses = {"full cache": None, **demo_presses()}
    results = Pipeline(model).run_many(context, question, presses=list(presses.values()), max_new_tokens=24,
                                       query_aware=True)
    rows = [{"cache": name, "answer": r.answer.strip(), "correct": answer in r.answer,
             "kept_tokens": r.stats["kept_tokens"], "cache_bytes": r.stats["cache_bytes"],
             "prefill_s": r.stats["prefill_s"], "decode_s": r.stats["decode_s"]}
            for name, r in zip(presses, results)]
    info = {"question": question, "needle": answer, "prompt_tokens": results[0].stats["prompt_tokens"]}
    return info, rows
