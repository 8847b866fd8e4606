"""Command line: `python -m kvpress_c demo` (more subcommands are added by the evaluation harness)."""
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress_c", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="needle retrieval on the embedded default model")
    demo.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    demo.add_argument("--tokens", type=int, default=1000, help="approximate haystack length in tokens")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
