"""Haystack text for the synthetic benchmarks, and cutting text to an exact token count.

Sources (no download needed):
  "noise"   RULER's noise sentences ("The grass is green. The sky is blue. ...") repeated.
  "pydoc"   the prose of Python's own reference manual, which every CPython ships as
            pydoc_data/topics.py (PSF licence); stands in for RULER's Paul Graham essays, which
            are not redistributable. Read once, cleaned to plain sentences.
  a path    any UTF-8 text file you give (e.g. a Project Gutenberg book).
"""
from __future__ import annotations

import os
import re
from functools import lru_cache

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@lru_cache(maxsize=4)
def haystack_text(source: str = "pydoc") -> str:
    if source == "noise":
        return " ".join([NOISE] * 2000)
    if source == "pydoc":
        from pydoc_data import topics
        paragraphs = []
        for text in topics.topics.values():
            for para in re.split(r"\n\s*\n", text):
                line = " ".join(para.split())
                # keep prose: sentences with letters, no code listings or tables
                if len(line) > 80 and line.count(">>>") == 0 and sum(c.isalpha() for c in line) > 0.75 * len(line) \
                        and line.endswith("."):
                    paragraphs.append(line)
        return "\n".join(paragraphs)
    if os.path.exists(source):
        with open(source, encoding="utf-8") as f:
            return " ".join(f.read().split())
    raise ValueError(f"haystack must be 'noise', 'pydoc' or the path of a text file, got {source!r}")


class TokenCutter:
    """Cuts a long text to a prefix of exactly n tokens of a tokenizer (tokenised once)."""

    def __init__(self, tokenizer, text: str):
        self.tok, self.text = tokenizer, text
        self.ids = tokenizer.encode(text)

    def __len__(self) -> int:
        return len(self.ids)

    def prefix(self, n: int) -> str:
        return self.tok.decode(self.ids[:n] if n <= len(self.ids) else self._repeat(n))

    def _repeat(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out.extend(self.ids[: n - len(out)])
        return out


def sentence_boundary(text: str, at: int) -> int:
    """The character offset of the sentence start at or before `at` (after '. ', '? ', '! ' or a
    newline); 0 if there is none."""
    best = 0
    for m in re.finditer(r"[.!?]\s+|\n", text[:at]):
        best = m.end()
    return best
