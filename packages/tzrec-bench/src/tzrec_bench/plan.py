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

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from tzrec_ops.extras import require

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
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="the devices' kind")
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


def _state_values_per_row(optimizer: str, dim: int) -> int:
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
        optimizer_bytes=items * _state_values_per_row(optimizer, dim) * 4,
        lookups_per_rank=lookups,
        embedding_bytes_per_rank=lookups * dim * width,
        id_bytes_per_rank=lookups * ID_BYTES,
    )


# -- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardPlacement:
    """One shard of the plan, with the planner's estimates for it.

    Attributes:
        rank (int): the device that holds it.
        rows (int): its rows.
        columns (int): its columns.
        row_offset (int): its first row in the table.
        column_offset (int): its first column.
        hbm_bytes (int): the planner's device-memory estimate (table + optimizer state +
            input/output buffers).
        ddr_bytes (int): the planner's host-memory estimate.
        perf_ms (Dict[str, float]): the planner's cost estimate, ms per step (``fwd_compute``,
            ``fwd_comms``, ``bwd_compute``, ``bwd_comms``, ``input_dist_comms``,
            ``prefetch_compute`` and ``total``, torchrec's ``Perf.total``).
    """

    rank: int
    rows: int
    columns: int
    row_offset: int
    column_offset: int
    hbm_bytes: int
    ddr_bytes: int
    perf_ms: Dict[str, float]


@dataclass(frozen=True)
class RankUsage:
    """One device's share: memory and cost, summed over its shards.

    Attributes:
        rank (int): the device.
        shards (int): shards it holds.
        rows (int): table rows it holds (summed over shards; columns may differ).
        table_bytes (int): its shards' table bytes (rows x columns x dtype bytes).
        hbm_bytes (int): the planner's device-memory estimate of its shards.
        ddr_bytes (int): the planner's host-memory estimate of its shards.
        reserved_hbm_bytes (int): device memory the planner reserved (``--storage-reservation``
            and the input buffers).
        reserved_ddr_bytes (int): host memory the planner reserved.
        hbm_capacity_bytes (int): the device's memory.
        ddr_capacity_bytes (int): its host memory.
        perf_ms (Dict[str, float]): the planner's cost estimates, summed over its shards.
        sent_bytes (int): the embedding bytes it sends in the forward all-to-all (receives
            back as gradients), ids spread evenly over the rows.
    """

    rank: int
    shards: int
    rows: int
    table_bytes: int
    hbm_bytes: int
    ddr_bytes: int
    reserved_hbm_bytes: int
    reserved_ddr_bytes: int
    hbm_capacity_bytes: int
    ddr_capacity_bytes: int
    perf_ms: Dict[str, float]
    sent_bytes: int


@dataclass
class PlanReport:
    """What ``tzrec-bench plan`` found.

    Attributes:
        options (Dict[str, Any]): the options, with the defaults filled in.
        derived (Derived): figures from the options alone.
        sharding_type (str): the plan's sharding type.
        compute_kernel (str): the plan's compute kernel.
        shards (List[ShardPlacement]): the shards, by offset.
        ranks (List[RankUsage]): every device, by rank.
        planner_step_ms (float): the slowest rank's total cost, as the planner rates plans.
        link_ms (Dict[str, float]): the link-time estimate per step computed here
            (``forward``, ``backward``, ``ids``, ``total``).
        proposals (int): the plans the planner tried.
        torchrec_version (str): the torchrec that planned it.
        notes (List[str]): remarks printed under the plan (e.g. what data_parallel leaves out).
    """

    options: Dict[str, Any]
    derived: Derived
    sharding_type: str
    compute_kernel: str
    shards: List[ShardPlacement]
    ranks: List[RankUsage]
    planner_step_ms: float
    link_ms: Dict[str, float]
    proposals: int
    torchrec_version: str = ""
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """The report as plain JSON-ready values."""
        return dataclasses.asdict(self)


