"""`python -m kvpress_c eval|report|merge`: the evaluation harness from the command line."""
from __future__ import annotations

import argparse
import os


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes i/n (e.g. 0/4), got {text!r}")
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text!r}")
    return i, n


def add_eval_parser(sub) -> None:
    from .presets import NAMES
    p = sub.add_parser("eval", help="run a benchmark (niah, ruler, longbench) for presses x budgets",
                       description="Evaluate presses on a benchmark; results go to OUT/<press-budget>/ "
                                   "(predictions.jsonl, metrics.json, config.json) and a rerun resumes.")
    p.add_argument("benchmark", choices=["niah", "ruler", "longbench"])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    p.add_argument("--device", choices=["cpu", "cuda", "emulated"], default="cpu",
                   help="where the model runs (cuda: bf16 on the GPU; with --ray, one worker per GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (per Ray worker with --ray, default 1 there; else all cores)")
    p.add_argument("--allow-long-context", action="store_true",
                   help="run prompts longer than the model's context (max_position_embeddings); refused otherwise")
    p.add_argument("--press", nargs="+", default=["full"], choices=NAMES, metavar="NAME",
                   help=f"one or more of: {', '.join(NAMES)} (presses share one prefill per sample)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--budget", type=int, nargs="+", help="tokens kept per KV head (one or more)")
    size.add_argument("--compression-ratio", type=float, nargs="+", help="fraction of tokens removed (one or more)")
    p.add_argument("--kv-cache", nargs="+", default=None, metavar="TYPE",
                   help="K/V storage type(s): f32, f16, bf16, q8_0, kivi4, kivi2 (QuantizedCache(4 | 2); "
                        "kivi4-g<q_group_size>-r<residual_length> for other settings); every press x budget runs "
                        "in each, labels end in the type (snapkv-b128-kivi4), one shared prefill per sample "
                        "(default: the model's own, labels without a type)")
    p.add_argument("--out", required=True, help="output folder of this run")
    p.add_argument("--query-aware", action="store_true", help="compress the question with the context")
    p.add_argument("--shard", type=_shard, default=(0, 1), help="i/n: this process takes samples i, i+n, ...")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the benchmark's per-task value")
    p.add_argument("--no-progress", action="store_true")
    r = p.add_argument_group("Ray cluster (pip install 'kvpress_c[ray]')")
    r.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray: alone, a local cluster on this machine; 'auto' the running cluster "
                        "(ray start --head); HOST:PORT a remote head")
    r.add_argument("--workers", type=int, default=None,
                   help="Ray worker actors (default: one per GPU with --device cuda, else CPUs // --threads)")
    r.add_argument("--max-attempts", type=int, default=3,
                   help="tries per sample before it is recorded in errors.jsonl and the run goes on")
    g = p.add_argument_group("press options")
    g.add_argument("--window-size", type=int, default=None)
    g.add_argument("--kernel-size", type=int, default=None)
    g.add_argument("--chunk-length", type=int, default=10, help="ChunkKV chunk size")
    g.add_argument("--reuse-layers", type=int, default=1, help="ChunkKV layer-wise index reuse group")
    g.add_argument("--chunk-size", type=int, default=4096, help="TAKE prefill chunk")
    g.add_argument("--take-alpha", type=float, default=0.2, help="TAKE probe EMA")
    g.add_argument("--warmup-budget", type=int, default=None, help="TAKE warm-up budget")
    g.add_argument("--soft-tokens", default=None, help="Judge Q soft embeddings (.npy/.safetensors)")
    b = p.add_argument_group("benchmark options")
    b.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000], help="NIAH context lengths")
    b.add_argument("--depths", type=float, nargs="+", default=None, help="NIAH depths in [0,1] (default: 10)")
    b.add_argument("--haystack", default="pydoc", help="noise, pydoc or a text file (NIAH; RULER essay tasks)")
    b.add_argument("--tasks", nargs="+", default=None, help="RULER/LongBench tasks (default: RULER niah_*, all LongBench)")
    b.add_argument("--length", type=int, default=4096, help="RULER sequence length")
    b.add_argument("--samples", type=int, default=20, help="RULER samples per task")
    b.add_argument("--seed", type=int, default=42)
    b.add_argument("--squad", default=None, help="SQuAD v2 dev json (RULER qa_1)")
    b.add_argument("--hotpotqa", default=None, help="HotpotQA dev distractor json (RULER qa_2)")
    b.add_argument("--data", default=None, help="LongBench folder of <task>.jsonl files")
    b.add_argument("--max-length", type=int, default=8192, help="LongBench middle-truncation length")
    b.add_argument("--limit", type=int, default=None, help="LongBench: first N samples per task")
    b.add_argument("--longbench-e", action="store_true", help="LongBench-E files and length buckets")
    p.set_defaults(func=run_eval)


