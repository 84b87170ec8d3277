"""The load test's timed run: a session serves the stream, then the checked answers are
computed again by the model's full forward."""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from tzrec_bench.load_test.stream import Check, Request, _calls, make_stream
from tzrec_gr.features import (
    CANDIDATE_ITEM_ID,
    CANDIDATE_LENGTHS,
    CANDIDATE_TIMESTAMPS,
    QUERY_TIME,
    UIH_ACTIONS,
    UIH_ITEM_ID,
    UIH_LENGTHS,
    UIH_TIMESTAMPS,
)
from tzrec_gr.models import HSTURanking, HSTURetrieval
from tzrec_gr.serving import Candidates, Histories, ServingSession
from tzrec_ops.tolerances import Tolerance, tolerance

__all__ = ["DTYPES", "LoadTestResult", "build_model", "percentile", "run_load_test"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}



@dataclasses.dataclass
class LoadTestResult:
    """What :func:`run_load_test` measured.

    Attributes:
        sent (int): timed requests in the stream.
        served (int): timed requests answered.
        latencies_ms (List[float]): per timed request, completion minus due time.
        elapsed_s (float): from the first due time to the last completion.
        events (int): events sent by the timed requests (open and extend).
        kinds (Dict[str, int]): timed requests per kind.
        calls (int): session calls of the timed run.
        checks (int): scoring requests recomputed with the full forward.
        max_abs_diff (float): the largest |served - full forward| over them.
        worst_ratio (float): the largest |served - full forward| / allowed (<= 1 passes).
        tolerance (Tolerance): the one used.
        graph_stats (Dict[str, Any]): ``session.graph_stats()``.
        errors (List[str]): the session calls that raised (their requests are not served).
    """

    sent: int
    served: int
    latencies_ms: List[float]
    elapsed_s: float
    events: int
    kinds: Dict[str, int]
    calls: int
    checks: int
    max_abs_diff: float
    worst_ratio: float
    tolerance: Tolerance
    graph_stats: Dict[str, Any]
    errors: List[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Nothing dropped and every check within the tolerance."""
        return self.served == self.sent and self.checks > 0 and self.worst_ratio <= 1.0

    def percentiles(self) -> Dict[str, float]:
        """p50, p90, p99 and max latency in ms."""
        lat = self.latencies_ms
        return {
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "max": max(lat) if lat else math.nan,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated between the closest ranks
    (NaN for no values)."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(math.floor(pos))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model of ``args`` with random weights (seeded), in eval mode and ``args.dtype``."""
    torch.manual_seed(args.seed)
    head = args.dim // args.heads
    common = dict(num_heads=args.heads, attention_dim=head, hidden_dim=head,
                  num_layers=args.layers, dropout_ratio=0.0, backend=args.backend,
                  device=torch.device(args.device))
    model: torch.nn.Module
    if args.model == "ranking":
        model = HSTURanking(
            args.items, args.dim, args.dim, [1, 2], [1, 2, 4], **common,
            max_uih_len=args.max_history, max_targets=args.candidates,
            use_time_encoding=not args.no_time_encoding,
        )
    else:
        model = HSTURetrieval(args.items, args.dim, **common, max_seq_len=args.max_history)
    return model.eval().to(DTYPES[args.dtype])


def _histories(group: List[Request]) -> Histories:
    return Histories(
        item_ids=torch.cat([r.item_ids for r in group]),
        lengths=torch.tensor([r.item_ids.numel() for r in group], dtype=torch.int64),
        timestamps=torch.cat([r.timestamps for r in group]),
        actions=torch.cat([r.actions for r in group]),
    )


def _serve(
    session: ServingSession, kind: str, group: List[Request], k: int
) -> List[Optional[Tuple[torch.Tensor, ...]]]:
    """One session call for ``group``; returns each request's answer (on the host) or None."""
    users = [r.user for r in group]
    if kind == "open":
        session.open(users, _histories(group))
    elif kind == "extend":
        session.extend(users, _histories(group))
    elif session.kind == "ranking":
        lengths = torch.tensor([r.item_ids.numel() for r in group], dtype=torch.int64)
        probs = session.score(users, Candidates(torch.cat([r.item_ids for r in group]), lengths))
        return [(rows,) for rows in probs.cpu().split(lengths.tolist())]
    else:
        top = session.recommend(users, k)
        ids, scores = top.ids.cpu(), top.scores.cpu()
        return [(ids[b], scores[b]) for b in range(len(group))]
    if session.device.type == "cuda":
        torch.cuda.synchronize(session.device)
    return [None] * len(group)


def _reference(
    model: torch.nn.Module, check: Check, k: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(served values, the full forward's values at the same places), float64 on the host."""
    assert check.served is not None
    n = check.item_ids.numel()
    ids, times = check.item_ids.to(device), check.timestamps.to(device)
    lengths = torch.tensor([n], dtype=torch.int64, device=device)
    with torch.no_grad():
        if isinstance(model, HSTURanking):
            cands = check.request.item_ids
            t = cands.numel()
            query = check.timestamps[-1:].to(device)  # the session's query time: newest event
            batch = {
                UIH_ITEM_ID: ids, UIH_LENGTHS: lengths, UIH_TIMESTAMPS: times,
                UIH_ACTIONS: check.actions.to(device),
                CANDIDATE_ITEM_ID: cands.to(device),
                CANDIDATE_LENGTHS: torch.tensor([t], dtype=torch.int64, device=device),
                CANDIDATE_TIMESTAMPS: query.repeat(t), QUERY_TIME: query,
            }
            want = torch.sigmoid(model(batch).float()).double().cpu()
            return check.served[0].double(), want
        user = model.user_embedding(ids, lengths, times)[0].double()
        items = model.item_embedding(torch.arange(model.num_items, device=device)).double()
        scores = (items @ user).cpu()
        seen = torch.zeros(model.num_items, dtype=torch.bool)
        seen[check.item_ids] = True
        scores[seen] = -math.inf
        best = scores.topk(k).values
        served_ids, served_scores = check.served
        valid = served_ids >= 0
        # the served scores at their ids, and in rank order against the exact top-K
        got = torch.cat([served_scores[valid].double(), served_scores[valid].double()])
        want = torch.cat([scores[served_ids[valid]], best[valid]])
        return got, want


def run_load_test(
    args: argparse.Namespace, session: Optional[ServingSession] = None, log: Any = None
) -> LoadTestResult:
    """Run the load test of ``args`` (the command's options, see :func:`main`).

    Args:
        args: parsed and resolved options (:func:`main` resolves them).
        session: the session to load (default: a new one over :func:`build_model`).
        log: a ``print``-like callable for progress lines. Default: none.

    Returns:
        LoadTestResult: latencies, throughput, counts and the correctness check.
    """
    device = torch.device(args.device)
    if session is None:
        session = ServingSession(build_model(args), device=device)
    requests, checks = make_stream(args, args.warmup + args.requests)
    by_index = {c.request.index: c for c in checks}
    warm, timed = requests[: args.warmup], requests[args.warmup:]
    errors: List[str] = []

    def serve(kind: str, group: List[Request]) -> List[Optional[Tuple[torch.Tensor, ...]]]:
        try:
            return _serve(session, kind, group, args.k)
        except Exception as exc:  # the server drops these requests and goes on
            errors.append(f"{kind} of users {[r.user for r in group]} (requests "
                          f"{[r.index for r in group]}): {type(exc).__name__}: {exc}")
            return []

    # the CUDA graphs of every batch size up to --max-batch (the session's largest bucket:
    # 64), captured before the clock
    sizes = {"k": [args.k]} if session.kind == "retrieval" else {"candidates": [args.candidates]}
    report = session.warm_up(batch_sizes=range(1, min(args.max_batch, 64) + 1), **sizes)
    if log:
        log(f"  graph warm-up: {len(report['captured'])} captured in {report['seconds']:.1f} s"
            + (f" ({report['reason']})" if report["reason"] else ""))
    for kind, group in _calls(warm, args.max_batch):
        for req, answer in zip(group, serve(kind, group)):
            if req.index in by_index:
                by_index[req.index].served = answer
    if log:
        log(f"  warm-up: {len(warm)} requests served, the clock starts")
    latencies: List[float] = []
    served = calls = 0
    start = time.perf_counter()
    due = [start + i / args.rate for i in range(len(timed))]
    done = start
    nxt = 0
    while nxt < len(timed):
        now = time.perf_counter()
        if due[nxt] > now:
            time.sleep(due[nxt] - now)
            now = time.perf_counter()
        stop = nxt
        while stop < len(timed) and stop - nxt < args.max_batch and due[stop] <= now:
            stop += 1
        stop = max(stop, nxt + 1)
        for kind, group in _calls(timed[nxt:stop], args.max_batch):
            answers = serve(kind, group)
            done = time.perf_counter()
            calls += 1
            for req, answer in zip(group, answers):
                latencies.append((done - due[req.index - args.warmup]) * 1e3)
                served += 1
                if req.index in by_index:
                    by_index[req.index].served = answer
        nxt = stop
    elapsed = done - start
    if log:
        log(f"  {served} requests served in {elapsed:.2f} s; checking {len(checks)} answers "
            "against the full forward")
    tol = tolerance(DTYPES[args.dtype])
    max_abs = worst = 0.0
    for check in checks:
        if check.served is None:  # dropped: counted above
            continue
        got, want = _reference(session.model, check, args.k, device)
        diff = (got - want).abs()
        allowed = tol.atol * float(want.abs().max()) + tol.rtol * want.abs()
        max_abs = max(max_abs, float(diff.max()))
        worst = max(worst, float((diff / allowed.clamp(min=1e-300)).max()))
    kinds: Dict[str, int] = {}
    for req in timed:
        kinds[req.kind] = kinds.get(req.kind, 0) + 1
    return LoadTestResult(
        sent=len(timed),
        served=served,
        latencies_ms=latencies,
        elapsed_s=elapsed,
        events=sum(r.item_ids.numel() for r in timed if r.kind != "score"),
        kinds=kinds,
        calls=calls,
        checks=sum(c.served is not None for c in checks),
        max_abs_diff=max_abs,
        worst_ratio=worst,
        tolerance=tol,
        graph_stats=session.graph_stats(),
        errors=errors,
    )
