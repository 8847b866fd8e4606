"""Command line: `python -m kvpress_c demo | eval | report | merge | judgeq | compress | ask | chat`."""
from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    import kvpress_c
    from kvpress_c.demo import run_demo

    t0 = time.perf_counter()
    model = kvpress_c.load_model(args.model)
    print(f"model: {model}")
    print(f"loaded in {time.perf_counter() - t0:.2f} s, GEMM: {kvpress_c._core.blas_name()}, "
          f"threads: {kvpress_c._core.get_num_threads()}")
    t0 = time.perf_counter()
    info, rows = run_demo(model, n_tokens=args.tokens)
    print(f"\nA magic number hidden in {info['prompt_tokens']} tokens of filler; the question is compressed with "
          f"the context.\nquestion: {info['question']}  (the needle says {info['needle']})\n")
    full = rows[0]
    print(f"{'KV cache':<30} {'kept/head':>9} {'memory':>9} {'of full':>8}  answer")
    for r in rows:
        mark = "correct" if r["correct"] else "WRONG"
        print(f"{r['cache']:<30} {r['kept_tokens']:>9.0f} {r['cache_bytes'] / 2**20:>7.1f}MB "
              f"{r['cache_bytes'] / full['cache_bytes']:>7.0%}  {r['answer']!r} ({mark})")
    print(f"\n{time.perf_counter() - t0:.1f} s for the three answers (ChunkKV shares the full cache's prefill, "
          "the decodes run batched). Presses x budgets x benchmarks: python -m kvpress_c eval -h")
    return 0 if full["correct"] else 1


def _judgeq(argv) -> int:
    from .judgeq_cli import main as judgeq_main
    return judgeq_main(list(argv))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress_c", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="needle retrieval on the embedded default model")
    demo.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    demo.add_argument("--tokens", type=int, default=1000, help="approximate haystack length in tokens")
    demo.set_defaults(func=_demo)
    from .eval.cli import add_eval_parser, add_report_parser
    add_eval_parser(sub)
    add_report_parser(sub)
    from .cache_cli import COMMANDS as CACHE_COMMANDS, add_cache_parsers
    add_cache_parsers(sub)
    jq = sub.add_parser("judgeq", help="Judge Q soft tokens: train | eval (see `judgeq -h`)", add_help=False)
    jq.add_argument("rest", nargs=argparse.REMAINDER)
    jq.set_defaults(func=lambda a: _judgeq(a.rest))
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["judgeq"]:  # its own parser takes every argument after the word
        return _judgeq(argv[1:])
    args = parser.parse_args(argv)
    if args.command in ("eval", "report", "merge", *CACHE_COMMANDS):
        try:
            return args.func(args)
        except (ValueError, FileNotFoundError, MemoryError, ImportError, ConnectionError) as e:  # say what to change
            print(f"error: {e}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
