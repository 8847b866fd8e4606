"""Command line: `python -m kvpress_c demo | eval | report | merge | judgeq`."""
from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    import kvpress_c
    from kvpress_c.demo import needle_prompt

    t0 = time.perf_counter()
    model = kvpress_c.load_model(args.model)
    load_s = time.perf_counter() - t0
    print(f"model: {model}")
    print(f"loaded in {load_s:.2f} s, GEMM: {kvpress_c._core.blas_name()}, threads: {kvpress_c._core.get_num_threads()}")
    context, question, answer = needle_prompt(model, n_tokens=args.tokens)
    gen = model.generate(context + "\n\n" + question, max_new_tokens=24, details=True)
    ok = answer in gen.text
    print(f"question: {question}")
    print(f"answer:   {gen.text.strip()!r}  ({'correct' if ok else 'WRONG'}: the needle says {answer})")
    print(f"prompt: {gen.prompt_tokens} tokens, prefill {gen.prefill_s:.3f} s "
          f"({gen.prompt_tokens / gen.prefill_s:.0f} tok/s), decode {len(gen.ids)} tokens in {gen.decode_s:.3f} s "
          f"({gen.decode_tokens_per_s:.1f} tok/s)")
    return 0 if ok else 1


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
    jq = sub.add_parser("judgeq", help="Judge Q soft tokens: train | eval (see `judgeq -h`)", add_help=False)
    jq.add_argument("rest", nargs=argparse.REMAINDER)
    jq.set_defaults(func=lambda a: _judgeq(a.rest))
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["judgeq"]:  # its own parser takes every argument after the word
        return _judgeq(argv[1:])
    args = parser.parse_args(argv)
    if args.command in ("eval", "report", "merge"):
        try:
            return args.func(args)
        except (ValueError, FileNotFoundError, MemoryError, ImportError, ConnectionError) as e:  # say what to change
            print(f"error: {e}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
