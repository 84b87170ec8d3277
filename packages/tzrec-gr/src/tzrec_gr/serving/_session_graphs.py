"""The CUDA graphs of a :class:`~tzrec_gr.serving.ServingSession`, as a whole: building them
from the session's options, capturing the buckets of ``warm_up``'s sizes, and their stats.

A session has up to two graph sets sharing one memory pool: the step of its model's call
(``score`` or ``recommend``, built by the server: :meth:`ModelServer.cuda_graphs
<tzrec_gr.serving.server.ModelServer.cuda_graphs>`) and the whole-history encode
(:class:`~tzrec_gr.serving._encode_graphs.EncodeGraphs`, the same for both models).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from tzrec_gr.serving._encode_graphs import EncodeGraphs
from tzrec_gr.serving._graphs import GraphPool, GraphSet, check_buckets, powers_of_two_up_to
from tzrec_gr.serving.server import ModelServer

__all__ = ["build_graphs", "graph_stats", "warm_up_graphs"]


def build_graphs(
    server: ModelServer,
    device: torch.device,
    pool: GraphPool,
    *,
    cuda_graphs: str,
    batch_buckets: Sequence[int],
    length_buckets: Optional[Sequence[int]],
    candidate_buckets: Optional[Sequence[int]],
    event_buckets: Optional[Sequence[int]],
    encode_graphs: bool,
    max_graphs: int,
    chunk_size: int,
    catalogue: Callable[[], torch.Tensor],
) -> Tuple[Optional[GraphSet], Optional[EncodeGraphs], str]:
    """(the call's graphs, the encode's graphs, why the call has none) for the session's
    options (see :class:`~tzrec_gr.serving.ServingSession`).

    Raises:
        ValueError: a bad option (named).
    """
    for name, values in (
        ("batch_buckets", batch_buckets),
        ("length_buckets", length_buckets),
        ("candidate_buckets", candidate_buckets),
        ("event_buckets", event_buckets),
    ):
        check_buckets(name, values)
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 0:
        raise ValueError(f"max_graphs must be an int >= 0, got {max_graphs!r}")
    if not isinstance(encode_graphs, bool):
        raise ValueError(f"encode_graphs must be True or False, got {encode_graphs!r}")
    cuda = device.type == "cuda"
    if cuda_graphs == "on" and not cuda:
        raise ValueError(f"cuda_graphs='on' needs a CUDA device, got {device}")
    no_graphs = f"cuda_graphs={cuda_graphs!r} on device {device}"
    if not cuda or cuda_graphs == "off":
        return None, None, no_graphs
    step, why_not = server.cuda_graphs(
        device=device,
        pool=pool,
        batch_buckets=batch_buckets,
        length_buckets=length_buckets,
        candidate_buckets=candidate_buckets,
        max_graphs=max_graphs,
        chunk_size=chunk_size,
        catalogue=catalogue,
        strict=cuda_graphs == "on",
    )
    encoder = None
    if encode_graphs:
        most = max(batch_buckets) * server.max_events
        events = event_buckets or powers_of_two_up_to(most, 64)
        encoder = EncodeGraphs(server, device, pool, batch_buckets, events, max_graphs)
    return step, encoder, no_graphs if step is None else ""


def warm_up_graphs(
    step: Optional[GraphSet],
    encoder: Optional[EncodeGraphs],
    no_graphs: str,
    sizes: Dict[str, Any],
    exclude_seen: bool,
    encode_sizes: Dict[str, Any],
) -> Dict[str, Any]:
    """Capture the buckets of ``sizes`` (``warm_up``'s) and of ``encode_sizes``
    (``batch_sizes``, ``histories``): the call's report, with the encode's as
    ``encode_graphs``."""
    if step is None:
        report = {**GraphSet.no_report(), "reason": f"no CUDA graphs here ({no_graphs})"}
    else:
        report = step.warm_up(step.warm_up_buckets(sizes, exclude_seen), False)
        report["reason"] = None
    report["encode_graphs"] = (
        GraphSet.no_report()
        if encoder is None
        else encoder.warm_up(encoder.warm_up_buckets(encode_sizes, exclude_seen), False)
    )
    return report


def graph_stats(
    step: Optional[GraphSet], encoder: Optional[EncodeGraphs], warm_up: Optional[Dict[str, Any]]
) -> Dict[str, Any]:
    """``ServingSession.graph_stats()``."""
    stats = GraphSet.no_stats() if step is None else step.stats()
    encode = GraphSet.no_stats() if encoder is None else encoder.stats()
    return {
        "enabled": step is not None,
        **stats,
        "encode": {"enabled": encoder is not None, **encode},
        "warm_up": warm_up,
    }
