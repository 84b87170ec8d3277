"""Peak memory and training speed with a large item table, replicated or sharded by torchrec.

    torchrun --nproc-per-node 2 -m tzrec_bench.benchmarks.table_memory --items 10000000 \
        --sharding torchrec
    torchrun --nproc-per-node 2 -m tzrec_bench.benchmarks.table_memory --items 1000 \
        --sharding replicate

Each rank builds HSTURetrieval over a catalogue of ``--items`` and trains ``--steps``
optimizer steps on random histories, exactly as ``tzrec-bench train`` does for the same
``--sharding`` (DDP and AdamW over the whole model, or :class:`ShardedTables`: the table
sharded, fused row-wise Adagrad, AdamW for the dense part). It prints each rank's peak resident
memory (``ru_maxrss``) and the samples per second after the first steps. The table's share of
the memory is the peak of a run minus that of the same run over a tiny catalogue.
"""

from __future__ import annotations

import json
import resource
import time
from typing import Optional, Sequence

import torch
from torch import nn

from tzrec_bench.train.config import SHARDING_TYPES, SHARDINGS, TrainConfig
from tzrec_bench.train.distributed import close, gather_objects, init_distributed
from tzrec_bench.train.sharding import ShardedTables, meta_table
from tzrec_gr.models import HSTURetrieval
from tzrec_ops.commandline import ArgumentParser

WARMUP_STEPS = 3


class _Step(nn.Module):
    """The model's sampled-softmax loss as one forward (what DDP and DMP wrap)."""

    def __init__(self, model: HSTURetrieval) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor,
                negatives: torch.Tensor) -> torch.Tensor:
        return self.model.loss(ids, lengths, timestamps, negatives=negatives)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m tzrec_bench.benchmarks.table_memory",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, required=True, help="catalogue rows")
    parser.add_argument("--embedding-dim", type=int, default=64)
    parser.add_argument("--sharding", choices=SHARDINGS, default="torchrec")
    parser.add_argument("--sharding-type", choices=SHARDING_TYPES, default="row_wise")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="users per global batch")
    parser.add_argument("--history", type=int, default=50, help="events per user")
    parser.add_argument("--num-negatives", type=int, default=128)
    parser.add_argument("--json", help="append the result as one JSON line to this file")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")

    config = TrainConfig(sharding=args.sharding, sharding_type=args.sharding_type,
                         embedding_dim=args.embedding_dim, num_layers=1, dropout=0.0)
    ctx = init_distributed("cpu", group=args.sharding == "torchrec")
    try:
        torch.manual_seed(0)
        model = HSTURetrieval(
            args.items, args.embedding_dim, num_heads=2, num_layers=1, dropout_ratio=0.0,
            max_seq_len=args.history,
            embedding_tables=meta_table if args.sharding == "torchrec" else "plain",
        )
        step: nn.Module = _Step(model)
        if args.sharding == "torchrec":
            tables = ShardedTables(step, config, ctx)
            step, optimizer = tables.module, tables.optimizer
        else:
            if ctx.distributed:
                step = nn.parallel.DistributedDataParallel(step)
            optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                          weight_decay=config.weight_decay)
        local = args.batch_size // ctx.world_size
        generator = torch.Generator().manual_seed(1 + ctx.rank)
        started = 0.0
        for i in range(args.steps):
            if i == WARMUP_STEPS:
                started = time.perf_counter()
            ids = torch.randint(0, args.items, (local * args.history,), generator=generator)
            lengths = torch.full((local,), args.history, dtype=torch.int64)
            timestamps = torch.arange(local * args.history, dtype=torch.int64)
            negatives = torch.randint(0, args.items, (args.num_negatives,), generator=generator)
            loss = step(ids, lengths, timestamps, negatives)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        seconds = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peaks = gather_objects(peak, ctx)
        if ctx.is_main:
            result = {
                "items": args.items, "embedding_dim": args.embedding_dim,
                "sharding": args.sharding,
                "sharding_type": args.sharding_type if args.sharding == "torchrec" else None,
                "processes": ctx.world_size, "peak_rss_gib": [p / 2**30 for p in peaks],
                "samples_per_s": (args.steps - WARMUP_STEPS) * args.batch_size / seconds,
                "table_gib": args.items * args.embedding_dim * 4 / 2**30,
            }
            print(f"{args.items:,} items x {args.embedding_dim}, {args.sharding}"
                  f"{' ' + args.sharding_type if args.sharding == 'torchrec' else ''}, "
                  f"{ctx.world_size} processes: peak RSS per rank "
                  f"{', '.join(f'{p:.2f}' for p in result['peak_rss_gib'])} GiB, "
                  f"{result['samples_per_s']:.1f} samples/s")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(result) + "\n")
    finally:
        close(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
