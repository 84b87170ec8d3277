"""What ``tzrec_gr.serving.ServingSession`` costs per ranking request, beside the server's
own calls and a hand-captured CUDA graph.

    python -m tzrec_bench.benchmarks.serving                     # the default shapes, on CUDA
    python -m tzrec_bench.benchmarks.serving --device cpu --users 4 --history 64 --dim 64

HSTURanking (E = ``--dim``, ``--heads`` heads of ``dim / heads``, ``--layers`` layers) scores
``--candidates`` candidates for each of ``--users`` users against their ``--history``-event
histories, weights in ``--dtype``. Timed, median ms per call (``tzrec_ops.measure``):

1. the full forward over history + candidates (what a server without a cache runs);
2. ``RankingServer.score`` on the cache that its ``prefill`` built (eager: host launch
   cost);
3. ``session.score`` of the opened users (the API a server calls; CUDA graphs inside);
4. the same session with ``cuda_graphs="off"``;
5. ``RankingServer.score_step`` replayed from a graph captured by hand (the floor for 3).

Then ratios: full forward / session and hand-captured / session, the session's capture
time and graph memory, and the largest difference between the session's probabilities and
the eager server's.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

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
from tzrec_gr.models import HSTURanking
from tzrec_gr.serving import Candidates, Histories, RankingServer, ServingSession
from tzrec_ops.commandline import ArgumentParser
from tzrec_ops.devices import add_device_option
from tzrec_ops.measure import cuda_graph_replay, median_ms

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GAP_S = 60


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m tzrec_bench.benchmarks.serving",
                       description=__doc__.split("\n")[0])
    add_device_option(p, "cuda")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--backend", help="ops backend (default: the best available)")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--history", type=int, default=2000)
    p.add_argument("--candidates", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--items", type=int, default=100_000)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    device = args.device
    b, n, t = args.users, args.history, args.candidates
    torch.manual_seed(0)
    model = HSTURanking(
        args.items, args.dim, args.dim, [1, 2], [1, 2, 4], num_heads=args.heads,
        attention_dim=args.dim // args.heads, hidden_dim=args.dim // args.heads,
        num_layers=args.layers, dropout_ratio=0.0, max_uih_len=n, max_targets=t,
        backend=args.backend, device=device,
    ).eval().to(DTYPES[args.dtype])
    ids = torch.randint(0, args.items, (b * n,))
    times = (torch.arange(n) * GAP_S).repeat(b)
    actions = torch.randint(0, 8, (b * n,))
    query = torch.full((b,), n * GAP_S + 600)
    cand_ids = torch.randint(0, args.items, (b * t,))
    histories = Histories(ids, torch.full((b,), n), times, actions, query_time=query)
    candidates = Candidates(cand_ids, torch.full((b,), t))
    users = list(range(b))

    history = {UIH_ITEM_ID: ids, UIH_LENGTHS: torch.full((b,), n), UIH_ACTIONS: actions,
               UIH_TIMESTAMPS: times}
    cands = {CANDIDATE_ITEM_ID: cand_ids, CANDIDATE_LENGTHS: torch.full((b,), t),
             CANDIDATE_TIMESTAMPS: query.repeat_interleave(t)}
    history = {k: v.to(device) for k, v in history.items()}
    cands = {k: v.to(device) for k, v in cands.items()}
    full = {**history, **cands, QUERY_TIME: query.to(device)}

    session = ServingSession(model, device=device)
    session.open(users, histories)
    eager_session = ServingSession(model, device=device, cuda_graphs="off")
    eager_session.open(users, histories)
    server = RankingServer(model)
    with torch.no_grad():
        cache = server.prefill(history, query.to(device))
        want = torch.sigmoid(server.score(cache, cands).float())
        got = session.score(users, candidates).float()
        rows = [
            ("1. full forward (eager)", median_ms(lambda: model(full), device)),
            ("2. server.score (eager)", median_ms(lambda: server.score(cache, cands), device)),
            ("3. session.score", median_ms(lambda: session.score(users, candidates), device)),
            ("4. session.score, cuda_graphs=off",
             median_ms(lambda: eager_session.score(users, candidates), device)),
        ]
        if device.type == "cuda":
            replay = cuda_graph_replay(lambda: server.score_step(cache, cands, t))
            rows.append(("5. score_step, graph captured by hand", median_ms(replay, device)))
    print(f"HSTURanking E={args.dim}, {args.heads} heads, {args.layers} layers, {args.dtype}, "
          f"{b} users x {t} candidates against {n}-event caches, {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", torch {torch.__version__}")
    for name, ms in rows:
        print(f"  {name:<40} {ms:8.3f} ms")
    ms = dict(rows)
    session_ms = ms["3. session.score"]
    print(f"  full forward / session.score: {ms['1. full forward (eager)'] / session_ms:.1f}x")
    if device.type == "cuda":
        hand = ms["5. score_step, graph captured by hand"]
        print(f"  hand-captured graph / session.score: {hand / session_ms:.2f}x")
    stats = session.graph_stats()
    print(f"  session graphs: {stats}")
    print(f"  max |session - server.score| (probabilities): {(got - want).abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
