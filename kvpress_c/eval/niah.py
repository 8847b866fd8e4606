"""Needle-in-a-Haystack: one needle sentence at a token depth of a haystack of a given length.

The prompt is the one of the long-context NIAH papers (SnapKV, PyramidKV, Ada-KV code bases):
    context  = "This is a very long story book: <book> {haystack with needle} </book>.\\n"
    question = "Based on the content of the book, Question: {retrieval question}\\nAnswer:"
wrapped in the model's chat template. `length` counts every prompt token (chat wrapping included);
the needle goes at the sentence boundary at or before `depth` of the haystack's tokens. Scored by
ROUGE-1 recall of the needle's words in the answer (F1 kept too).
"""
from __future__ import annotations

from typing import Sequence

from .haystack import TokenCutter, haystack_text, sentence_boundary
from .metrics import rouge1

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
CONTEXT_TEMPLATE = "This is a very long story book: <book> {haystack} </book>.\n"
QUESTION_TEMPLATE = "Based on the content of the book, Question: {question}\nAnswer:"
MAX_NEW_TOKENS = 32


def prompt_tokens(pipeline, context: str, question: str) -> int:
    ctx, q = pipeline.split_prompt(context, question)
    return len(ctx) + len(q)


def make_sample(pipeline, cutter: TokenCutter, length: int, depth: float, needle: str = NEEDLE,
                question: str = QUESTION) -> dict:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    q = QUESTION_TEMPLATE.format(question=question)
    overhead = prompt_tokens(pipeline, CONTEXT_TEMPLATE.format(haystack="\n" + needle + "\n"), q)
    if length <= overhead + 16:
        raise ValueError(f"length {length} is too short: the prompt without haystack takes {overhead} tokens")
    n_hay = length - overhead
    context = ""
    for _ in range(4):  # re-tokenisation at the joins shifts the count by a few tokens: correct it
        hay = cutter.prefix(n_hay)
        cut = len(cutter.tok.decode(cutter.tok.encode(hay)[: int(round(depth * n_hay))]))
        at = sentence_boundary(hay, cut) if 0 < depth < 1 else (0 if depth == 0 else len(hay))
        before, after = hay[:at].rstrip(), hay[at:].lstrip()
        context = CONTEXT_TEMPLATE.format(haystack=(before + "\n" + needle + "\n" + after).strip())
        got = prompt_tokens(pipeline, context, q)
        if got == length:
            break
        n_hay += length - got
    tok = cutter.tok
    hay_tokens = len(tok.encode(before)) + len(tok.encode(after))
    return {
        "id": f"niah_{length}_{int(round(depth * 100)):03d}",
        "context": context, "question": q, "answer_prefix": "", "answers": [needle],
        "max_new_tokens": MAX_NEW_TOKENS, "task": "niah", "chat": True,
        "meta": {"length": length, "depth": depth, "prompt_tokens": got,
                 "needle_depth_tokens": len(tok.encode(before)) / max(1, hay_tokens)},
    }


def samples(pipeline, lengths: Sequence[int], depths: Sequence[float], haystack: str = "pydoc") -> list[dict]:
    cutter = TokenCutter(pipeline.model.tokenizer, haystack_text(haystack))
    return [make_sample(pipeline, cutter, int(n), float(d)) for n in lengths for d in depths]


def score(prediction: str, sample: dict) -> dict:
    r = rouge1(prediction, sample["answers"][0])
    return {"score": r["recall"], "rouge1_recall": r["recall"], "rouge1_f": r["f"]}


def heatmap(rows: Sequence[dict], path: str, title: str = "", key: str = "score") -> str:
    """Save a depth x length heatmap PNG of per-sample scores (rows: {'meta': {length, depth}, key})."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap
    import numpy as np

    lengths = sorted({r["meta"]["length"] for r in rows})
    depths = sorted({r["meta"]["depth"] for r in rows})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for r in rows:
        grid[depths.index(r["meta"]["depth"]), lengths.index(r["meta"]["length"])] = r[key]
    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(lengths), 0.9 + 0.45 * len(depths)))
    im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n // 1000}k" if n % 1000 == 0 else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{int(round(d * 100))}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    mean = float(np.nanmean(grid)) if np.isfinite(grid).any() else float("nan")
    ax.set_title(f"{title}  (mean {mean:.2f})" if title else f"mean {mean:.2f}", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
