"""Reuse measured: each context compressed once without its question (query-agnostic), saved, and every
question of that context answered from the saved cache; against compressing per question with the question
in view (query-aware). Contexts with several questions each:

  ruler_multikey    RULER's NIAH on its essay haystack with n key/value needles; each question asks one key
                    (the others are distractors: niah_multikey_1 with every key asked in turn)
  ruler_multiquery  the same contexts; each question asks two keys (niah_multiquery's form, two at a time)
  needles           the needle grid's book prompt with several distinct needle sentences at spread depths;
                    each question asks one (scored by ROUGE-1 recall as the needle benchmark)

    from kvpress_c.eval import reuse
    rows = reuse.run(model, reuse.groups(Pipeline(model), "ruler_multikey", 2000, 3), {"snapkv": press})
    reuse.table(rows)
"""
from __future__ import annotations

import os
import random
import tempfile
import time
from typing import Optional, Sequence

from ..pipeline import Pipeline
from .haystack import TokenCutter, haystack_text
from .metrics import rouge1, string_match_all
from .niah import CONTEXT_TEMPLATE, QUESTION_TEMPLATE
from .ruler import TEMPLATES, _key, _sentence_end, _value

KINDS = ("ruler_multikey", "ruler_multiquery", "needles")

NEEDLES = [  # (needle sentence, question)
    ("The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
     "What is the best thing to do in San Francisco?"),
    ("The secret ingredient of grandmother's soup is a spoonful of smoked paprika and fresh dill.",
     "What is the secret ingredient of grandmother's soup?"),
    ("The lighthouse keeper's favourite book is an old atlas of the northern sea routes.",
     "What is the lighthouse keeper's favourite book?"),
    ("The password to the garden shed is written on a blue tile beside the apple tree.",
     "Where is the password to the garden shed written?"),
]


def _fit(count, budget: int) -> int:
    lo, hi = 1, 2
    while count(hi) <= budget and hi < 1 << 22:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    return lo


