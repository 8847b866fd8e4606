"""LongBench (Bai et al., 2023): the 16 English tasks and LongBench-E, from the official jsonl files.

Give the folder holding `<task>.jsonl` (LongBench) or `<task>_e.jsonl` (LongBench-E), as released in
THUDM/LongBench's data.zip. As in the official pred.py/eval.py: the task's prompt template, middle
truncation of the prompt to `max_length` tokens (first and last max_length/2 kept), the chat
template except for trec, triviaqa, samsum, lcc and repobench-p, the task's max new tokens, the
first line only of trec/triviaqa/samsum predictions, the max of the metric over the answers, and for
LongBench-E the mean per length bucket (0-4k, 4-8k, 8k+ words).

For question-agnostic compression the prompt is split at the task's question: everything up to the
end of the context is compressed, the rest is the question (templates without a question part
compress everything).
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from . import metrics as M

PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}
METRIC = {
    "narrativeqa": M.qa_f1, "qasper": M.qa_f1, "multifieldqa_en": M.qa_f1, "hotpotqa": M.qa_f1,
    "2wikimqa": M.qa_f1, "musique": M.qa_f1, "gov_report": M.rouge_l, "qmsum": M.rouge_l,
    "multi_news": M.rouge_l, "trec": M.classification, "triviaqa": M.qa_f1, "samsum": M.rouge_l,
    "passage_count": M.count, "passage_retrieval_en": M.retrieval, "lcc": M.code_sim, "repobench-p": M.code_sim,
}
TASKS = list(PROMPTS)
TASKS_E = ["qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
           "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]
NO_CHAT = {"trec", "triviaqa", "samsum", "lcc", "repobench-p"}
FIRST_LINE = {"trec", "triviaqa", "samsum"}


def base_task(task: str) -> str:
    return task[:-2] if task.endswith("_e") else task


def _split(task: str, prompt: str, item: dict) -> tuple[str, str]:
    """(context part, question part) of a filled prompt: cut right after the context."""
    tpl = PROMPTS[task]
    head, tail = tpl.split("{context}")
    context_part = head.format(**{k: item.get(k, "") for k in ("input",)}) if "{input}" in head else head
    context_part += item["context"]
    if not prompt.startswith(context_part):  # cannot happen for the official templates
        return prompt, ""
    return context_part, prompt[len(context_part):]


def truncate_middle(tokenizer, prompt: str, max_length: int) -> str:
    """LongBench's truncation: keep the first and last max_length/2 tokens of a longer prompt."""
    ids = tokenizer.encode(prompt)
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[-half:])


def load(folder: str, tasks: Sequence[str], max_length: int, tokenizer, limit: Optional[int] = None,
         longbench_e: bool = False) -> list[dict]:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"LongBench folder '{folder}' does not exist: unpack THUDM/LongBench's data.zip "
                                "and pass the folder holding the <task>.jsonl files")
    out = []
    for task in tasks:
        if task not in PROMPTS:
            raise ValueError(f"unknown LongBench task {task!r}; English tasks: {', '.join(TASKS)}")
        if longbench_e and task not in TASKS_E:
            raise ValueError(f"{task} is not part of LongBench-E ({', '.join(TASKS_E)})")
        name = task + ("_e" if longbench_e else "")
        path = os.path.join(folder, name + ".jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found (LongBench{'-E' if longbench_e else ''} file for {task})")
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if limit is not None and i >= limit:
                    break
                item = json.loads(line)
                out.append(make_sample(name, item, max_length, tokenizer, i))
    return out


def make_sample(name: str, item: dict, max_length: int, tokenizer, index: int) -> dict:
    task = base_task(name)
    prompt = PROMPTS[task].format(**item)
    truncated = truncate_middle(tokenizer, prompt, max_length)
    if truncated == prompt:
        context, question = _split(task, prompt, item)
    else:  # the cut falls inside the context: the question part survives at the end
        _, question = _split(task, prompt, item)
        context = truncated[: len(truncated) - len(question)] if question and truncated.endswith(question) else truncated
        question = question if truncated.endswith(question) else ""
    answers = item["answers"] if isinstance(item.get("answers"), list) else [item.get("answers")]
    return {"id": f"{name}_{item.get('_id', index)}", "context": context, "question": question,
            "answer_prefix": "", "answers": [str(a) for a in answers], "all_classes": item.get("all_classes"),
            "max_new_tokens": MAX_NEW_TOKENS[task], "task": name, "chat": task not in NO_CHAT,
            "meta": {"length": item.get("length"), "truncated": truncated != prompt}}


def score(prediction: str, sample: dict) -> dict:
    task = base_task(sample["task"])
    if task in FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRIC[task]
    best = max((fn(prediction, a, all_classes=sample.get("all_classes") or []) for a in sample["answers"]),
               default=0.0)
    return {"score": float(best)}


def length_bucket(sample: dict) -> str:
    n = (sample.get("meta") or {}).get("length") or 0
    return "0-4k" if n < 4000 else "4-8k" if n < 8000 else "8k+"
