"""``tzrec-bench run-configs``: its options and the run.

    tzrec-bench run-configs hstu-retrieval-synthetic sasrec-synthetic --repeats 3
    tzrec-bench run-configs my-config.toml --baseline my-baselines.toml --out summary.json
    tzrec-bench run-configs --list
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tzrec_bench.regression.baseline import load_baseline
from tzrec_bench.regression.configs import (
    SHIPPED_BASELINES,
    RunConfigError,
    load_config,
    shipped_configs,
    shipped_dir,
)
from tzrec_bench.regression.harness import (
    Trainer,
    exit_code,
    failed_runs,
    run_configs,
    summary_json,
    summary_table,
    train_and_test,
)
from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.tasks import task_facts


def add_parser(subparsers: argparse._SubParsersAction,
               formatter: type = argparse.HelpFormatter) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run-configs",
        help="train/eval configs N times each, averaged and checked against baselines",
        description=(
            "Run each named train/eval config --repeats times (seeds seed, seed+1, ...) with "
            "the tzrec-bench train loop, average its test metrics (mean ± std), run the "
            "simple baselines of its task on the same data and split beside it (the floors), "
            "and sort each "
            "metric into improved / unchanged / regressed / failed against the baseline "
            "thresholds (failed: a run raised, or the metric is missing or NaN). Exits 1 on "
            "a regression or a failure, and whenever a run raised (a floor's too, judged or "
            "not: the last line counts them as failed runs). A config whose data is absent "
            "is skipped, with the reason. Where papers' results on a config's data set ship "
            "with the package (amazon-beauty, amazon-sports), they are shown beside it, "
            "marked as published, when its runs follow their protocol; never judged."
        ),
        epilog=f"shipped configs: {', '.join(shipped_configs())}",
        formatter_class=formatter,
    )
    p.add_argument("configs", nargs="*", metavar="CONFIG",
                   help="a shipped config's name or a config file (TOML)")
    p.add_argument("--repeats", type=int, default=3, metavar="N", help="runs per config")
    p.add_argument("--baseline", metavar="FILE",
                   help="thresholds per config and metric, TOML or JSON (default: the "
                   f"shipped {SHIPPED_BASELINES})")
    p.add_argument("--no-baseline", action="store_true",
                   help="judge nothing: report means only (a run that raises still "
                   "fails: exit status 1)")
    p.add_argument("--no-floors", dest="floors", action="store_false",
                   help="do not run the simple baselines (most popular, item transitions, "
                   "item-kNN; popularity for ranking) beside each config")
    p.add_argument("--out", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--work-dir", default="tzrec-bench-runs/run-configs", metavar="PATH",
                   help="where each run's checkpoints and metrics go")
    p.add_argument("--data-root", metavar="PATH",
                   help="folder holding the data sets' folders (ml-100k/ ...); default: "
                   "$TZREC_BENCH_DATA")
    p.add_argument("--eval-negatives", type=int, default=0, metavar="N",
                   help="retrieval configs and their floors also report the sampled protocol "
                   "(each target against N items the user never interacted with; the SASRec "
                   "paper's N=100) beside the full ranking")
    p.add_argument("--list", action="store_true", help="list the shipped configs and exit")
    return p


def run_command(args: argparse.Namespace, trainer: Trainer = train_and_test) -> int:
    """Runs the configs; 0, or 1 on a regression, a failed metric or a run that raised. Bad
    options raise :class:`RunConfigError` (the CLI exits 2)."""
    if args.list:
        for name, path in shipped_configs().items():
            print(f"{name:<28} {load_config(str(path)).description}")
        return 0
    if not args.configs:
        raise RunConfigError("CONFIG: name at least one config (--list shows the shipped ones)")
    if args.repeats < 1:
        raise RunConfigError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.eval_negatives < 0:
        raise RunConfigError(f"--eval-negatives: must be >= 0, got {args.eval_negatives}")
    configs = [load_config(c) for c in args.configs]
    if args.eval_negatives:
        configs = [dataclasses.replace(c, settings={**c.settings,
                                                    "eval_negatives": args.eval_negatives})
                   if task_facts(c.settings.get("model", TrainConfig.model)).eval_negatives
                   else c for c in configs]
    if args.no_baseline:
        baseline = {}
    else:
        baseline = load_baseline(Path(args.baseline) if args.baseline
                                 else shipped_dir() / SHIPPED_BASELINES)
    results = run_configs(configs, args.repeats, baseline, trainer, Path(args.work_dir),
                          args.data_root, args.floors)
    print(summary_table(results))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary_json(results, args.repeats), indent=2) + "\n")
        print(f"summary: {out}")
    raised = failed_runs(results)
    if raised:
        print(f"run-configs: {raised} run(s) raised (their 'run failed' lines above)",
              file=sys.stderr)
    return exit_code(results)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser,
        trainer: Trainer = train_and_test) -> int:
    """:func:`run_command`, a bad option or file ending in one line on stderr and status 2."""
    try:
        return run_command(args, trainer)
    except RunConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
