"""``tzrec-bench plan``: torchrec's sharding planner for a catalogue larger than this machine.

    tzrec-bench plan --items 1e9 --embedding-dim 256 --world-size 64 --device cuda --hbm 80
    tzrec-bench plan --items 1e7 --embedding-dim 64 --world-size 2 --device cpu \\
        --sharding-type table_wise

A simulation: the item table (one torchrec ``EmbeddingCollection`` table named ``item``, fed
the feature ``item_id``, as :class:`tzrec_gr.embeddings.TorchrecEmbeddingTable` builds it) is
made on the ``meta`` device, so nothing is allocated, and torchrec's
``EmbeddingShardingPlanner`` plans it for a ``Topology`` of ``--world-size`` devices that need
not exist. The command prints

* figures computed here from the options alone (table and optimizer-state sizes, the bytes the
  embedding all-to-all moves per rank and step, a link-time estimate from stated bandwidths);
* the plan: each shard's rank, rows, columns and offsets (equal shards summarised);
* each device's memory as the planner estimates it (table + optimizer state + input/output
  buffers) plus the planner's reservation, against its capacity;
* the planner's cost estimates per rank (forward/backward compute and communication, in ms).

A table that fits on no plan ends in one message naming the options to change, exit status 2.
Needs torchrec: ``pip install 'tzrec-bench[torchrec]'`` (imported only when the command runs);
on a machine without CUDA, the lines of :data:`CPU_INSTALL` instead.
Legend: N = rows (items), E = embedding dim, W = world size, B = samples per rank and step,
L = ids per sample.
"""

from tzrec_bench.plan.options import (
    COMPUTE_KERNELS,
    CPU_INSTALL,
    DTYPES,
    OPTIMIZERS,
    SHARDING_TYPES,
    Derived,
    NoPlanError,
    PlanOptionError,
    add_parser,
    derived_figures,
)
from tzrec_bench.plan.planner import make_plan, require_torchrec, run
from tzrec_bench.plan.report import PlanReport, RankUsage, ShardPlacement, format_report

__all__ = [
    "COMPUTE_KERNELS",
    "CPU_INSTALL",
    "DTYPES",
    "OPTIMIZERS",
    "SHARDING_TYPES",
    "Derived",
    "NoPlanError",
    "PlanOptionError",
    "PlanReport",
    "RankUsage",
    "ShardPlacement",
    "add_parser",
    "derived_figures",
    "format_report",
    "make_plan",
    "require_torchrec",
    "run",
]
