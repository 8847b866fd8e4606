"""RULER (Hsieh et al., 2024): the 13 synthetic tasks, generated at a token length with the model's
tokenizer, following RULER's task configurations, templates and answer prefixes.

  niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe: generated here
  qa_1 (SQuAD v2 dev json), qa_2 (HotpotQA dev distractor json): read from a path the user gives

As in RULER, `length` is the model's sequence budget: the prompt (chat-wrapped) is built as long as
possible under length - tokens_to_generate. Scoring: string_match_all (every task but QA) and
string_match_part (QA), in [0, 1] per sample (RULER prints x100).

Differences, on purpose: RULER's "essay" haystack is Paul Graham's essays, which cannot ship; the
default here is the prose of Python's reference manual (haystack.py; any text file can be given).
Keys are adjective-noun words from a built-in list (RULER draws them with `wonderwords`).
"""
from __future__ import annotations

import json
import random
import string
import uuid
from typing import Optional

from .haystack import NOISE, TokenCutter, haystack_text
from .metrics import string_match_all, string_match_part

TEMPLATES = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assgined the value {query}, they are: "),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:"),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:"),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
           "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:"),
}
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}

NIAH = {  # RULER's synthetic.yaml
    "niah_single_1": dict(haystack="noise", k="words", v="numbers", n_k=1, n_v=1, n_q=1),
    "niah_single_2": dict(haystack="essay", k="words", v="numbers", n_k=1, n_v=1, n_q=1),
    "niah_single_3": dict(haystack="essay", k="words", v="uuids", n_k=1, n_v=1, n_q=1),
    "niah_multikey_1": dict(haystack="essay", k="words", v="numbers", n_k=4, n_v=1, n_q=1),
    "niah_multikey_2": dict(haystack="needle", k="words", v="numbers", n_k=1, n_v=1, n_q=1),
    "niah_multikey_3": dict(haystack="needle", k="uuids", v="uuids", n_k=1, n_v=1, n_q=1),
    "niah_multivalue": dict(haystack="essay", k="words", v="numbers", n_k=1, n_v=4, n_q=1),
    "niah_multiquery": dict(haystack="essay", k="words", v="numbers", n_k=4, n_v=1, n_q=4),
}
TASKS = list(NIAH) + ["vt", "cwe", "fwe", "qa_1", "qa_2"]

_ADJ = ("able acid angry bitter brave bright broad calm cheap clean clever cold cool cruel dark dear deep dry "
        "early eager empty equal fair fancy fast fierce firm flat fresh gentle glad grand green happy hard heavy "
        "high hollow huge humble icy jolly kind large late lazy little lively long loud lucky mad mild modern "
        "narrow neat new nice noisy odd old pale plain polite poor proud quick quiet rapid rare raw rich rough "
        "round royal rude sad safe salty sharp shiny short shy silly slow small smooth soft sour spicy steep "
        "sticky strange strict strong sweet swift tall tame tender thick thin tidy tiny tough vast warm weak "
        "wet white wide wild wise young").split()
_NOUN = ("anchor apple arrow badge bakery banner basket beach berry bicycle blanket bottle bridge bucket cabin "
         "camera candle canyon carpet castle cellar chair cherry circle cloud comet copper cottage crayon crystal "
         "desert diamond dragon drum eagle engine falcon feather fiddle forest fountain garden glacier guitar "
         "hammer harbor helmet island jacket jungle kettle kitten ladder lantern lemon library lizard magnet "
         "marble meadow mirror monkey mountain needle ocean orchard paddle parrot pencil piano pillow planet "
         "pocket pumpkin puzzle quilt rabbit ribbon river rocket saddle satchel shadow shelf shovel spider "
         "spoon statue tablet teapot thunder ticket tiger tower tractor trumpet tunnel umbrella valley violin "
         "wagon walnut whistle window wizard").split()
_CWE_WORDS = sorted({a for a in _ADJ} | {n for n in _NOUN})


