"""`python -m kvpress_c compress | ask | chat`: compress a context once into a saved cache, answer questions
from it, or chat over it (kvpress_c/saved.py, kvpress_c/conversation.py).

    python -m kvpress_c compress notes.txt --press snapkv --compression-ratio 0.5 --out notes.kvc
    python -m kvpress_c ask notes.kvc "Who keeps bees?"
    python -m kvpress_c chat notes.kvc          # lines from stdin; /save PATH, /quit
"""
from __future__ import annotations

import os
import sys
import time


def _press_args(p) -> None:
    from .eval.presets import NAMES
    p.add_argument("--press", default="full", choices=NAMES, metavar="NAME",
                   help=f"the press ({', '.join(NAMES)}; default full: no compression)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, default=None, help="tokens kept per KV head")
    size.add_argument("--compression-ratio", type=float, default=None, help="fraction of tokens removed")
    p.add_argument("--window-size", type=int, default=None)
    p.add_argument("--kernel-size", type=int, default=None)
    p.add_argument("--chunk-length", type=int, default=10, help="ChunkKV chunk size")
    p.add_argument("--chunk-size", type=int, default=4096, help="TAKE prefill chunk")


def _model_args(p) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M); the "
                   "cache must have been saved from the same model")
    p.add_argument("--device", choices=["cpu", "cuda", "emulated"], default="cpu")


def _press(args, model):
    from .eval.presets import make_press
    if args.press == "full":
        return None
    return make_press(args.press, budget=args.budget, compression_ratio=args.compression_ratio,
                      window_size=args.window_size, kernel_size=args.kernel_size, chunk_length=args.chunk_length,
                      chunk_size=args.chunk_size, model=model)


def _load(args):
    import kvpress_c
    return kvpress_c.load_model(args.model, device=args.device)


def _compress(args) -> int:
    from .pipeline import Pipeline
    with open(args.file, encoding="utf-8") as f:
        context = f.read()
    model = _load(args)
    press = _press(args, model)
    t0 = time.perf_counter()
    res = Pipeline(model).compress(context, press=press, chat=not args.no_chat)
    res.save_cache(args.out)
    s = res.stats
    print(f"{args.out}: {s['prompt_tokens']} context tokens, {s['kept_tokens']:.0f} kept per head "
          f"({s['cache_bytes'] / 2**20:.1f} MB of cache, file {os.path.getsize(args.out) / 2**20:.1f} MB), "
          f"{time.perf_counter() - t0:.2f} s")
    return 0


def _ask(args) -> int:
    from .pipeline import Pipeline
    model = _load(args)
    res = Pipeline(model)(question=args.question, cache=args.cache, max_new_tokens=args.max_new_tokens)
    print(res.answer)
    if args.verbose:
        s = res.stats
        print(f"[loaded in {s['load_s']:.3f} s, no prefill; answered in {s['decode_s']:.2f} s]", file=sys.stderr)
    return 0


def _chat(args) -> int:
    from .conversation import Conversation
    model = _load(args)
    press = _press(args, model)
    conv = Conversation.load(model, args.cache, press=press, compress=args.compress,
                             max_new_tokens=args.max_new_tokens)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            return 0
        line = line.rstrip("\n")
        if line.startswith("/save"):
            path = line[len("/save"):].strip() or args.cache
            conv.save(path)
            print(f"[saved to {path}]")
            continue
        if not line.strip():
            continue
        print(conv(line), flush=True)


def add_cache_parsers(sub) -> None:
    c = sub.add_parser("compress", help="compress a text file's context into a saved cache (no question)")
    c.add_argument("file", help="a UTF-8 text file: the context")
    c.add_argument("--out", required=True, help="the cache file to write")
    c.add_argument("--no-chat", action="store_true", help="the raw text, not wrapped in the chat template")
    _press_args(c)
    _model_args(c)
    c.set_defaults(func=_compress)
    a = sub.add_parser("ask", help="answer a question from a saved cache, without a prefill")
    a.add_argument("cache")
    a.add_argument("question")
    a.add_argument("--max-new-tokens", type=int, default=128)
    a.add_argument("-v", "--verbose", action="store_true", help="timings on stderr")
    _model_args(a)
    a.set_defaults(func=_ask)
    h = sub.add_parser("chat", help="chat over a saved cache (stdin lines; /save [PATH], /quit)")
    h.add_argument("cache", help="a saved conversation or compressed context")
    h.add_argument("--compress", choices=["new", "all"], default=None,
                   help="what the press compresses at each turn: the new rows (default) or the whole cache")
    h.add_argument("--max-new-tokens", type=int, default=256)
    _press_args(h)
    _model_args(h)
    h.set_defaults(func=_chat)


COMMANDS = ("compress", "ask", "chat")
