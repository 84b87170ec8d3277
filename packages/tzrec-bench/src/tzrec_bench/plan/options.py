"""The options of ``tzrec-bench plan``, their constants, and the figures computed from
them alone (no torchrec)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from tzrec_ops.devices import DEVICE_HELP, resolve_device

TABLE = "item"
FEATURE = "item_id"
EXTRA = "tzrec-bench[torchrec]"
#: torchrec on a machine without CUDA, for torch 2.13 (README.md has them; ``nox -s install-cpu``
#: runs them). Every torchrec release requires the CUDA build ``fbgemm-gpu`` (~500 MB, which
#: cannot load there), and pip cannot take ``fbgemm-gpu-cpu``, the same ``fbgemm_gpu`` module,
#: in its place; so torchrec's other requirements come first, then torchrec without them.
CPU_INSTALL = (
    "pip install fbgemm-gpu-cpu==1.8.0 tensordict==0.15.3 torchmetrics==1.0.3 tqdm pyre-extensions",
    "pip install torchrec==1.8.0 --no-deps",
)
FEATURE_NAME = "tzrec-bench plan"

# what torchrec's EmbeddingCollectionSharder offers (table_row_wise is for bags only)
SHARDING_TYPES = ("row_wise", "table_wise", "column_wise", "data_parallel", "auto")
COMPUTE_KERNELS = ("fused", "fused_uvm_caching", "fused_uvm", "auto")
DTYPES = {"fp32": 4, "fp16": 2}  # bytes per value
# name -> (fbgemm's EmbOptimType member, torchrec.optim class the planner sizes the state
# from, fp32 state values per row as a multiple of E plus a constant: (per_dim, per_row))
OPTIMIZERS: Dict[str, Tuple[str, str, Tuple[int, int]]] = {
    "rowwise-adagrad": ("EXACT_ROWWISE_ADAGRAD", "RowWiseAdagrad", (0, 1)),
    "adagrad": ("EXACT_ADAGRAD", "Adagrad", (1, 0)),
    "adam": ("ADAM", "Adam", (2, 0)),
    "sgd": ("EXACT_SGD", "SGD", (0, 0)),
}
DEFAULT_DDR_GIB = 128.0  # torchrec's default host memory per device (planner constants)
DEFAULT_INTRA_GBPS = 600 * 1024**3 / 1e9  # torchrec's defaults, in GB/s
DEFAULT_INTER_GBPS = 12.5 * 1024**3 / 1e9
PERF_FIELDS = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist_comms",
               "prefetch_compute")
GIB = 1024**3
MIB = 1024**2
ID_BYTES = 8  # int64 ids, as torchrec's planner counts them


class PlanOptionError(ValueError):
    """A bad option or combination of options: the message names it; exit status 2."""


class NoPlanError(RuntimeError):
    """No plan fits the devices: the message names the options to change; exit status 2."""


# -- options ---------------------------------------------------------------------------------


def _count(text: str) -> int:
    """An argparse type: a positive integer written plainly (1000000, 1_000_000) or in
    scientific notation with an integral value (1e9, 2.5e6)."""
    value: Optional[int]
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            number = float("nan")
        value = int(number) if number == number and number.is_integer() else None
    if value is None:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 1000000 or 1e9, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _device_kind(text: str) -> str:
    """``--device``: the planned devices' kind, spelled as every ``--device`` is; ``auto`` is
    this machine's (the GPU when CUDA is available, else the CPU). The cluster is simulated,
    so ``cuda`` needs no GPU here and a GPU's index does not matter."""
    if text == "auto":
        return resolve_device(text).type
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return kind


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