def _key(rng: random.Random, kind: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuids" else \
        f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"


def _value(rng: random.Random, kind: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuids" else str(rng.randint(10**6, 10**7 - 1))


class Generator:
    """Builds samples of one model's tokenizer and chat template (through a Pipeline)."""

    def __init__(self, pipeline, essay: str = "pydoc", squad: Optional[str] = None, hotpotqa: Optional[str] = None):
        self.pipe = pipeline
        self.tok = pipeline.model.tokenizer
        self.essay = TokenCutter(self.tok, haystack_text(essay))
        self.qa_paths = {"qa_1": squad, "qa_2": hotpotqa}
        self._qa_cache: dict = {}

    # -- length fitting ---------------------------------------------------------------------------------
    def _count(self, task: str, context: str, query: str, fmt: dict) -> int:
        tpl, prefix = TEMPLATES[task]
        text = tpl.format(context=context, query=query, **fmt)
        ctx, q = self.pipe.split_prompt(text, "", prefix.format(query=query, **fmt))
        return len(ctx) + len(q)

    def _fit(self, build, budget: int) -> int:
        """Largest size s with build(s) tokens <= budget (build is increasing in s)."""
        lo, hi = 1, 2
        while build(hi) <= budget:
            lo, hi = hi, hi * 2
            if hi > 1 << 22:
                break
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if build(mid) <= budget:
                lo = mid
            else:
                hi = mid
        return lo

    def _top_up(self, context: str, extra: str, count, budget: int) -> str:
        """Append the longest token prefix of `extra` that keeps the prompt within budget."""
        ids = self.tok.encode(extra)
        k = self._fit(lambda n: count(context + self.tok.decode(ids[:n])) if n <= len(ids) else budget + 1,
                      budget) if count(context + self.tok.decode(ids[:1])) <= budget else 0
        return context + self.tok.decode(ids[:k]) if k else context

    # -- tasks ---------------------------------------------------------------------------------------------
    def sample(self, task: str, length: int, index: int, seed: int = 42) -> dict:
        if task not in TASKS:
            raise ValueError(f"unknown RULER task {task!r}; tasks: {', '.join(TASKS)}")
        rng = random.Random(f"{seed}-{task}-{length}-{index}")
        if task in NIAH:
            return self._niah(task, length, index, rng)
        return getattr(self, "_" + task.split("_")[0])(task, length, index, rng)

    def _pack(self, task, family, length, index, context, query, fmt, answers, metric, meta=None) -> dict:
        tpl, prefix = TEMPLATES[family]
        text = tpl.format(context=context, query=query, **fmt)
        # context part = everything up to the question (RULER's query line), question = the rest
        cut = text.rfind("\n") if family != "qa" else text.rfind("\n\nAnswer the question based on the given documents")
        ctx_text, question = text[:cut], text[cut:].lstrip("\n") if family != "qa" else text[cut + 2:]
        n = sum(len(x) for x in self.pipe.split_prompt(ctx_text + "\n", question, prefix.format(query=query, **fmt)))
        return {"id": f"{task}_{length}_{index}", "context": ctx_text + "\n", "question": question,
                "answer_prefix": prefix.format(query=query, **fmt), "answers": answers,
                "max_new_tokens": TOKENS_TO_GENERATE[family], "task": task, "chat": True, "metric": metric,
                "meta": {"length": length, "prompt_tokens": n, **(meta or {})}}

    def _niah(self, task, length, index, rng):
        c = NIAH[task]
        keys = []
        while len(keys) < c["n_k"]:
            k = _key(rng, c["k"])
            if k not in keys:
                keys.append(k)
        values = [[_value(rng, c["v"]) for _ in range(c["n_v"])] for _ in keys]
        type_v = "numbers" if c["v"] == "numbers" else "uuids"
        needles = [f"One of the special magic {type_v} for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        queried = list(range(c["n_q"]))
        query = keys[0] if c["n_q"] == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
        answers = [v for qi in queried for v in values[qi]]
        fmt = {"type_needle_v": type_v}
        budget = length - TOKENS_TO_GENERATE["niah"]
        n_needles = len(needles)
        depths = sorted(rng.random() for _ in range(n_needles))
        distractor_rng_state = rng.getstate()

        def build(size: int) -> str:
            if c["haystack"] == "essay":
                hay, parts, prev = self.essay.prefix(size), [], 0
                for d, needle in zip(depths, needles):
                    at = _sentence_end(hay, int(d * len(hay)))
                    parts += [hay[prev:at].strip(), needle]
                    prev = at
                parts.append(hay[prev:].strip())
                return " ".join(p for p in parts if p)
            if c["haystack"] == "noise":
                units = [NOISE] * size
            else:  # a haystack of distractor needles with other keys
                r = random.Random()
                r.setstate(distractor_rng_state)
                units = []
                while len(units) < size:
                    k = _key(r, c["k"])
                    if k not in keys:
                        units.append(f"One of the special magic {type_v} for {k} is: {_value(r, c['v'])}.")
            for d, needle in sorted(zip(depths, needles), reverse=True):
                units.insert(int(d * size), needle)
            return " ".join(units)

        size = self._fit(lambda s: self._count("niah", build(s), query, fmt), budget)
        context = build(size)
        if c["haystack"] != "essay":  # whole units are coarse (a uuid needle is ~40 tokens): top up
            extra = build(size + 1)[len(context):] if c["haystack"] == "needle" else " " + NOISE
            context = self._top_up(context, extra, lambda t: self._count("niah", t, query, fmt), budget)
        return self._pack(task, "niah", length, index, context, query, fmt, answers, "all",
                          {"n_needles": n_needles})

    def _vt(self, task, length, index, rng, num_chains: int = 1, num_hops: int = 4):
        names = set()

        def var():
            while True:
                v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
                if v not in names:
                    names.add(v)
                    return v
        value = str(rng.randint(10000, 99999))
        chain = [var() for _ in range(num_hops + 1)]
        statements = [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[i]} = VAR {chain[i - 1]} ." for i in range(1, len(chain))]
        positions = sorted(rng.random() for _ in statements)
        fmt = {"num_v": len(chain)}
        budget = length - TOKENS_TO_GENERATE["vt"]

        def build(size: int) -> str:
            units = [NOISE] * size
            for p, st in sorted(zip(positions, statements), reverse=True):
                units.insert(int(p * size), st)
            # statements must stay in chain order: positions are sorted and inserted back to front
            return "\n".join(units)

        size = self._fit(lambda s: self._count("vt", build(s), value, fmt), budget)
        context = self._top_up(build(size), "\n" + NOISE, lambda t: self._count("vt", t, value, fmt), budget)
        return self._pack(task, "vt", length, index, context, value, fmt, chain, "all")

    def _cwe(self, task, length, index, rng, freq_cw: int = 30, freq_ucw: int = 3, num_cw: int = 10):
        words = list(_CWE_WORDS)
        rng.shuffle(words)
        common, rest = words[:num_cw], words[num_cw:]
        budget = length - TOKENS_TO_GENERATE["cwe"]
        order_seed = rng.random()

        def build(n_ucw: int, freq: int) -> str:
            # uncommon words beyond the built-in list get a numeric suffix (distinct tokens)
            uncommon = [rest[i % len(rest)] + ("" if i < len(rest) else str(i // len(rest))) for i in range(n_ucw)]
            lst = common * freq + uncommon * freq_ucw
            random.Random(order_seed).shuffle(lst)
            return "\n".join(f"{i + 1}. {w}" for i, w in enumerate(lst))

        # short lengths cannot hold 10 words x 30: lower the common frequency until they fit
        while freq_cw > freq_ucw + 1 and self._count("cwe", build(1, freq_cw), "", {}) > budget:
            freq_cw = max(freq_ucw + 1, int(freq_cw * 0.8))
        size = self._fit(lambda s: self._count("cwe", build(s, freq_cw), "", {}), budget)
        return self._pack(task, "cwe", length, index, build(size, freq_cw), "", {}, common, "all",
                          {"freq_cw": freq_cw})

    def _fwe(self, task, length, index, rng, alpha: float = 2.0):
        import numpy as np
        budget = length - TOKENS_TO_GENERATE["fwe"]
        vocab = ["...."]
        while len(vocab) < 400:
            w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.choice([3, 4, 5, 6])))
            if w not in vocab:
                vocab.append(w)
        nrng = np.random.default_rng(rng.getrandbits(32))
        draws = nrng.zipf(alpha, size=200000)
        draws = draws[draws <= len(vocab)] - 1

        def build(n: int) -> str:
            return " ".join(vocab[i] for i in draws[:n])

        size = self._fit(lambda s: self._count("fwe", build(s), "", {}), budget)
        counts = np.bincount(draws[:size], minlength=len(vocab))
        counts[0] = -1  # the dots are ignored
        top = [vocab[i] for i in np.argsort(-counts, kind="stable")[:3]]
        return self._pack(task, "fwe", length, index, build(size), "", {}, top, "all")

    def _qa(self, task, length, index, rng):
        data = self._qa_data(task)
        q = data[index % len(data)]
        others = [d for i, d in enumerate(data) if i != index % len(data)]
        pool = [p for d in others for p in d["paragraphs"]]
        random.Random(rng.random()).shuffle(pool)
        budget = length - TOKENS_TO_GENERATE["qa"]

        def build(n_extra: int) -> str:
            docs = list(q["paragraphs"]) + pool[:n_extra]
            random.Random(index).shuffle(docs)
            return "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))

        n = self._fit(lambda s: self._count("qa", build(min(s, len(pool))), q["question"], {}), budget) \
            if self._count("qa", build(1), q["question"], {}) <= budget else 0
        return self._pack(task, "qa", length, index, build(min(n, len(pool))), q["question"], {}, q["answers"], "part")

    def _qa_data(self, task: str) -> list[dict]:
        if task in self._qa_cache:
            return self._qa_cache[task]
        path = self.qa_paths[task]
        if not path:
            raise ValueError(f"{task} needs the {'SQuAD v2 dev' if task == 'qa_1' else 'HotpotQA dev distractor'} "
                             f"json: pass {'squad=' if task == 'qa_1' else 'hotpotqa='}PATH (CLI: "
                             f"--{'squad' if task == 'qa_1' else 'hotpotqa'} PATH)")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        out = []
        if task == "qa_1":  # SQuAD: {"data": [{"paragraphs": [{"context", "qas": [{"question", "answers"}]}]}]}
            for art in raw["data"]:
                for para in art["paragraphs"]:
                    for qa in para["qas"]:
                        answers = [a["text"] for a in qa.get("answers", [])]
                        if answers and not qa.get("is_impossible", False):
                            out.append({"question": qa["question"], "answers": answers,
                                        "paragraphs": [para["context"]]})
        else:  # HotpotQA: [{"question", "answer", "context": [[title, [sentences]]]}]
            for item in raw:
                out.append({"question": item["question"], "answers": [item["answer"]],
                            "paragraphs": [f"{t}\n{''.join(s)}" for t, s in item["context"]]})
        if not out:
            raise ValueError(f"{path} holds no usable question")
        self._qa_cache[task] = out
        return out


def _sentence_end(text: str, at: int) -> int:
    """Offset just after the last '. ' at or before `at` (0 if none)."""
    i = text.rfind(". ", 0, at + 1)
    return 0 if i < 0 else i + 1


def score(prediction: str, sample: dict) -> dict:
    fn = string_match_part if sample.get("metric") == "part" else string_match_all
    return {"score": fn(prediction, sample["answers"])}


def samples(pipeline, tasks, length: int, n_samples: int, seed: int = 42, essay: str = "pydoc",
            squad: Optional[str] = None, hotpotqa: Optional[str] = None) -> list[dict]:
    gen = Generator(pipeline, essay=essay, squad=squad, hotpotqa=hotpotqa)
    return [gen.sample(t, length, i, seed) for t in tasks for i in range(n_samples)]
