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