def run_eval(args) -> int:
    from . import run
    bench = {"niah": dict(lengths=args.lengths, depths=args.depths, haystack=args.haystack),
             "ruler": dict(tasks=args.tasks, length=args.length, n_samples=args.samples, seed=args.seed,
                           haystack=args.haystack, squad=args.squad, hotpotqa=args.hotpotqa),
             "longbench": dict(tasks=args.tasks, data=args.data, max_length=args.max_length, limit=args.limit,
                               longbench_e=args.longbench_e)}[args.benchmark]
    opts = dict(window_size=args.window_size, kernel_size=args.kernel_size, chunk_length=args.chunk_length,
                reuse_layers=args.reuse_layers, chunk_size=args.chunk_size, take_alpha=args.take_alpha,
                warmup_budget=args.warmup_budget, soft_tokens=args.soft_tokens)
    res = run(args.benchmark, model=args.model, presses=args.press, budgets=args.budget,
              compression_ratios=args.compression_ratio, out=args.out, query_aware=args.query_aware,
              shard=args.shard, progress=not args.no_progress, press_options=opts,
              max_new_tokens=args.max_new_tokens, device=args.device, threads=args.threads,
              allow_long_context=args.allow_long_context, ray=args.ray, workers=args.workers,
              max_attempts=args.max_attempts, kv_cache=args.kv_cache, **bench)
    if args.shard[1] > 1:
        print(f"shard {args.shard[0]}/{args.shard[1]} done; when every shard is: python -m kvpress_c merge {args.out}")
        return 0
    from .report import plot_hint, table
    print(table(res.rows))
    if args.benchmark == "niah" and plot_hint():
        print(f"\nno heatmaps: {plot_hint()}")
    return 0


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="table (and CSV, plot) across eval runs")
    p.add_argument("dirs", nargs="+", help="eval output folders")
    p.add_argument("--csv", default=None, help="write the rows here (default: DIR/report.csv of the first)")
    p.add_argument("--plot", default=None, help="score-vs-budget PNG (default: DIR/report.png of the first)")
    p.add_argument("--kv-cache-table", nargs="*", default=None, metavar="A B",
                   help="also print a markdown table of press x budget by K/V type (runs made with --kv-cache); "
                        "with two types, their difference A - B too (e.g. kivi4 f16)")
    p.set_defaults(func=run_report)
    m = sub.add_parser("merge", help="join the shards of a sharded eval run")
    m.add_argument("out")
    m.set_defaults(func=run_merge)


def run_report(args) -> int:
    from .report import collect, plot, plot_hint, table, write_csv
    rows = collect(args.dirs)
    print(table(rows))
    if args.kv_cache_table is not None:
        from .report import kv_cache_table
        if len(args.kv_cache_table) not in (0, 2):
            raise SystemExit("--kv-cache-table takes no type or two (A B: the column A - B)")
        print("\n" + kv_cache_table(rows, tuple(args.kv_cache_table) or None))
    csv_path = write_csv(rows, args.csv or os.path.join(args.dirs[0], "report.csv"))
    if plot_hint():  # matplotlib is an extra: the table and CSV do without it
        print(f"\nwrote {csv_path}; no plot: {plot_hint()}")
        return 0
    png = plot(rows, args.plot or os.path.join(args.dirs[0], "report.png"))
    print(f"\nwrote {csv_path} and {png}")
    return 0


def run_merge(args) -> int:
    from . import merge
    from .report import table
    res = merge(args.out)
    print(table(res.rows))
    return 0