def add_parser(subparsers: argparse._SubParsersAction,
               formatter_class: type = argparse.HelpFormatter) -> argparse.ArgumentParser:
    """Adds the ``plan`` subcommand's parser to ``subparsers`` and returns it."""
    p = subparsers.add_parser(
        "plan",
        help="plan a sharded item table with torchrec's planner for a simulated cluster",
        description=(
            "Run torchrec's EmbeddingShardingPlanner on one item table built on the meta "
            "device (nothing is allocated) for a topology of --world-size devices that need "
            "not exist, and print the plan (each shard's rank, rows, columns, offsets), each "
            "device's memory (table + optimizer state + buffers, and the planner's "
            "reservation) and the planner's cost estimates per rank, beside figures computed "
            "from the options (table and optimizer-state sizes, all-to-all bytes per step, "
            "link time at the stated bandwidths). Estimates only: nothing is measured. A "
            "table that fits on no plan exits 2 naming the options to change. Needs "
            "torchrec: pip install 'tzrec-bench[torchrec]' (on a machine without CUDA, "
            "the lines in tzrec-bench's README instead)."
        ),
        epilog=(
            "examples:\n"
            "  tzrec-bench plan --items 1e9 --embedding-dim 256 --world-size 64 --hbm 80\n"
            "  tzrec-bench plan --items 1e7 --embedding-dim 64 --world-size 2 --device cpu "
            "--sharding-type table_wise"
        ),
        formatter_class=formatter_class,
    )
    g = p.add_argument_group("the table")
    g.add_argument("--items", type=_count, required=True, metavar="N",
                   help="catalogue rows, e.g. 1e9 or 50000000")
    g.add_argument("--embedding-dim", type=_count, required=True, metavar="E",
                   help="embedding width")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="the table's dtype (the planner also counts the all-to-all in it)")
    g.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="rowwise-adagrad",
                   help="the table's fused optimizer (fbgemm's EmbOptimType), which sets the "
                   "optimizer-state memory: rowwise-adagrad 1 value per row, adagrad E, adam "
                   "2E, sgd none")

    g = p.add_argument_group("the cluster")
    g.add_argument("--world-size", type=_count, required=True, metavar="W",
                   help="devices (one process each)")
    g.add_argument("--device", type=_device_kind, default="cuda",
                   metavar="{auto,cpu,cuda,cuda:N}",
                   help=f"the devices' kind ({DEVICE_HELP}; any GPU is the kind cuda)")
    g.add_argument("--devices-per-host", type=_count, metavar="K",
                   help="devices sharing a host, linked by --intra-host-bw (default: 8 for "
                   "cuda, --world-size for cpu; at most --world-size)")
    g.add_argument("--hbm", type=_gib, metavar="GiB",
                   help="device memory per device (cuda only; default: 80)")
    g.add_argument("--ddr", type=_gib, metavar="GiB",
                   help=f"host memory per device (default: {DEFAULT_DDR_GIB:g}, torchrec's); on "
                   "cpu the table's memory, on cuda used by the UVM kernels only")
    g.add_argument("--intra-host-bw", type=_gib, metavar="GB/s",
                   help="all-to-all bandwidth per device within a host (default: "
                   f"{DEFAULT_INTRA_GBPS:.1f}, torchrec's)")
    g.add_argument("--inter-host-bw", type=_gib, metavar="GB/s",
                   help="all-to-all bandwidth per device across hosts (default: "
                   f"{DEFAULT_INTER_GBPS:.2f}, torchrec's)")

    g = p.add_argument_group("the planner")
    g.add_argument("--sharding-type", choices=SHARDING_TYPES, default="row_wise",
                   help="row_wise splits the rows over every device, table_wise puts the "
                   "table on one, column_wise splits the columns, data_parallel copies it "
                   "to every device; auto lets the planner choose")
    g.add_argument("--compute-kernel", choices=COMPUTE_KERNELS, default="auto",
                   help="fused keeps the table in device memory, fused_uvm_caching/fused_uvm "
                   "in host memory (cuda); auto lets the planner choose (data_parallel "
                   "takes torchrec's dense kernel)")
    g.add_argument("--batch-size", type=_count, default=64, metavar="B",
                   help="samples per rank and step")
    g.add_argument("--ids-per-sample", type=_count, default=2048, metavar="L",
                   help="lookups per sample (the history length)")
    g.add_argument("--storage-reservation", type=_fraction, default=0.15, metavar="F",
                   help="fraction of device memory the planner keeps for the rest of the model "
                   "(torchrec's HeuristicalStorageReservation)")

    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    g.add_argument("--torchrec-stats", action="store_true",
                   help="also print torchrec's own EmbeddingStats table")
    return p


# -- figures from the options ----------------------------------------------------------------


@dataclass(frozen=True)
class Derived:
    """Figures computed from the options alone, not by torchrec.

    Attributes:
        table_bytes (int): N * E * dtype bytes.
        optimizer_bytes (int): the optimizer state, counted as fp32 values.
        lookups_per_rank (int): B * L, per rank and step.
        embedding_bytes_per_rank (int): B * L * E * dtype bytes: the rows each rank receives
            in the forward all-to-all, and the gradients it sends back in the backward one.
        id_bytes_per_rank (int): B * L * 8: the int64 ids each rank sends to the owners.
    """

    table_bytes: int
    optimizer_bytes: int
    lookups_per_rank: int
    embedding_bytes_per_rank: int
    id_bytes_per_rank: int


def state_values_per_row(optimizer: str, dim: int) -> int:
    per_dim, per_row = OPTIMIZERS[optimizer][2]
    return per_dim * dim + per_row


def derived_figures(items: int, dim: int, dtype: str, optimizer: str, batch_size: int,
                    ids_per_sample: int) -> Derived:
    """The table, optimizer-state and all-to-all sizes of a configuration (no torchrec).

    Args:
        items: N.
        dim: E.
        dtype: a key of :data:`DTYPES`.
        optimizer: a key of :data:`OPTIMIZERS`.
        batch_size: B, samples per rank and step.
        ids_per_sample: L.

    Returns:
        Derived: the figures.
    """
    width = DTYPES[dtype]
    lookups = batch_size * ids_per_sample
    return Derived(
        table_bytes=items * dim * width,
        optimizer_bytes=items * state_values_per_row(optimizer, dim) * 4,
        lookups_per_rank=lookups,
        embedding_bytes_per_rank=lookups * dim * width,
        id_bytes_per_rank=lookups * ID_BYTES,
    )


