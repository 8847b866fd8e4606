"""Critical-KV hit rate of Judge Q against SnapKV window queries on held-out prompts (the Judge Q paper's
diagnostic): for each prompt, the oracle keeps what the model's own response attends to (ResponseGuidedPress,
the response = its greedy continuation with the full cache); hit rate = |kept & oracle| / |oracle| at the
same budget, mean over layers and KV heads, then over prompts.

    python benchmarks/judgeq_hit_rate.py [--soft FILE.npy] [--samples 32] [--budgets 64 128 256]

Held-out prompts: the "test" split of kvpress_c.judgeq.stdlib_corpus (stdlib modules disjoint from the
training split), texts cut to --max-text-tokens tokens, prompt = the first 90 %, response = the greedy
continuation (--response-tokens, not truncated). Methods: Judge Q with the trained soft tokens, Judge Q
with the untrained initialisation of the same run (random, seed 0: what training adds), SnapKV with a
window of --window prompt tokens (= n_soft). All: avg pooling kernel 5, GQA mean, uniform budget.
Writes benchmarks/results/judgeq_hit_rate.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF / HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--soft", default=None, help="trained soft tokens (default: the file JudgeQPress.default_for finds)")
    ap.add_argument("--init-seed", type=int, default=0, help="seed of the untrained random initialisation compared")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-text-tokens", type=int, default=640)
    ap.add_argument("--chunk-chars", type=int, default=3000)
    ap.add_argument("--response-tokens", type=int, default=48)
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--dataset", default=os.path.join(HERE, "results", "judgeq_heldout.jsonl"),
                    help="cache of the built held-out samples (built when missing)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "judgeq_hit_rate.json"))
    args = ap.parse_args(argv)

    import kvpress_c
    from kvpress_c import judgeq
    from kvpress_c.presses.judgeq import JudgeQPress, load_soft_embeddings

    model = kvpress_c.load_model(args.model)
    soft = load_soft_embeddings(args.soft) if args.soft else JudgeQPress.default_for(model).soft_embeddings
    init = judgeq.init_soft(model, soft.shape[0], "random", np.random.default_rng(args.init_seed))
    t0 = time.perf_counter()
    if os.path.exists(args.dataset):
        samples = judgeq.load_dataset(args.dataset)[:args.samples]
    else:
        texts = judgeq.stdlib_corpus("test", chunk_chars=args.chunk_chars)
        samples = judgeq.build_dataset(model, texts, max_samples=args.samples, max_text_tokens=args.max_text_tokens,
                                       max_response_tokens=args.response_tokens,
                                       min_response_tokens=args.response_tokens, seed=0)
        os.makedirs(os.path.dirname(os.path.abspath(args.dataset)), exist_ok=True)
        judgeq.save_dataset(samples, args.dataset)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = {"judgeq": judgeq.evaluate(model, soft, samples), "judgeq_untrained": judgeq.evaluate(model, init, samples)}
    rates = judgeq.hit_rates(model, samples, soft, budgets=args.budgets, window=args.window,
                             extra_soft={"judgeq_untrained": init}, progress=True)
    eval_s = time.perf_counter() - t0
    report = {
        "what": "critical-KV hit rate vs the response-guided oracle, held-out stdlib prompts",
        "model": os.path.basename(model.path), "soft": args.soft or "default (kvpress_c/data)",
        "n_soft": int(soft.shape[0]), "samples": len(samples),
        "prompt_tokens": {"mean": float(np.mean([len(s.prompt_ids) for s in samples])),
                          "min": int(min(len(s.prompt_ids) for s in samples)),
                          "max": int(max(len(s.prompt_ids) for s in samples))},
        "response_tokens_mean": float(np.mean([len(s.response_ids) for s in samples])),
        "snapkv_window": args.window, "kernel": 5, "pooling": "avg", "gqa": "mean",
        "judgeq_loss": loss, "hit_rate": {str(b): v for b, v in rates.items()},
        "seconds": {"build": round(build_s, 1), "eval": round(eval_s, 1)},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": kvpress_c._core.get_num_threads(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))
    return 0


def table(report: dict) -> str:
    names = [("judgeq", "Judge Q (trained)"), ("judgeq_untrained", "Judge Q (untrained init)"),
             ("snapkv", f"SnapKV (window {report['snapkv_window']})")]
    budgets = list(report["hit_rate"])
    lines = ["| method | " + " | ".join(f"budget {b}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for key, label in names:
        cells = []
        for b in budgets:
            r = report["hit_rate"][b][key]
            cells.append(f"{r['mean']:.3f} ± {r['std']:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    n = {b: report["hit_rate"][b]["snapkv"]["n"] for b in budgets}
    lines.append("")
    lines.append(f"prompts per budget: {n}; mean prompt {report['prompt_tokens']['mean']:.0f} tokens; "
                 f"Judge Q loss trained {report['judgeq_loss']['judgeq']:.3e}, "
                 f"untrained {report['judgeq_loss']['judgeq_untrained']:.3e}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