def _resolved(args: argparse.Namespace) -> Dict[str, Any]:
    """The options with the defaults that depend on others filled in; checks combinations."""
    world = args.world_size
    if args.device == "cpu" and args.hbm is not None:
        raise PlanOptionError("--hbm: a cpu device has no device memory; give its memory "
                              "with --ddr")
    if args.device == "cpu" and args.compute_kernel in ("fused_uvm", "fused_uvm_caching"):
        raise PlanOptionError(f"--compute-kernel {args.compute_kernel}: UVM kernels need "
                              "--device cuda")
    per_host = args.devices_per_host
    if per_host is None:
        per_host = min(8, world) if args.device == "cuda" else world
    if per_host > world:
        raise PlanOptionError(f"--devices-per-host: must be <= --world-size ({world}), got "
                              f"{per_host}")
    intra = args.intra_host_bw if args.intra_host_bw is not None else DEFAULT_INTRA_GBPS
    inter = args.inter_host_bw if args.inter_host_bw is not None else DEFAULT_INTER_GBPS
    if inter > intra:
        raise PlanOptionError(f"--inter-host-bw ({inter:g} GB/s) must not exceed "
                              f"--intra-host-bw ({intra:g} GB/s)")
    hbm = (args.hbm if args.hbm is not None else 80.0) if args.device == "cuda" else 0.0
    ddr = args.ddr if args.ddr is not None else DEFAULT_DDR_GIB
    return {
        "items": args.items, "embedding_dim": args.embedding_dim, "dtype": args.dtype,
        "optimizer": args.optimizer, "world_size": world, "device": args.device,
        "devices_per_host": per_host, "hbm_gib": hbm, "ddr_gib": ddr,
        "intra_host_bw_gbps": intra, "inter_host_bw_gbps": inter,
        "sharding_type": args.sharding_type, "compute_kernel": args.compute_kernel,
        "batch_size": args.batch_size, "ids_per_sample": args.ids_per_sample,
        "storage_reservation": args.storage_reservation,
    }


@contextlib.contextmanager
def _quiet_planner(show_stats: bool) -> Iterator[None]:
    """Silences the planner's warnings (a meta-device dry run is what they warn about);
    with ``show_stats``, prints its EmbeddingStats table to stdout, without log prefixes.

    torchrec also warns through the root logger (``logging.warning``), which would configure
    logging for the whole process; a null handler on the root for the while prevents that.
    """
    root = logging.getLogger()
    planner_log = logging.getLogger("torchrec.distributed.planner")
    stats_log = logging.getLogger("torchrec.distributed.planner.stats")
    saved = (root.level, planner_log.level, stats_log.level, stats_log.propagate)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    null = logging.NullHandler()
    root.addHandler(null)
    root.setLevel(logging.ERROR)
    planner_log.setLevel(logging.ERROR)
    if show_stats:
        stats_log.setLevel(logging.INFO)
        stats_log.propagate = False
        stats_log.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        stats_log.removeHandler(handler)
        root.removeHandler(null)
        root.setLevel(saved[0])
        planner_log.setLevel(saved[1])
        stats_log.setLevel(saved[2])
        stats_log.propagate = saved[3]


