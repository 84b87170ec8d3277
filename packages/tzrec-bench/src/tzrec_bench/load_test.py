"""Load test of ``tzrec_gr.serving.ServingSession``: a stream of requests at a target rate.

    python -m tzrec_bench.load_test                          # CPU, tiny model, ~10-20 s
    python -m tzrec_bench.load_test --device cuda --model ranking --max-batch 16

One session serves a stream of requests, open-loop: request i is due ``i / --rate`` seconds
after the start, whether or not the server has finished the ones before it, and its latency
is its completion time minus its due time, so a server that falls behind shows its queue in
the latency. The stream is drawn before the clock starts (``--seed``): each request names a
user drawn from a power law over ``--users`` users (probability of the r-th user
proportional to ``r ** -zipf``) and is either

* new events for that user (``--extend-fraction`` of the requests): ``session.extend``, the
  user's history grows (the session keeps the newest events the model takes);
* a scoring request: ``session.score`` of ``--candidates`` random candidates
  (``--model ranking``, HSTURanking) or ``session.recommend`` of the top ``--k`` items of the
  catalogue (``--model retrieval``, HSTURetrieval);

and a user's first request opens the user (``session.open``) with a ``--history``-event
starting history instead. Requests are served one at a time by default (B = 1); with
``--max-batch M`` the server takes up to M requests that are already due and serves them in
as few calls as it can (one call per kind, each user at most once per call, each user's
requests in stream order), as a micro-batching server does.

Reported: p50/p90/p99/max latency (ms), the achieved requests/s and events/s, requests
served against requests sent (all must be served: exit 1 otherwise), the session's CUDA
graphs on a GPU, and a correctness check: every ``--check-every``-th scoring request is
answered again, after the timed run, by the model's full forward over the user's whole
history at that moment (kept on the host by the load test, apart from the session) and the
served answer must equal it within the dtype's forward tolerance
(:func:`tzrec_ops.tolerances.tolerance`, the one the tzrec tests hold the backends to; exit 1
otherwise). The model has random weights (``--seed``): the check compares two ways of
computing the same function, which needs no training.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

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

__all__ = [
    "CPU_DEFAULTS",
    "CUDA_DEFAULTS",
    "Check",
    "LoadTestResult",
    "Request",
    "build_model",
    "main",
    "make_stream",
    "percentile",
    "run_load_test",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: simulated seconds between two requests of the stream (the events' timestamps)
GAP_S = 60


#: defaults of the options left out, on the CPU (a tiny model, ~10-20 s) and on a GPU (the
#: serving benchmark's model: HSTURanking E=512, 4 heads, 3 layers, bf16)
CPU_DEFAULTS: Dict[str, Any] = {
    "dtype": "fp32", "dim": 32, "heads": 2, "layers": 2, "items": 1000, "users": 200,
    "history": 32, "max_history": 128, "candidates": 8, "rate": 40.0, "duration": 10.0,
}
CUDA_DEFAULTS: Dict[str, Any] = {
    "dtype": "bf16", "dim": 512, "heads": 4, "layers": 3, "items": 100_000, "users": 1000,
    "history": 1000, "max_history": 2048, "candidates": 8, "rate": 200.0, "duration": 20.0,
}


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of the stream.

    Attributes:
        index (int): its place in the stream (due at ``index / rate`` seconds).
        user (int): the user.
        kind (str): ``"open"`` (first sight: ``item_ids`` is the starting history),
            ``"extend"`` (new events) or ``"score"`` (``item_ids`` are the candidates of a
            ranking model; empty for ``recommend``).
        item_ids (torch.Tensor): [n] int64.
        timestamps (torch.Tensor): [n] int64 (events only).
        actions (torch.Tensor): [n] int64 action bitmasks (events of a ranking model).
    """

    index: int
    user: int
    kind: str
    item_ids: torch.Tensor
    timestamps: torch.Tensor
    actions: torch.Tensor


