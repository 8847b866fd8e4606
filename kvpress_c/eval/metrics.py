"""Scoring functions of the benchmarks, written from their official definitions.

Every function takes (prediction, reference, ...) strings and returns a float in [0, 1]; the
benchmark modules pick which one applies to each task and how several references combine.

- RULER: string_match_all / string_match_part (case-insensitive substring tests).
- LongBench (THUDM/LongBench metrics.py semantics, English tasks): qa_f1 (SQuAD normalisation),
  rouge_l (the `rouge` package's summary-level ROUGE-L F, which LongBench calls), classification,
  count, retrieval, code_sim (fuzzywuzzy's ratio; LongBench installs fuzzywuzzy without
  python-Levenshtein, so it is difflib's SequenceMatcher rounded to an integer percent).
- Needle-in-a-Haystack: ROUGE-1 recall and F1 of the needle's words in the answer.
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Sequence

# -- RULER --------------------------------------------------------------------------------------------

def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references found (case-insensitively) in the prediction."""
    if not references:
        return 0.0
    p = prediction.lower()
    return sum(1.0 for r in references if r.lower() in p) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1 if any reference is found (case-insensitively) in the prediction."""
    p = prediction.lower()
    return float(any(r.lower() in p for r in references))


# -- LongBench ----------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation, drop articles, collapse white space."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _token_f1(pred_tokens: Sequence[str], ref_tokens: Sequence[str]) -> float:
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_) -> float:
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def _lcs_words(x: list[str], y: list[str]) -> set[str]:
    """Words of one longest common subsequence of x and y, traced back the way the `rouge` package
    does (prefer moving along y on ties), as a set (its default `exclusive` mode)."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        xi, row, prev = x[i - 1], table[i], table[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if xi == y[j - 1] else max(prev[j], row[j - 1])
    out, i, j = set(), n, m
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            out.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def _rouge_sentences(text: str) -> list[str]:
    return [" ".join(part.split()) for part in text.split(".") if len(part) > 0]


def rouge_l(prediction: str, reference: str, **_) -> float:
    """Summary-level ROUGE-L F1 as the `rouge` package (1.0.1) computes it with its defaults:
    sentences split at '.', words split at single spaces, unique words counted, the union of the
    LCS words of each reference sentence against every predicted sentence. Empty input scores 0,
    as LongBench's try/except makes it."""
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(reference)
    if not hyp or not ref:
        return 0.0
    hyp_words = [s.split(" ") for s in hyp]
    m = len({w for s in ref for w in s.split(" ")})
    n = len({w for s in hyp_words for w in s})
    union: set[str] = set()
    llcs = 0
    for r in ref:
        rw = r.split(" ")
        before = len(union)
        for hw in hyp_words:
            union |= _lcs_words(rw, hw)
        llcs += len(union) - before
    r_lcs, p_lcs = llcs / m, llcs / n
    return 2.0 * (p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8)


def classification(prediction: str, reference: str, all_classes: Sequence[str] = (), **_) -> float:
    """1/k if the reference is among the k class names found in the prediction (a class that is a
    strict substring of the reference does not count)."""
    matches = [c for c in all_classes if c in prediction]
    # LongBench removes from the list while iterating over it, which skips the element after each
    # removal; reproduce that so scores match the official ones exactly
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in reference and term != reference:
            matches.pop(i)
            i += 1  # the skipped element
        else:
            i += 1
    return 1.0 / len(matches) if reference in matches else 0.0


def count(prediction: str, reference, **_) -> float:
    """Share of the numbers in the prediction that equal the reference count."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for x in numbers if x == str(reference)) / len(numbers)


def retrieval(prediction: str, reference: str, **_) -> float:
    """Share of the numbers in the prediction that equal the paragraph number of the reference
    ('Paragraph 12')."""
    found = re.findall(r"Paragraph (\d+)", reference)
    if not found:
        return 0.0
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for x in numbers if x == found[0]) / len(numbers)


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy.fuzz.ratio without python-Levenshtein: round(100 * SequenceMatcher ratio); equal
    strings (even empty ones) score 100, otherwise an empty string scores 0."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim(prediction: str, reference: str, **_) -> float:
    """Similarity of the first prediction line that is not a comment or a code fence."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, reference) / 100


# -- Needle-in-a-Haystack -----------------------------------------------------------------------------

def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def rouge1(prediction: str, reference: str) -> dict:
    """ROUGE-1 recall, precision and F1 over lower-cased alphanumeric words (clipped counts)."""
    p, r = Counter(_words(prediction)), Counter(_words(reference))
    overlap = sum((p & r).values())
    recall = overlap / max(1, sum(r.values()))
    precision = overlap / max(1, sum(p.values()))
    f = 0.0 if overlap == 0 else 2 * precision * recall / (precision + recall)
    return {"recall": recall, "precision": precision, "f": f}
