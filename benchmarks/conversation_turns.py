"""Conversation turns over a compressed cache (issue 29): the same turns with every kind of press, compress="new"
(each turn's rows) and "all" (the whole cache again), against the uncompressed conversation run in the same process:
rows and bytes the cache holds after each turn, seconds per turn (prefill with the press's compression, decode),
whether the last answer recalls a number the first turn gave, and the saved file's size with the press's state.

    python benchmarks/conversation_turns.py --turns 5 --out benchmarks/results/conversation_turns.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FACTS = ("The red warehouse on Pier {i} stores {n} crates of tea, counted by a clerk named Ida every morning. ",
         "Ships from Lisbon unload copper wire at dock {i}; the harbour master logs {n} tons a week. ",
         "On Tuesdays the ferry {i} carries {n} passengers to the island, most of them fishermen and teachers. ")


def turns(n_turns: int, sentences: int) -> list[str]:
    out = []
    for t in range(n_turns):
        body = "".join(FACTS[(t + k) % 3].format(i=t * 10 + k, n=100 + 37 * t + k) for k in range(sentences))
        out.append(f"Note {t + 1} of my harbour log. {body}Please keep this in mind.")
    out[-1] += " Now tell me: how many crates of tea does the warehouse on Pier 0 store?"
    return out


def presses(budget: int, ratio: float) -> dict:
    import kvpress_c as K
    return {"none": (lambda: None, "new"),
            "snapkv_new": (lambda: K.SnapKVPress(compression_ratio=ratio), "new"),
            "snapkv_all": (lambda: K.SnapKVPress(budget=budget), "all"),
            "take_new": (lambda: K.TAKEPress(budget=budget // 2, chunk_size=256), "new"),
            "take_all": (lambda: K.TAKEPress(budget=budget, chunk_size=256), "all"),
            "kvzip_new": (lambda: K.KVzipPress(compression_ratio=ratio), "new"),
            "kvzip_all": (lambda: K.KVzipPress(compression_ratio=ratio / 2), "all"),
            "kvgrad_new": (lambda: K.KVgradPress(compression_ratio=ratio), "new")}


def run(model, name, make, mode, texts, max_new):
    import kvpress_c
    conv = kvpress_c.Conversation(model, press=make(), compress=mode, max_new_tokens=max_new)
    per_turn = []
    for text in texts:
        t0 = time.perf_counter()
        answer = conv(text)
        lt = conv.last_turn
        per_turn.append({"prompt_tokens": lt["prompt_tokens"], "rows": lt["cache_rows"], "bytes": lt["cache_bytes"],
                         "prefill_s": lt["prefill_s"], "decode_s": lt["decode_s"], "turn_s": time.perf_counter() - t0,
                         "compressed": lt["compressed"]})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.kvc")
        t0 = time.perf_counter()
        conv.save(path)
        save_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        t0 = time.perf_counter()
        kvpress_c.Conversation.load(model, path, press=make())
        load_s = time.perf_counter() - t0
    return {"press": name, "mode": mode, "turns": per_turn, "last_answer": answer, "recalled": "100" in answer,
            "file_bytes": size, "save_s": save_s, "load_s": load_s}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--sentences", type=int, default=6, help="facts per turn (about 30 tokens each)")
    ap.add_argument("--budget", type=int, default=256, help="rows per KV head kept by the budget presses")
    ap.add_argument("--ratio", type=float, default=0.5, help="compression ratio of the ratio presses")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--presses", nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import kvpress_c
    if args.threads:
        kvpress_c.set_num_threads(args.threads)
    model = kvpress_c.load_model()
    load = [os.getloadavg()]  # seconds compare only on a quiet machine: the load says how quiet it was
    texts = turns(args.turns, args.sentences)
    table = presses(args.budget, args.ratio)
    rows = []
    for name in args.presses or list(table):
        make, mode = table[name]
        rows.append(run(model, name, make, mode, texts, args.max_new_tokens))
    base = next((r for r in rows if r["press"] == "none"), None)
    print(f"{'press':<12} {'rows':>7} {'MB':>7} {'x mem':>6} {'turn s':>7} {'x time':>6} {'file MB':>8} recalled")
    for r in rows:
        last, tot = r["turns"][-1], sum(t["turn_s"] for t in r["turns"])
        mem = last["bytes"] / base["turns"][-1]["bytes"] if base else float("nan")
        tim = tot / sum(t["turn_s"] for t in base["turns"]) if base else float("nan")
        r["memory_vs_none"], r["time_vs_none"] = mem, tim
        print(f"{r['press']:<12} {last['rows']:>7} {last['bytes'] / 2**20:>7.2f} {mem:>6.2f} {tot:>7.2f} {tim:>6.2f} "
              f"{r['file_bytes'] / 2**20:>8.2f} {r['recalled']}")
    load.append(os.getloadavg())
    print(f"load average (1, 5, 15 min) at the start {load[0]}, at the end {load[1]} on {os.cpu_count()} cores")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "model": model.path, "load_average": load, "cores": os.cpu_count(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