def groups(pipe: Pipeline, kind: str, length: int, n_contexts: int, n_needles: int = 4, seed: int = 42,
           haystack: str = "pydoc") -> list[dict]:
    """Contexts of about `length` prompt tokens, each {'id', 'context', 'questions': [{'question',
    'answer_prefix', 'answers', 'max_new_tokens', 'metric'}]}."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    cutter = TokenCutter(pipe.model.tokenizer, haystack_text(haystack))
    out = []
    for i in range(n_contexts):
        rng = random.Random(f"{seed}-{kind}-{length}-{i}")
        out.append(_needles(pipe, cutter, length, i, rng, n_needles) if kind == "needles"
                   else _ruler(pipe, cutter, kind, length, i, rng, n_needles))
    return out


def _insert(hay: str, needles: Sequence[str], depths: Sequence[float]) -> str:
    parts, prev = [], 0
    for d, needle in zip(depths, needles):
        at = _sentence_end(hay, int(d * len(hay)))
        parts += [hay[prev:at].strip(), needle]
        prev = at
    parts.append(hay[prev:].strip())
    return " ".join(p for p in parts if p)


def _ruler(pipe, cutter, kind, length, index, rng, n):
    keys = []
    while len(keys) < n:
        k = _key(rng, "words")
        if k not in keys:
            keys.append(k)
    values = [_value(rng, "numbers") for _ in keys]
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
    rng.shuffle(needles)
    depths = sorted(rng.random() for _ in needles)
    tpl, prefix = TEMPLATES["niah"]
    fmt = {"type_needle_v": "numbers"}
    asks = [[j] for j in range(n)] if kind == "ruler_multikey" else [[j, (j + 1) % n] for j in range(n)]
    query = lambda js: keys[js[0]] if len(js) == 1 else f"{keys[js[0]]}, and {keys[js[1]]}"

    def text(size):
        return tpl.format(context=_insert(cutter.prefix(size), needles, depths), query=query(asks[0]), **fmt)

    def count(size):
        t = text(size)
        cut = t.rfind("\n")
        return sum(len(x) for x in pipe.split_prompt(t[:cut] + "\n", t[cut + 1:], prefix.format(query=query(asks[0]), **fmt)))

    t = text(_fit(count, length - 128))
    cut = t.rfind("\n")
    context = t[:cut] + "\n"
    questions = [{"question": f"What are all the special magic numbers for {query(js)} mentioned in the provided text?",
                  "answer_prefix": prefix.format(query=query(js), **fmt), "answers": [values[j] for j in js],
                  "max_new_tokens": 32, "metric": "all"} for js in asks]
    return {"id": f"{kind}_{length}_{index}", "kind": kind, "context": context, "questions": questions}


def _needles(pipe, cutter, length, index, rng, n):
    chosen = NEEDLES[:n]
    depths = [(j + 0.5) / n for j in range(n)]  # spread over the book

    def context_of(size):
        return CONTEXT_TEMPLATE.format(haystack=_insert(cutter.prefix(size), [s for s, _ in chosen], depths))

    def count(size):
        return sum(len(x) for x in pipe.split_prompt(context_of(size), QUESTION_TEMPLATE.format(question=chosen[0][1])))

    context = context_of(_fit(count, length))
    questions = [{"question": QUESTION_TEMPLATE.format(question=q), "answer_prefix": "", "answers": [s],
                  "max_new_tokens": 32, "metric": "rouge1"} for s, q in chosen]
    return {"id": f"needles_{length}_{index}", "kind": "needles", "context": context, "questions": questions}


def _score(prediction: str, q: dict) -> float:
    if q["metric"] == "rouge1":
        return rouge1(prediction, q["answers"][0])["recall"]
    return string_match_all(prediction, q["answers"])


def run(model, contexts: Sequence[dict], presses: dict, folder: Optional[str] = None) -> list[dict]:
    """For every context and press ({label: press}): the reuse mode (compress once without a question, save,
    answer each question from the file) and the per-question mode (the question in view, query-aware).
    One row per (context, press, mode) with the mean score and the seconds per question: the reuse mode
    counts its compression and save once for all the context's questions (amortised), plus each load and
    answer; the per-question mode counts each prefill and answer."""
    pipe = Pipeline(model)
    folder = folder or tempfile.mkdtemp(prefix="kvc_reuse_")
    rows = []
    for c in contexts:
        nq = len(c["questions"])
        for label, press in presses.items():
            path = os.path.join(folder, f"{c['id']}_{label}.kvc")
            t0 = time.perf_counter()
            comp = pipe.compress(c["context"], press=press)
            comp.save_cache(path)
            comp.release_cache()
            compress_s = time.perf_counter() - t0
            scores, preds, answer_s = [], [], 0.0
            for q in c["questions"]:
                t1 = time.perf_counter()
                res = pipe(question=q["question"], cache=path, answer_prefix=q["answer_prefix"],
                           max_new_tokens=q["max_new_tokens"])
                answer_s += time.perf_counter() - t1
                scores.append(_score(res.answer, q))
                preds.append(res.answer)
            rows.append({"context": c["id"], "kind": c["kind"], "press": label, "mode": "reuse",
                         "score": sum(scores) / nq, "s_per_question": (compress_s + answer_s) / nq,
                         "compress_s": compress_s, "file_bytes": os.path.getsize(path),
                         "kept_tokens": comp.stats["kept_tokens"], "prompt_tokens": comp.stats["prompt_tokens"],
                         "predictions": preds})
            os.remove(path)
            scores, preds, total = [], [], 0.0
            for q in c["questions"]:
                t1 = time.perf_counter()
                res = pipe(c["context"], question=q["question"], press=press, answer_prefix=q["answer_prefix"],
                           max_new_tokens=q["max_new_tokens"], query_aware=True)
                total += time.perf_counter() - t1
                scores.append(_score(res.answer, q))
                preds.append(res.answer)
            rows.append({"context": c["id"], "kind": c["kind"], "press": label, "mode": "per_question",
                         "score": sum(scores) / nq, "s_per_question": total / nq,
                         "kept_tokens": res.stats["kept_tokens"], "prompt_tokens": res.stats["prompt_tokens"],
                         "predictions": preds})
    return rows


def table(rows: Sequence[dict]) -> str:
    """A markdown table: per kind and press, the two modes' mean scores and seconds per question."""
    keys = sorted({(r["kind"], r["press"]) for r in rows}, key=lambda k: (KINDS.index(k[0]), k[1]))
    lines = ["| task | press | score, reuse (no question) | score, per question (question in view) | "
             "s/question, reuse | s/question, per question | time saved per question |",
             "|---|---|---|---|---|---|---|"]
    for kind, press in keys:
        m = {mode: [r for r in rows if (r["kind"], r["press"], r["mode"]) == (kind, press, mode)]
             for mode in ("reuse", "per_question")}
        mean = lambda rs, f: sum(r[f] for r in rs) / len(rs)
        a, b = mean(m["reuse"], "s_per_question"), mean(m["per_question"], "s_per_question")
        lines.append(f"| {kind} | {press} | {100 * mean(m['reuse'], 'score'):.1f} | "
                     f"{100 * mean(m['per_question'], 'score'):.1f} | {a:.2f} | {b:.2f} | {b - a:.2f} s ({1 - a / b:.0%}) |")
    return "\n".join(lines)
