"""`python -m kvpress_c judgeq train | eval`: train Judge Q soft tokens, evaluate them.

    python -m kvpress_c judgeq train --out runs/jq            # stdlib corpus, embedded default model
    python -m kvpress_c judgeq train --data texts.jsonl --out runs/jq --lr 1e-2 --epochs 3
    python -m kvpress_c judgeq eval --soft runs/jq/soft_embeddings.npy --budgets 64 128 256

Data (--data): a .jsonl of texts ({"text": ...} or a JSON string per line), of ShareGPT-style
conversations ({"conversations": [{"from": "human", "value": ...}, ...]}), or of built samples
({"prompt_ids": [...], "response_ids": [...]}, as written to OUT/dataset.jsonl). Without --data the
corpus is built from the docstrings of CPython's standard library (kvpress_c.judgeq.stdlib_corpus).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _add_data_args(p: argparse.ArgumentParser, split: str, max_samples: int, max_text_tokens: int, chunk: int):
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--data", default=None, help=".jsonl of texts, conversations or built samples "
                                                 "(default: the stdlib docstring corpus)")
    p.add_argument("--split", default=split, choices=["train", "test", "all"], help="stdlib corpus split")
    p.add_argument("--chunk-chars", type=int, default=chunk, help="stdlib corpus: characters per text")
    p.add_argument("--max-samples", type=int, default=max_samples, help="samples to build (default %(default)s)")
    p.add_argument("--max-text-tokens", type=int, default=max_text_tokens,
                   help="texts cut to this many tokens before the 90%% prompt split")
    p.add_argument("--max-response-tokens", type=int, default=64)
    p.add_argument("--min-response-tokens", type=int, default=8)
    p.add_argument("--data-seed", type=int, default=0, help="seed of the response truncation")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")


def _samples(args, model, cache_path=None):
    from . import judgeq
    if args.data and not os.path.exists(args.data):
        raise FileNotFoundError(f"--data {args.data} does not exist")
    if cache_path and os.path.exists(cache_path):
        print(f"samples: {cache_path} (already built)", file=sys.stderr)
        return judgeq.load_dataset(cache_path)
    if args.data:
        with open(args.data, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        if first and '"prompt_ids"' in first:
            samples = judgeq.load_dataset(args.data)
            if args.max_samples:
                samples = samples[:args.max_samples]
            return samples
        source = args.data
    else:
        source = judgeq.stdlib_corpus(args.split, chunk_chars=args.chunk_chars)
    t0 = time.perf_counter()
    samples = judgeq.build_dataset(model, source, max_samples=args.max_samples, max_text_tokens=args.max_text_tokens,
                                   max_response_tokens=args.max_response_tokens,
                                   min_response_tokens=args.min_response_tokens, seed=args.data_seed)
    print(f"built {len(samples)} samples in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if cache_path:
        judgeq.save_dataset(samples, cache_path)
    return samples


def _parse_init(s: str):
    if s in ("random", "mean"):
        return s
    if s.startswith("ids:"):
        try:
            return [int(x) for x in s[4:].split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--init ids:... must list integers, got {s!r}") from None
    if s.startswith("text:"):
        return s  # tokenised once the model is loaded
    if s.endswith(".npy"):
        return s
    raise argparse.ArgumentTypeError(f"--init must be random, mean, ids:1,2,3, text:<words> or a .npy file, got {s!r}")


def _train(args) -> int:
    import numpy as np

    import kvpress_c
    from . import judgeq
    if args.threads:
        kvpress_c.set_num_threads(args.threads)
    model = kvpress_c.load_model(args.model)
    os.makedirs(args.out, exist_ok=True)
    samples = _samples(args, model, cache_path=os.path.join(args.out, "dataset.jsonl"))
    init = args.init
    if isinstance(init, str) and init.startswith("text:"):
        init = model.encode(init[5:])
    elif isinstance(init, str) and init.endswith(".npy"):
        init = np.load(init)
    print(f"model {model}\n{len(samples)} samples, n_soft {args.n_soft}, lr {args.lr}, {args.epochs} epochs, "
          f"batch {args.batch_size}", file=sys.stderr)
    t0 = time.perf_counter()
    res = judgeq.train(model, samples, n_soft=args.n_soft, lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
                       weight_decay=args.weight_decay, seed=args.seed, out=args.out, init=init,
                       val_fraction=args.val_fraction, val_every=args.val_every, max_steps=args.max_steps,
                       resume=not args.no_resume)
    h = res.history
    wall = time.perf_counter() - t0
    summary = {"steps": h["steps"][-1] if h["steps"] else 0, "wall_s": round(wall, 1),
               "s_per_step": round(sum(h["seconds"]) / max(1, len(h["seconds"])), 2),
               "first_train_loss": h["train_loss"][0] if h["train_loss"] else None,
               "last_train_loss": h["train_loss"][-1] if h["train_loss"] else None,
               "val_loss": list(zip(h["val_steps"], h["val_loss"])), "out": args.out}
    print(json.dumps(summary, indent=1))
    if args.save_to:
        best = res.best_soft_embeddings if args.keep == "best" else res.soft_embeddings
        os.makedirs(os.path.dirname(os.path.abspath(args.save_to)), exist_ok=True)
        np.save(args.save_to, best)
        print(f"saved {args.keep} soft embeddings to {args.save_to}", file=sys.stderr)
    return 0


def _eval(args) -> int:
    import numpy as np

    import kvpress_c
    from . import judgeq
    from .presses.judgeq import JudgeQPress, load_soft_embeddings
    if args.threads:
        kvpress_c.set_num_threads(args.threads)
    model = kvpress_c.load_model(args.model)
    soft = load_soft_embeddings(args.soft) if args.soft else JudgeQPress.default_for(model).soft_embeddings
    samples = _samples(args, model)
    report = {"model": os.path.basename(model.path), "soft": args.soft or "default", "samples": len(samples),
              "mean_prompt_tokens": float(np.mean([len(s.prompt_ids) for s in samples])),
              "loss": judgeq.evaluate(model, soft, samples)}
    if args.budgets:
        report["hit_rate"] = judgeq.hit_rates(model, samples, soft, budgets=args.budgets, window=args.window,
                                              progress=True)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvpress_c judgeq", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train soft tokens (AdamW; resumable checkpoints in --out)")
    _add_data_args(tr, "train", 240, 288, 1500)
    tr.add_argument("--out", required=True, help="folder for dataset.jsonl, checkpoint.npz, history.json, "
                                                  "soft_embeddings.npy, loss_curve.png")
    tr.add_argument("--n-soft", type=int, default=32)
    tr.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate (paper: 5e-5 over 4700 steps)")
    tr.add_argument("--epochs", type=int, default=3)
    tr.add_argument("--batch-size", type=int, default=32)
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--init", type=_parse_init, default="random",
                    help="random | mean | ids:1,2,3 | text:<words> | file.npy")
    tr.add_argument("--val-fraction", type=float, default=0.1)
    tr.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: each epoch)")
    tr.add_argument("--max-steps", type=int, default=None, help="stop after N steps (resume later)")
    tr.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    tr.add_argument("--save-to", default=None, help="also save the result as this .npy (e.g. kvpress_c/data/...)")
    tr.add_argument("--keep", choices=["best", "final"], default="best", help="what --save-to saves")
    tr.set_defaults(func=_train)
    ev = sub.add_parser("eval", help="loss and critical-KV hit rate vs SnapKV on held-out prompts")
    _add_data_args(ev, "test", 40, 640, 3000)
    ev.add_argument("--soft", default=None, help=".npy / .safetensors soft embeddings (default: the shipped file)")
    ev.add_argument("--budgets", type=int, nargs="*", default=[64, 128, 256])
    ev.add_argument("--window", type=int, default=32, help="SnapKV window")
    ev.add_argument("--json", default=None, help="write the report here")
    ev.set_defaults(func=_eval)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, MemoryError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