@dataclasses.dataclass
class Check:
    """A scoring request to answer again with the full forward: the user's history when it
    was served (the newest events the model takes) and what the session answered."""

    request: Request
    item_ids: torch.Tensor
    timestamps: torch.Tensor
    actions: torch.Tensor
    served: Optional[Tuple[torch.Tensor, ...]] = None


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tzrec_bench.load_test", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda. Default: cpu")
    p.add_argument("--model", choices=["ranking", "retrieval"], default="ranking")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--backend", help="ops backend (default: the best available)")
    p.add_argument("--dim", type=int, help="E (CPU 32, CUDA 512)")
    p.add_argument("--heads", type=int, help="H (CPU 2, CUDA 4)")
    p.add_argument("--layers", type=int, help="STU layers (CPU 2, CUDA 3)")
    p.add_argument("--items", type=int, help="catalogue size (CPU 1,000, CUDA 100,000)")
    p.add_argument("--no-time-encoding", action="store_true",
                   help="ranking without time encoding: extend runs only the new events")
    p.add_argument("--users", type=int, help="distinct users (CPU 200, CUDA 1,000)")
    p.add_argument("--zipf", type=float, default=1.1,
                   help="power-law exponent of the users' popularity. Default: 1.1")
    p.add_argument("--history", type=int, help="events of a user's starting history "
                   "(CPU 32, CUDA 1,000)")
    p.add_argument("--max-history", type=int, help="the most events the model takes; longer "
                   "histories keep their newest (CPU 128, CUDA 2,048)")
    p.add_argument("--events", type=int, default=4,
                   help="the most new events per extend request (1 to this). Default: 4")
    p.add_argument("--candidates", type=int, help="T candidates per ranking request (8)")
    p.add_argument("--k", type=int, default=10, help="top-K of a retrieval request. Default: 10")
    p.add_argument("--extend-fraction", type=float, default=0.5,
                   help="share of requests that are new events. Default: 0.5")
    p.add_argument("--rate", type=float, help="target requests/s (CPU 40, CUDA 200)")
    p.add_argument("--duration", type=float, help="seconds of requests at --rate (CPU 10, "
                   "CUDA 20)")
    p.add_argument("--requests", type=int, help="number of requests (instead of --duration)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="the most due requests served together. Default: 1 (one at a time)")
    p.add_argument("--warmup", type=int, default=10,
                   help="requests served before the clock starts (untimed). Default: 10")
    p.add_argument("--check-every", type=int, default=50,
                   help="recompute every n-th scoring request with the full forward. "
                   "Default: 50")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (torch.set_num_threads). Default: torch's")
    p.add_argument("--seed", type=int, default=0)
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left out from the device's defaults and check them all."""
    defaults = CUDA_DEFAULTS if torch.device(args.device).type == "cuda" else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.requests is None:
        args.requests = max(1, int(round(args.duration * args.rate)))
    positive = ("dim", "heads", "layers", "items", "users", "history", "max_history", "events",
                "candidates", "k", "requests", "max_batch", "check_every")
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.rate > 0:
        raise ValueError(f"--rate must be > 0, got {args.rate}")
    if not 0 <= args.extend_fraction <= 1:
        raise ValueError(f"--extend-fraction must be in [0, 1], got {args.extend_fraction}")
    if args.zipf < 0:
        raise ValueError(f"--zipf must be >= 0, got {args.zipf}")
    if args.dim % args.heads:
        raise ValueError(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.history > args.max_history:
        raise ValueError(
            f"--history ({args.history}) must be at most --max-history ({args.max_history})"
        )
    if args.model == "retrieval" and args.k > args.items:
        raise ValueError(f"--k ({args.k}) must be at most --items ({args.items})")
    return args


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


def make_stream(args: argparse.Namespace, count: int) -> Tuple[List[Request], List[Check]]:
    """``count`` requests drawn from ``args`` (seeded), and the scoring requests to check.

    Request i happens at simulated time ``i * GAP_S`` seconds: its new events carry that
    time, a starting history ends at it (one event per ``GAP_S`` before). The histories
    are followed on the host (the newest ``--max-history`` events, as the session keeps
    them), so every ``--check-every``-th scoring request carries the history it is served
    against.
    """
    gen = torch.Generator().manual_seed(args.seed)
    weights = torch.arange(1, args.users + 1, dtype=torch.float64).pow(-args.zipf)
    users = torch.multinomial(weights, count, replacement=True, generator=gen).tolist()
    extend = (torch.rand(count, generator=gen, dtype=torch.float64) < args.extend_fraction)
    ranking = args.model == "ranking"
    histories: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    requests: List[Request] = []
    checks: List[Check] = []
    scored = 0
    empty = torch.zeros(0, dtype=torch.int64)
    for i, user in enumerate(users):
        now = i * GAP_S
        if user not in histories or bool(extend[i]):
            first = user not in histories
            n = args.history if first else int(torch.randint(1, args.events + 1, (1,),
                                                             generator=gen))
            ids = torch.randint(0, args.items, (n,), generator=gen)
            times = (now - GAP_S * torch.arange(n - 1, -1, -1)) if first else torch.full((n,), now)
            actions = torch.randint(0, 8, (n,), generator=gen)
            requests.append(Request(i, user, "open" if first else "extend", ids, times, actions))
            if first:
                histories[user] = (ids, times, actions)
            else:
                histories[user] = tuple(  # type: ignore[assignment]
                    torch.cat([old, new])[-args.max_history:]
                    for old, new in zip(histories[user], (ids, times, actions))
                )
            continue
        cands = empty
        if ranking:
            cands = torch.randint(0, args.items, (args.candidates,), generator=gen)
        req = Request(i, user, "score", cands, empty, empty)
        requests.append(req)
        if scored % args.check_every == 0:
            checks.append(Check(req, *histories[user]))
        scored += 1
    return requests, checks


def _calls(window: List[Request], max_batch: int) -> List[Tuple[str, List[Request]]]:
    """The window's requests as session calls: one kind per call, at most ``max_batch``
    users, a user at most once per call, each user's requests in stream order (a request
    goes into the first call of its kind after its user's previous call)."""
    calls: List[Tuple[str, List[Request]]] = []
    members: List[set] = []
    last: Dict[int, int] = {}
    for req in window:
        start = last.get(req.user, -1) + 1
        for c in range(start, len(calls)):
            kind, group = calls[c]
            if kind == req.kind and req.user not in members[c] and len(group) < max_batch:
                break
        else:
            c = len(calls)
            calls.append((req.kind, []))
            members.append(set())
        calls[c][1].append(req)
        members[c].add(req.user)
        last[req.user] = c
    return calls


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


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def _graph_line(stats: Dict[str, Any]) -> str:
    if not stats.get("enabled"):
        return "off"
    graphs = stats.get("graphs", [])
    capture_ms = sum(g.get("capture_ms", 0.0) for g in graphs)
    memory = sum(g.get("memory_bytes", 0) for g in graphs) / 2**20
    return (f"{stats['captures']} captured ({capture_ms:.1f} ms, {memory:.1f} MiB), "
            f"{stats['replays']} replays, {stats['eager_calls']} eager calls, "
            f"{len(stats.get('failed', {}))} failed")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the load test; returns 0 when every request was served and every checked answer
    equals the full forward's within the tolerance, 1 otherwise, 2 on bad options."""
    parser = _parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("load_test: no CUDA device; pass --device cpu", file=sys.stderr)
        return 2
    try:
        args = _resolve(args)
    except ValueError as exc:
        print(f"load_test: {exc}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name = "HSTURanking" if args.model == "ranking" else "HSTURetrieval"
    what = (f"{args.candidates} candidates" if args.model == "ranking" else f"top-{args.k} of "
            f"{args.items:,} items")
    print(f"load_test: {name} E={args.dim}, {args.heads} heads, {args.layers} layers, "
          f"{args.dtype}, backend {args.backend or 'auto'}, {device} ({_device_name(device)}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.users:,} users "
          f"(zipf {args.zipf}), histories "
          f"{args.history} events (at most {args.max_history}), +1..{args.events} per extend, "
          f"{what}; {args.requests:,} requests at {args.rate:g}/s, extend fraction "
          f"{args.extend_fraction}, max batch {args.max_batch}, warm-up {args.warmup}",
          flush=True)
    result = run_load_test(args, log=lambda line: print(line, flush=True))
    pct = result.percentiles()
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.kinds.items()))
    print(f"  requests: {result.served} served of {result.sent} sent ({kinds}) in "
          f"{result.calls} session calls, {len(result.errors)} failed")
    print("  latency (completion - due): " + ", ".join(f"{k} {v:.2f} ms" for k, v in pct.items()))
    rps = result.served / result.elapsed_s if result.elapsed_s > 0 else math.nan
    eps = result.events / result.elapsed_s if result.elapsed_s > 0 else math.nan
    print(f"  throughput: {rps:.1f} requests/s (target {args.rate:g}), {eps:.1f} events/s")
    if device.type == "cuda":
        print(f"  CUDA graphs: {_graph_line(result.graph_stats)}")
    tol = result.tolerance
    print(f"  correctness: {result.checks} scoring requests against the full forward, max "
          f"|served - full| {result.max_abs_diff:.3g}, worst {result.worst_ratio:.3g} of the "
          f"{args.dtype} tolerance (|d| <= {tol.atol:g} * max|full| + {tol.rtol:g} * |full|)")
    status = 0
    if result.served != result.sent:
        print(f"load_test: FAILED: {result.sent - result.served} requests dropped",
              file=sys.stderr)
        for error in result.errors[:3]:
            print(f"  {error}", file=sys.stderr)
        status = 1
    if result.checks == 0:
        print("load_test: FAILED: no scoring request was checked; lower --check-every or "
              "--extend-fraction, or send more --requests", file=sys.stderr)
        status = 1
    elif result.worst_ratio > 1.0:
        print(f"load_test: FAILED: served answers differ from the full forward by "
              f"{result.worst_ratio:.3g}x the {args.dtype} tolerance", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
