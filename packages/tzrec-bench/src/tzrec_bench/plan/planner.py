"""torchrec's sharding planner run on the ``meta`` device for a simulated topology."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterator, List, Optional

import torch

from tzrec_bench.plan.options import (
    CPU_INSTALL,
    DEFAULT_DDR_GIB,
    DEFAULT_INTER_GBPS,
    DEFAULT_INTRA_GBPS,
    DTYPES,
    EXTRA,
    FEATURE,
    FEATURE_NAME,
    GIB,
    OPTIMIZERS,
    PERF_FIELDS,
    TABLE,
    Derived,
    NoPlanError,
    PlanOptionError,
    derived_figures,
)
from tzrec_bench.plan.report import (
    PlanReport,
    RankUsage,
    ShardPlacement,
    _gib_text,
    format_report,
)
from tzrec_ops.extras import require


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