def _ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: List[List[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _gib_text(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _bytes_text(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / MIB:,.2f} MiB"


def _no_plan_message(opts: Dict[str, Any], derived: Derived, available_hbm: int,
                     available_ddr: int, torchrec_error: str) -> str:
    """What did not fit and which options change it."""
    dev, world = opts["device"], opts["world_size"]
    need = derived.table_bytes + derived.optimizer_bytes
    memory = "device memory (HBM)" if dev == "cuda" else "host memory"
    offered = available_hbm if dev == "cuda" else available_ddr
    lines = [
        f"no plan fits: the table ({opts['items']:,} x {opts['embedding_dim']} "
        f"{opts['dtype']}, {_gib_text(derived.table_bytes)}) and its {opts['optimizer']} state "
        f"({_gib_text(derived.optimizer_bytes)}) need {_gib_text(need)} before buffers; "
        f"{world} {dev} device(s) offer {_gib_text(offered)} of {memory} in all after the "
        f"planner's reservation",
    ]
    if dev == "cuda":
        lines[0] += (f" ({opts['hbm_gib']:g} GiB each, {opts['storage_reservation']:.0%} "
                     f"reserved), and {_gib_text(available_ddr)} of host memory for the UVM "
                     "kernels")
    lines[0] += "."
    if need <= offered and opts["sharding_type"] in ("table_wise", "column_wise"):
        lines.append(f"That is enough in all, but {opts['sharding_type']} puts the whole table "
                     "(or whole columns of it) on one device.")
    if torchrec_error:
        lines.append(f"torchrec's planner: {torchrec_error}")
    change = ["--world-size (more devices)"]
    if dev == "cpu":
        change.append("--ddr (more memory per device)")
    elif opts["compute_kernel"] == "fused":
        change.append("--hbm (more memory per device)")
    else:
        change.append("--hbm or --ddr (more memory per device; with --ddr the planner may keep "
                      "the table in host memory through a UVM kernel)")
    if opts["dtype"] != "fp16":
        change.append("--dtype fp16 (half the table)")
    if opts["optimizer"] in ("adam", "adagrad"):
        change.append("--optimizer rowwise-adagrad or sgd (less optimizer state)")
    change.append("--items or --embedding-dim (a smaller table)")
    if opts["storage_reservation"] > 0:
        change.append("--storage-reservation (reserve less)")
    if opts["sharding_type"] not in ("row_wise", "auto"):
        change.append(f"--sharding-type row_wise ({opts['sharding_type']} puts whole "
                      "tables or columns on one device)")
    if dev == "cuda" and opts["compute_kernel"] == "fused":
        change.append("--compute-kernel auto with a larger --ddr (the UVM kernels keep the "
                      "table in host memory)")
    lines.append("change: " + "; ".join(change))
    return "\n".join(lines)


def _torchrec_error_line(exc: BaseException) -> str:
    """The line of a PlannerError that says what failed (its last planner error), with its
    storage in GiB and the shard's perf estimate left out."""
    text = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = text[0] if text else type(exc).__name__
    for i, head in enumerate(text):
        if head.startswith("Last planner error") and i + 1 < len(text):
            line = text[i + 1]
    line = re.sub(r", perf: Perf\([^)]*\)", "", line)
    line = re.sub(r"Storage\(hbm=(\d+), ddr=(\d+), ssd=\d+\)( bytes)?",
                  lambda m: f"(HBM {_gib_text(int(m[1]))}, DDR {_gib_text(int(m[2]))})", line)
    return line


def require_torchrec(feature: str) -> ModuleType:
    """``torchrec``, imported for ``feature``.

    Raises:
        ImportError: torchrec is not installed; the message names :data:`EXTRA` and, for a
            machine without CUDA (where the extra pulls the CUDA ``fbgemm-gpu``), the lines
            of :data:`CPU_INSTALL`.
    """
    try:
        return require("torchrec", EXTRA, feature)
    except ImportError as exc:
        raise ImportError(
            f"{exc}; without CUDA, where the extra would take the CUDA fbgemm-gpu: "
            f"{'; then '.join(CPU_INSTALL)}",
            name="torchrec",
        ) from exc


def make_plan(args: argparse.Namespace) -> PlanReport:
    """Plans the table for the options with torchrec's planner.

    Args:
        args: the parsed ``plan`` options (see :func:`add_parser`).

    Returns:
        PlanReport: the plan, memory and costs.

    Raises:
        PlanOptionError: a combination of options that cannot be planned, naming them.
        NoPlanError: no plan fits; the message names the options to change.
        ImportError: torchrec is not installed (see :func:`require_torchrec`).
    """
    opts = _resolved(args)
    torchrec = require_torchrec(FEATURE_NAME)
    planner_mod = importlib.import_module("torchrec.distributed.planner")
    types = importlib.import_module("torchrec.distributed.planner.types")
    reservations = importlib.import_module("torchrec.distributed.planner.storage_reservations")
    stats_mod = importlib.import_module("torchrec.distributed.planner.stats")
    sharders = importlib.import_module("torchrec.distributed.embedding")
    trec_optim = importlib.import_module("torchrec.optim")
    emb_optim = importlib.import_module("fbgemm_gpu.split_embedding_configs").EmbOptimType

    derived = derived_figures(opts["items"], opts["embedding_dim"], opts["dtype"],
                              opts["optimizer"], opts["batch_size"], opts["ids_per_sample"])
    world, per_host = opts["world_size"], opts["devices_per_host"]
    data_type = torchrec.DataType.FP32 if opts["dtype"] == "fp32" else torchrec.DataType.FP16
    optim_type, optim_class, _ = OPTIMIZERS[opts["optimizer"]]

    captured: Dict[str, Any] = {}

    class _Capture(types.Stats):
        """Keeps the planner's best plan (its ShardingOptions carry the estimates)."""

        def log(self, sharding_plan: Any, topology: Any, batch_size: int,
                storage_reservation: Any, num_proposals: int, num_plans: int,
                run_time: float, best_plan: List[Any], *rest: Any, **kwargs: Any) -> None:
            captured.update(best_plan=best_plan, proposals=num_proposals)

    with _quiet_planner(args.torchrec_stats):
        collection = torchrec.EmbeddingCollection(
            tables=[torchrec.EmbeddingConfig(
                name=TABLE, embedding_dim=opts["embedding_dim"], num_embeddings=opts["items"],
                feature_names=[FEATURE], data_type=data_type)],
            device=torch.device("meta"),
        )
        # the planner sizes optimizer state from the optimizer attached to the parameter;
        # the sharder's fused_params name the same optimizer for the fused kernel
        trec_optim.apply_optimizer_in_backward(
            getattr(trec_optim, optim_class), collection.parameters(), {"lr": 0.01})
        sharder = sharders.EmbeddingCollectionSharder(
            fused_params={"optimizer": getattr(emb_optim, optim_type), "learning_rate": 0.01})
        gbps_to_bytes_per_ms = 1e9 / 1e3
        try:
            topology = types.TopologyFactory.create_topology(
                trainer_config=types.TrainerConfig(
                    world_size=world, local_world_size=per_host,
                    hbm_cap_bytes=int(opts["hbm_gib"] * GIB) if opts["device"] == "cuda"
                    else None,
                    ddr_cap_bytes=int(opts["ddr_gib"] * GIB)),
                hardware_config=types.HardwareConfig(
                    intra_host_bw=opts["intra_host_bw_gbps"] * gbps_to_bytes_per_ms,
                    inter_host_bw=opts["inter_host_bw_gbps"] * gbps_to_bytes_per_ms),
                # without use_hardware_based_bandwidth the factory ignores the two bandwidths
                kernel_config=types.KernelConfig(compute_device=opts["device"],
                                                 use_hardware_based_bandwidth=True),
            )
        except ValueError as exc:
            raise PlanOptionError(f"the topology: {exc}") from None
        constraints = {TABLE: planner_mod.ParameterConstraints(
            sharding_types=None if opts["sharding_type"] == "auto" else [opts["sharding_type"]],
            compute_kernels=None if opts["compute_kernel"] == "auto"
            else [opts["compute_kernel"]],
            pooling_factors=[float(opts["ids_per_sample"])],
        )}
        reservation = reservations.HeuristicalStorageReservation(
            percentage=opts["storage_reservation"])
        stats: List[Any] = [_Capture()]
        if args.torchrec_stats:
            stats.append(stats_mod.EmbeddingStats())
        planner = planner_mod.EmbeddingShardingPlanner(
            topology=topology, batch_size=opts["batch_size"], constraints=constraints,
            storage_reservation=reservation, stats=stats)
        available = reservation.reserve(topology, opts["batch_size"], collection, [sharder],
                                        constraints)
        try:
            planner.plan(collection, [sharder])
        except RuntimeError as exc:  # the enumerator: no sharding type and kernel pair left
            if "No available sharding type" not in str(exc):
                raise
            raise PlanOptionError(
                f"--sharding-type {opts['sharding_type']} with --compute-kernel "
                f"{opts['compute_kernel']} on {opts['device']}: torchrec offers no such "
                "pair for an EmbeddingCollection (try --compute-kernel auto)") from None
        except types.PlannerError as exc:
            raise NoPlanError(_no_plan_message(
                opts, derived,
                sum(d.storage.hbm for d in available.devices),
                sum(d.storage.ddr for d in available.devices),
                _torchrec_error_line(exc))) from None

    options = captured["best_plan"]
    if len(options) != 1:  # one table, one sharding option
        raise RuntimeError(f"expected one sharding option for the one table, got {len(options)}")
    option = options[0]
    shards = sorted(
        (ShardPlacement(
            rank=int(s.rank), rows=int(s.size[0]), columns=int(s.size[1]),
            row_offset=int(s.offset[0]), column_offset=int(s.offset[1]),
            hbm_bytes=int(s.storage.hbm), ddr_bytes=int(s.storage.ddr),
            perf_ms={**{k: float(getattr(s.perf, k)) for k in PERF_FIELDS},
                     "total": float(s.perf.total)})
         for s in option.shards),
        key=lambda s: (s.row_offset, s.column_offset, s.rank))

    width = DTYPES[opts["dtype"]]
    lookups_all = world * derived.lookups_per_rank
    ranks: List[RankUsage] = []
    for r, (device, left) in enumerate(zip(topology.devices, available.devices)):
        mine = [s for s in shards if s.rank == r]
        perf = {k: sum(s.perf_ms[k] for s in mine) for k in (*PERF_FIELDS, "total")}
        sent = 0 if option.sharding_type == "data_parallel" else sum(
            lookups_all * s.rows / opts["items"] * s.columns * width for s in mine)
        ranks.append(RankUsage(
            rank=r, shards=len(mine), rows=sum(s.rows for s in mine),
            table_bytes=sum(s.rows * s.columns * width for s in mine),
            hbm_bytes=sum(s.hbm_bytes for s in mine), ddr_bytes=sum(s.ddr_bytes for s in mine),
            reserved_hbm_bytes=int(device.storage.hbm - left.storage.hbm),
            reserved_ddr_bytes=int(device.storage.ddr - left.storage.ddr),
            hbm_capacity_bytes=int(device.storage.hbm),
            ddr_capacity_bytes=int(device.storage.ddr),
            perf_ms=perf, sent_bytes=int(sent)))

    # link time: a rank's bytes go 1/W to each rank, (K-1)/W within its host and (W-K)/W
    # across hosts, at the per-device bandwidths, no overlap, no latency
    per_byte_ms = ((per_host - 1) / world / (opts["intra_host_bw_gbps"] * 1e6)
                   + (world - per_host) / world / (opts["inter_host_bw_gbps"] * 1e6))
    heaviest = max([derived.embedding_bytes_per_rank] + [r.sent_bytes for r in ranks])
    if option.sharding_type == "data_parallel":
        heaviest = 0  # lookups are local; the gradients are all-reduced instead
    link = {"forward": heaviest * per_byte_ms, "backward": heaviest * per_byte_ms,
            "ids": derived.id_bytes_per_rank * per_byte_ms}
    link["total"] = sum(link.values())
    notes = []
    if option.sharding_type == "data_parallel":
        notes.append("data_parallel: every rank holds the whole table; its gradient is "
                     "all-reduced (not counted in the link time)")
    return PlanReport(
        options=opts, derived=derived, sharding_type=str(option.sharding_type),
        compute_kernel=str(option.compute_kernel), shards=shards, ranks=ranks,
        planner_step_ms=max(r.perf_ms["total"] for r in ranks), link_ms=link,
        proposals=int(captured.get("proposals", 0)),
        torchrec_version=str(getattr(torchrec, "__version__", "")), notes=notes)


# -- the report ------------------------------------------------------------------------------


def _shard_lines(report: PlanReport) -> List[str]:
    shards = report.shards
    if len(shards) <= 8:
        return [f"  rank {s.rank}: rows [{s.row_offset:,}, {s.row_offset + s.rows:,}) x "
                f"columns [{s.column_offset}, {s.column_offset + s.columns})" for s in shards]
    lines = []
    groups: List[List[ShardPlacement]] = []
    for s in shards:
        if groups and (groups[-1][0].rows, groups[-1][0].columns) == (s.rows, s.columns):
            groups[-1].append(s)
        else:
            groups.append([s])
    for g in groups:
        first, last = g[0], g[-1]
        count = f"{len(g)} shards" if len(g) > 1 else "1 shard"
        lines.append(
            f"  {count} of {first.rows:,} rows x {first.columns} columns on rank(s) "
            f"{_ranks_text([s.rank for s in g])}: rows from {first.row_offset:,} to "
            f"{last.row_offset + last.rows:,}, columns from {first.column_offset} to "
            f"{last.column_offset + last.columns}")
    return lines


def _grouped(ranks: List[RankUsage], cells: Any) -> List[Tuple[str, List[str]]]:
    """Consecutive ranks with the same printed cells, as ``("0-63", cells)``."""
    rows: List[Tuple[List[int], List[str]]] = []
    for r in ranks:
        c = cells(r)
        if rows and rows[-1][1] == c:
            rows[-1][0].append(r.rank)
        else:
            rows.append(([r.rank], c))
    return [(_ranks_text(rs), c) for rs, c in rows]


def _table(header: Sequence[str], rows: List[Tuple[str, List[str]]]) -> List[str]:
    cols = [list(header)] + [[name, *cells] for name, cells in rows]
    widths = [max(len(row[i]) for row in cols) for i in range(len(header))]
    out = []
    for row in cols:
        out.append("  " + "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
            enumerate(zip(row, widths))).rstrip())
    return out


def format_report(report: PlanReport) -> str:
    """The report as the command prints it."""
    o, d = report.options, report.derived
    optim_type = OPTIMIZERS[o["optimizer"]][0]
    hosts = -(-o["world_size"] // o["devices_per_host"])
    width = DTYPES[o["dtype"]]
    memory = (f"{o['hbm_gib']:g} GiB device memory and {o['ddr_gib']:g} GiB host memory each"
              if o["device"] == "cuda" else f"{o['ddr_gib']:g} GiB memory each")
    state = _state_values_per_row(o["optimizer"], o["embedding_dim"])
    out = [
        f"tzrec-bench plan: torchrec {report.torchrec_version}'s EmbeddingShardingPlanner on "
        "the meta device (estimates: nothing allocated or measured)",
        "",
        f"table     '{TABLE}' (feature '{FEATURE}'): {o['items']:,} x {o['embedding_dim']} "
        f"{o['dtype']}, optimizer {o['optimizer']} (EmbOptimType.{optim_type})",
        f"devices   {o['world_size']} x {o['device']}, {o['devices_per_host']} per host "
        f"({hosts} host{'s' if hosts > 1 else ''}); {memory}",
        f"links     {o['intra_host_bw_gbps']:.4g} GB/s per device within a host, "
        f"{o['inter_host_bw_gbps']:.4g} GB/s across hosts",
        f"inputs    per rank and step: {o['batch_size']:,} samples x {o['ids_per_sample']:,} "
        f"ids = {d.lookups_per_rank:,} lookups",
        f"planner   sharding {report.sharding_type} (asked: {o['sharding_type']}), kernel "
        f"{report.compute_kernel} (asked: {o['compute_kernel']}), storage reservation "
        f"{o['storage_reservation']:.0%}, proposals tried: {report.proposals}",
        "",
        "From the options (computed here, not by torchrec):",
    ]
    even = (d.table_bytes + d.optimizer_bytes) / o["world_size"]
    figures = [
        ("table", _gib_text(d.table_bytes),
         f"{o['items']:,} x {o['embedding_dim']} x {width} B"),
        ("optimizer state", _gib_text(d.optimizer_bytes),
         f"{o['optimizer']}: {state:,} fp32 value{'s' if state != 1 else ''} per row"),
        ("table + state / device", _gib_text(even),
         f"if spread evenly over {o['world_size']} devices"),
        ("embedding all-to-all", _bytes_text(d.embedding_bytes_per_rank),
         f"{d.lookups_per_rank:,} x {o['embedding_dim']} x {width} B per rank and step, "
         "forward (rows in) and backward (gradients out)"),
        ("id all-to-all", _bytes_text(d.id_bytes_per_rank),
         f"{d.lookups_per_rank:,} int64 ids per rank and step, forward"),
    ]
    w0 = max(len(f[0]) for f in figures)
    w1 = max(len(f[1]) for f in figures)
    out += [f"  {a.ljust(w0)}  {b.rjust(w1)}  {c}" for a, b, c in figures]

    out += ["", f"Plan: '{TABLE}' {report.sharding_type}, kernel {report.compute_kernel}, "
            f"{len(report.shards)} shard(s)"]
    out += _shard_lines(report)
    out += report.notes and [f"  note: {n}" for n in report.notes] or []

    out += ["", "Memory per device, GiB (the planner's estimates; shards: table + optimizer "
            "state + buffers,", "reserved: --storage-reservation + input buffers):"]
    g = lambda n: f"{n / GIB:,.2f}"  # noqa: E731
    if o["device"] == "cuda":
        header = ["ranks", "rows", "table", "HBM shards", "reserved", "HBM total", "of",
                  "DDR shards", "of"]
        cells = lambda r: [f"{r.rows:,}", g(r.table_bytes), g(r.hbm_bytes),  # noqa: E731
                           g(r.reserved_hbm_bytes), g(r.hbm_bytes + r.reserved_hbm_bytes),
                           g(r.hbm_capacity_bytes), g(r.ddr_bytes), g(r.ddr_capacity_bytes)]
    else:
        header = ["ranks", "rows", "table", "shards", "reserved", "total", "of"]
        cells = lambda r: [f"{r.rows:,}", g(r.table_bytes), g(r.ddr_bytes),  # noqa: E731
                           g(r.reserved_ddr_bytes), g(r.ddr_bytes + r.reserved_ddr_bytes),
                           g(r.ddr_capacity_bytes)]
    out += _table(header, _grouped(report.ranks, cells))

    out += ["", "Planner's cost estimates, ms per rank and step (its perf model, not measured):"]
    f = lambda x: f"{x:,.3f}"  # noqa: E731
    keys = ["fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist_comms"]
    if any(r.perf_ms["prefetch_compute"] for r in report.ranks):
        keys.append("prefetch_compute")
    header = ["ranks", *[k.replace("_comms", " comms").replace("_compute", " compute")
                         .replace("input_dist", "input dist") for k in keys], "total"]
    out += _table(header, _grouped(
        report.ranks, lambda r: [f(r.perf_ms[k]) for k in keys] + [f(r.perf_ms["total"])]))
    out.append(f"  step estimate: {report.planner_step_ms:,.3f} ms, the slowest rank's total "
               "(how the planner rates plans; input dist is not in it)")

    link = report.link_ms
    out += [
        "",
        "Link time per step (computed here: ids spread evenly over rows, each rank's bytes "
        "1/W to every rank,",
        f"(K-1)/W within its host at {o['intra_host_bw_gbps']:.4g} GB/s and (W-K)/W across "
        f"hosts at {o['inter_host_bw_gbps']:.4g} GB/s; no overlap, no latency):",
        f"  forward all-to-all {link['forward']:,.3f} ms + backward {link['backward']:,.3f} ms "
        f"+ ids {link['ids']:,.3f} ms = {link['total']:,.3f} ms",
    ]
    busiest = max(report.ranks, key=lambda r: r.sent_bytes)
    if busiest.sent_bytes > 1.01 * d.embedding_bytes_per_rank:
        out.append(f"  rank {busiest.rank} sends {_bytes_text(busiest.sent_bytes)} of rows per "
                   "step (its shards' part of every rank's lookups) while each rank receives "
                   f"{_bytes_text(d.embedding_bytes_per_rank)}: the time above is for the "
                   "busiest rank")
    return "\n".join(out)


# -- the command -----------------------------------------------------------------------------


def run(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Plans, prints the report (and writes ``--json``); 0, or 2 with one message on stderr
    for a bad option, no plan that fits, or torchrec missing."""
    prog = parser.prog if parser is not None else "tzrec-bench plan"
    try:
        report = make_plan(args)
    except (PlanOptionError, NoPlanError, ImportError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"\njson: {path}")
    return 0
