"""The CUDA graphs of a :class:`~tzrec_gr.serving.ServingSession`, as a whole: building them
from the session's options, capturing the buckets of ``warm_up``'s sizes, and their stats.

A session has up to three graph sets sharing one memory pool: the step of its model's call
(``score`` or ``recommend``, built by the server: :meth:`ModelServer.cuda_graphs
<tzrec_gr.serving.server.ModelServer.cuda_graphs>`), the whole-history encode
(:class:`~tzrec_gr.serving._encode_graphs.EncodeGraphs`, the same for both models) and,
where the server extends incrementally, the incremental extend
(:class:`~tzrec_gr.serving._extend_graphs.ExtendGraphs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from tzrec_gr.serving._encode_graphs import EncodeGraphs
from tzrec_gr.serving._extend_graphs import ExtendGraphs
from tzrec_gr.serving._graphs import GraphPool, GraphSet, check_buckets, powers_of_two_up_to
from tzrec_gr.serving._score_graphs import windowed_layer
from tzrec_gr.serving.server import ModelServer

__all__ = ["Graphs", "build_graphs", "graph_stats", "warm_up_graphs"]

#: the most new events per user of the default extend buckets
_EXTEND_EVENTS = 16


@dataclasses.dataclass
class Graphs:
    """A session's graph sets (None: not captured) and why the call's step has none."""

    step: Optional[GraphSet] = None
    encode: Optional[EncodeGraphs] = None
    extend: Optional[ExtendGraphs] = None
    no_graphs: str = ""

    def sets(self) -> List[GraphSet]:
        """The sets there are."""
        return [g for g in (self.step, self.encode, self.extend) if g is not None]


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
    extend_buckets: Optional[Sequence[int]],
    encode_graphs: bool,
    max_graphs: int,
    chunk_size: int,
    catalogue: Callable[[], torch.Tensor],
) -> Graphs:
    """The graph sets of the session's options (see
    :class:`~tzrec_gr.serving.ServingSession`).

    Raises:
        ValueError: a bad option (named).
    """
    for name, values in (
        ("batch_buckets", batch_buckets),
        ("length_buckets", length_buckets),
        ("candidate_buckets", candidate_buckets),
        ("event_buckets", event_buckets),
        ("extend_buckets", extend_buckets),
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
        return Graphs(no_graphs=no_graphs)
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
    graphs = Graphs(step=step, no_graphs=no_graphs if step is None else "")
    if encode_graphs:
        most = max(batch_buckets) * server.max_events
        events = event_buckets or powers_of_two_up_to(most, 64)
        graphs.encode = EncodeGraphs(server, device, pool, batch_buckets, events, max_graphs)
    # a sliding window would count the padded cache's zero rows
    if (server.extends_incrementally and server.has_extend_step
            and windowed_layer(server.model) is None):
        cached = length_buckets or powers_of_two_up_to(
            server.warm_up_length(server.max_events), 64
        )
        new = extend_buckets or powers_of_two_up_to(min(_EXTEND_EVENTS, server.max_events))
        graphs.extend = ExtendGraphs(
            server, device, pool, batch_buckets, cached, new, max_graphs
        )
    return graphs


def warm_up_graphs(
    graphs: Graphs,
    sizes: Dict[str, Any],
    exclude_seen: bool,
    encode_sizes: Dict[str, Any],
) -> Dict[str, Any]:
    """Capture the buckets of ``sizes`` (``warm_up``'s) and of ``encode_sizes``
    (``batch_sizes``, ``histories``, ``events``): the call's report, with the encode's as
    ``encode_graphs`` and the incremental extend's as ``extend_graphs``."""
    step = graphs.step
    if step is None:
        report = {**GraphSet.no_report(), "reason": f"no CUDA graphs here ({graphs.no_graphs})"}
    else:
        report = step.warm_up(step.warm_up_buckets(sizes, exclude_seen), False)
        report["reason"] = None
    for key, found in (("encode_graphs", graphs.encode), ("extend_graphs", graphs.extend)):
        report[key] = (
            GraphSet.no_report()
            if found is None
            else found.warm_up(found.warm_up_buckets(encode_sizes, exclude_seen), False)
        )
    return report


def graph_stats(graphs: Graphs, warm_up: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``ServingSession.graph_stats()``."""
    stats = GraphSet.no_stats() if graphs.step is None else graphs.step.stats()
    out = {"enabled": graphs.step is not None, **stats}
    for key, found in (("encode", graphs.encode), ("extend", graphs.extend)):
        out[key] = {
            "enabled": found is not None,
            **(GraphSet.no_stats() if found is None else found.stats()),
        }
    out["warm_up"] = warm_up
    return out
