"""Time a call the way every tzrec benchmark does, and replay it from a CUDA graph.

:func:`median_ms` is the one timer of the project's benchmarks (tzrec-bench's ``ops``
command, its kernel and model benchmarks, the export benchmark): the median, in
milliseconds, of

- on CUDA with triton installed, ``triton.testing.do_bench`` (warm-up 25 ms, then calls for
  ``rep_ms`` milliseconds, 200 by default: architecture §6);
- otherwise (the CPU, or CUDA without triton), one untimed call, then calls timed one by one
  (CUDA events on a GPU, the wall clock on the CPU) until at least ``min_calls`` calls and
  ``rep_ms`` milliseconds.

:func:`cuda_graph_replay` captures a call in a CUDA graph and returns the graph's replay,
what a server with fixed request shapes runs (no Python or launch cost); time the replay with
:func:`median_ms`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List, Union

import torch

__all__ = ["MIN_CALLS", "REP_MS", "WARMUP_MS", "cuda_graph_replay", "median_ms"]

#: ``triton.testing.do_bench``'s warm-up, in milliseconds (architecture §6)
WARMUP_MS = 25
#: how long a figure is timed by default, in milliseconds (architecture §6: at least 200)
REP_MS = 200.0
#: the fewest calls timed one by one
MIN_CALLS = 3


def median_ms(
    fn: Callable[[], Any],
    device: Union[torch.device, str],
    rep_ms: float = REP_MS,
    min_calls: int = MIN_CALLS,
) -> float:
    """Median milliseconds of ``fn()`` on ``device`` (see the module docstring).

    Args:
        fn: the call to time, without arguments. Its work must be on ``device``.
        device: where ``fn`` runs (``"cpu"``, ``"cuda"``, a ``torch.device``).
        rep_ms: milliseconds to spend on the timed calls. Default: 200.
        min_calls: the fewest calls when they are timed one by one. Default: 3.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        try:
            from triton.testing import do_bench
        except ImportError:
            pass
        else:
            return float(do_bench(fn, warmup=WARMUP_MS, rep=int(rep_ms), return_mode="median"))
    fn()  # untimed: autotuning, caches, lazy initialisation
    if cuda:
        torch.cuda.synchronize(device)
    times: List[float] = []
    started = time.perf_counter()
    while len(times) < min_calls or (time.perf_counter() - started) * 1e3 < rep_ms:
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            begin_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin_s) * 1e3)
    return statistics.median(times)


def cuda_graph_replay(
    fn: Callable[[], Any], capture_error_mode: str = "global", warmup_calls: int = 3
) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph; returns the graph's ``replay``.

    ``fn`` is first called ``warmup_calls`` times on a side stream (autotuning and lazy
    allocations happen outside the capture) and the device synchronized, then captured once.
    Replays rerun the captured kernels on the same buffers.

    Args:
        fn: the call to capture, without arguments, on the current CUDA device.
        capture_error_mode: ``torch.cuda.graph``'s: ``"global"`` (the default: a call that
            is unsafe during capture, such as a device-to-host copy, fails it) or
            ``"relaxed"``. An AOTInductor package's runner queries the completion event of
            its previous run when a run starts (``cudaEventQuery``), which only ``"relaxed"``
            permits; the synchronized warm-up makes that event complete. Call only the
            replay afterwards: the runner's event was last recorded inside the capture.
        warmup_calls: calls before the capture. Default: 3.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        fn()
    return graph.replay
