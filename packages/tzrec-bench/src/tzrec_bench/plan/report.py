"""What a plan holds (shards, each rank's memory and costs) and its printed report."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

from tzrec_bench.plan.options import (
    DTYPES,
    FEATURE,
    GIB,
    MIB,
    OPTIMIZERS,
    TABLE,
    Derived,
    state_values_per_row,
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
    state = state_values_per_row(o["optimizer"], o["embedding_dim"])
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


