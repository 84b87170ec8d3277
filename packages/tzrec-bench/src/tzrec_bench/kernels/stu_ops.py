"""Benchmark of the non-attention STU ops and of the fused STU layer (forward + backward).

    python -m tzrec_bench.kernels.stu_ops [--batch 64] [--max-len 2048] [--providers ...]
                                          [--no-graph]

Shapes: B sequences with lengths uniform in [0.9 N, N), embedding E = 512, H = 4 heads,
A = V = 128, bf16. Every op runs forward + backward (one fixed upstream gradient) for three
providers: ``triton`` (the triton backend), ``eager`` (the pytorch backend) and ``compile``
(``torch.compile`` of the pytorch backend). The STU layer (layer norm -> uvqk GEMM -> SiLU ->
attention -> norm-mul -> output GEMM + residual) is timed fused (``hstu_preprocess_and_attention``
+ ``hstu_compute_output`` on triton) against the same layer from unfused triton ops and against
the eager pytorch backend. Value checks (one host sync per call) are turned off while timing.

Each cell has two times, medians of ``triton.testing.do_bench`` in milliseconds. ``wall`` times
eager calls, so it includes the Python and autograd launch overhead: it is what an eager user
sees, and at these shapes the host, not the GPU, often sets it. ``gpu`` captures one forward +
backward step in a CUDA graph and times its replays, so it is kernel time only. Each speed-up
column is the time of the faster of ``eager`` and ``compile`` over the ``triton`` time, by wall
and by gpu time. ``--no-graph`` skips the gpu times. A step that fails, or cannot be captured
(one that syncs with the host, say), gets ``nan`` and one line naming the error.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Dict, List, Sequence, Tuple

import torch

PROVIDERS = ("triton", "eager", "compile", "triton_compile")
DEFAULT_PROVIDERS = "triton,eager,compile"
Case = Tuple[Callable[..., torch.Tensor], List[torch.Tensor]]
Timer = Callable[[Callable[..., torch.Tensor], Sequence[torch.Tensor]], float]


class Shapes:
    """The STU batch: jagged lengths, offsets and the sizes shared by every op."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        embed: int = 512,
        heads: int = 4,
        head_dim: int = 128,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        lo = int(0.9 * max_len)
        self.lengths = torch.randint(lo, max_len, (batch,), generator=g)
        self.targets = torch.randint(1, 21, (batch,), generator=g)
        self.batch, self.max_len, self.embed = batch, max_len, embed
        self.heads, self.head_dim = heads, head_dim
        self.tokens = int(self.lengths.sum())
        self.offsets = torch.zeros(batch + 1, dtype=torch.int64)
        self.offsets[1:] = torch.cumsum(self.lengths, 0)
        self.timestamps = torch.cumsum(torch.randint(0, 86400, (self.tokens,), generator=g), 0)


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16).requires_grad_()


def _backend(provider: str) -> str:
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {PROVIDERS}")
    return "triton" if provider.startswith("triton") else "pytorch"


def op_cases(s: Shapes) -> Dict[str, Callable[[str], Case]]:
    """op name -> setup(provider) returning (forward fn of the inputs, inputs needing grad)."""
    import tzrec_ops.ops.hstu_compute as hc
    import tzrec_ops.ops.jagged as jg
    import tzrec_ops.ops.layer_norm as ln
    import tzrec_ops.ops.mm as mm
    import tzrec_ops.ops.position as pos

    L, E, H, D = s.tokens, s.embed, s.heads, s.head_dim
    W = 2 * H * (D + D)
    off = s.offsets.cuda()
    lengths = s.lengths.cuda()
    targets = s.targets.cuda()
    ts = s.timestamps.cuda()

    cases: Dict[str, Callable[[str], Case]] = {}

    def addmm_uvqk(p: str) -> Case:
        ins = [_rand(W), _rand(L, E), _rand(E, W, scale=E**-0.5)]
        return (lambda b, x, w: mm.addmm(b, x, w, backend=_backend(p))), ins

    def addmm_residual(p: str) -> Case:
        ins = [_rand(L, E), _rand(L, H * D), _rand(H * D, E, scale=E**-0.5)]
        return (lambda x, y, w: mm.addmm(x, y, w, backend=_backend(p))), ins

    def layer_norm(p: str) -> Case:
        return (lambda x, w, b: ln.layer_norm(x, w, b, backend=_backend(p))), [
            _rand(L, E),
            _rand(E),
            _rand(E),
        ]

    def rms_norm(p: str) -> Case:
        return (lambda x, w: ln.rms_norm(x, w, backend=_backend(p))), [_rand(L, E), _rand(E)]

    def swish_layer_norm(p: str) -> Case:
        return (lambda x, w, b: ln.swish_layer_norm(x, w, b, backend=_backend(p))), [
            _rand(L, E),
            _rand(E),
            _rand(E),
        ]

    def layer_norm_mul_dropout(p: str) -> Case:
        return (
            lambda x, u, w, b: ln.layer_norm_mul_dropout(
                x, u, w, b, 1e-5, 0.1, True, False, 7, backend=_backend(p)
            )
        ), [_rand(L, H * D), _rand(L, H * D), _rand(H * D), _rand(H * D)]

    def group_norm_mul_dropout(p: str) -> Case:
        return (
            lambda x, u, w, b: ln.group_norm_mul_dropout(
                x, u, w, b, 1e-5, 0.1, True, H, False, 7, backend=_backend(p)
            )
        ), [_rand(L, H * D), _rand(L, H * D), _rand(H), _rand(H)]

    n_right = 16

    def concat_2D_jagged(p: str) -> Case:
        return (
            lambda a, b: jg.concat_2D_jagged(
                a, b, s.max_len, n_right, off, None, backend=_backend(p)
            )
        ), [_rand(L, E), _rand(s.batch * n_right, E)]

    def split_2D_jagged(p: str) -> Case:
        def fn(v: torch.Tensor) -> torch.Tensor:
            left, right = jg.split_2D_jagged(
                s.max_len + n_right,
                v,
                total_len_left=L,
                max_len_right=n_right,
                offsets_left=off,
                backend=_backend(p),
            )
            return torch.cat([left, right])  # one output for the timing harness

        return fn, [_rand(L + s.batch * n_right, E)]

    def jagged_dense_bmm_broadcast_add(p: str) -> Case:
        return (
            lambda j, d, b: jg.jagged_dense_bmm_broadcast_add(
                s.max_len, off, j, d, b, backend=_backend(p)
            )
        ), [_rand(L, E), _rand(s.batch, E, E, scale=E**-0.5), _rand(s.batch, E)]

    def add_positional_embeddings(p: str) -> Case:
        return (
            lambda t, x: pos.add_positional_embeddings(
                0.5, s.max_len, t, off, lengths, x, targets, False, backend=_backend(p)
            )
        ), [_rand(s.max_len, E), _rand(L, E)]

    def add_timestamp_positional_embeddings(p: str) -> Case:
        return (
            lambda pt, tt, x: pos.add_timestamp_positional_embeddings(
                0.5,
                s.max_len,
                0,
                pt,
                tt,
                off,
                lengths,
                x,
                ts,
                targets,
                False,
                "sqrt",
                60.0,
                backend=_backend(p),
            )
        ), [_rand(s.max_len + 1, E), _rand(1001, E), _rand(L, E)]

    def hstu_compute_output(p: str) -> Case:
        return (
            lambda a, u, x, nw, nb, w: hc.hstu_compute_output(
                a, u, x, nw, nb, 1e-5, w, H, D, 0.1, True, False, False, False, backend=_backend(p)
            )
        ), [
            _rand(L, H * D),
            _rand(L, H * D),
            _rand(L, E),
            _rand(H * D),
            _rand(H * D),
            _rand(H * D, E, scale=E**-0.5),
        ]

    for fn in (
        addmm_uvqk,
        addmm_residual,
        layer_norm,
        rms_norm,
        swish_layer_norm,
        layer_norm_mul_dropout,
        group_norm_mul_dropout,
        concat_2D_jagged,
        split_2D_jagged,
        jagged_dense_bmm_broadcast_add,
        add_positional_embeddings,
        add_timestamp_positional_embeddings,
        hstu_compute_output,
    ):
        cases[fn.__name__] = fn
    return cases


def stu_layer_cases(s: Shapes) -> Dict[str, Case]:
    """The STU layer, fused (triton), from unfused triton ops, and on the eager pytorch backend."""
    import tzrec_ops.ops.hstu_attention as ha
    import tzrec_ops.ops.hstu_compute as hc
    import tzrec_ops.ops.layer_norm as ln
    import tzrec_ops.ops.mm as mm

    L, E, H, D = s.tokens, s.embed, s.heads, s.head_dim
    W = 2 * H * (D + D)
    off = s.offsets.cuda()
    targets = s.targets.cuda()
    alpha = D**-0.5
    params = [
        _rand(L, E),
        _rand(E),
        _rand(E),
        _rand(E, W, scale=E**-0.5),
        _rand(W),
        _rand(H * D),
        _rand(H * D),
        _rand(H * D, E, scale=(H * D) ** -0.5),
    ]

    def fused(x, nw, nb, w, b, onw, onb, ow):  # type: ignore[no-untyped-def]
        u, attn, _, _ = hc.hstu_preprocess_and_attention(
            x,
            nw,
            nb,
            1e-5,
            H,
            D,
            D,
            w,
            b,
            s.max_len,
            off,
            alpha,
            True,
            targets,
            0,
            0,
            False,
            False,
            False,
            backend="triton",
        )
        return hc.hstu_compute_output(
            attn, u, x, onw, onb, 1e-5, ow, H, D, 0.0, True, False, False, False, backend="triton"
        )

    def unfused(backend):  # type: ignore[no-untyped-def]
        def layer(x, nw, nb, w, b, onw, onb, ow):  # type: ignore[no-untyped-def]
            u, q, k, v = hc.hstu_compute_uqvk(x, nw, nb, 1e-5, H, D, D, w, b, backend=backend)
            attn = ha.hstu_mha(
                s.max_len, alpha, q, k, v, off, num_targets=targets, backend=backend
            ).reshape(L, H * D)
            y = ln.layer_norm_mul_dropout(attn, u, onw, onb, 1e-5, 0.0, True, backend=backend)
            return mm.addmm(x, y, ow, backend=backend)

        return layer

    return {
        "STU layer fused (triton)": (fused, params),
        "STU layer unfused triton ops": (unfused("triton"), params),
        "STU layer eager pytorch": (unfused("pytorch"), params),
    }


def _step(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """One forward + backward of ``fn(*inputs)`` with a fixed upstream gradient."""
    grad = torch.randn_like(fn(*inputs).detach())

    def step() -> None:
        fn(*inputs).backward(grad)

    return step


def time_fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> float:
    """Median ms of forward + backward called eagerly (host launch overhead included)."""
    import triton.testing

    return triton.testing.do_bench(
        _step(fn, inputs), warmup=25, rep=200, grad_to_none=list(inputs), return_mode="median"
    )


def time_fwd_bwd_graph(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> float:
    """Median ms of forward + backward replayed from a CUDA graph (GPU time only)."""
    import triton.testing

    step = _step(fn, inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in inputs:
        x.grad = None  # so AccumulateGrad assigns gradients allocated inside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):  # restores the caller's stream even if the capture fails
        with torch.cuda.graph(graph, stream=side):
            step()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def _one_line(exc: BaseException) -> str:
    """``Type: message`` with the message's whitespace collapsed, cut at 200 characters."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _describe(exc: BaseException) -> str:
    """The exception, and the one it was raised while handling (a failed capture's cause)."""
    if exc.__context__ is None:
        return _one_line(exc)
    return f"{_one_line(exc)} (while handling {_one_line(exc.__context__)})"


def _time(
    label: str, timer: Timer, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]
) -> float:
    """``timer(fn, inputs)``, or nan after printing one line naming ``label`` and the error."""
    try:
        return timer(fn, inputs)
    except Exception as exc:  # report and keep going: one failure must not hide the rest
        print(f"  {label} failed: {_describe(exc)}", flush=True)
        return math.nan


def _speedup(times: Dict[str, float]) -> float:
    """The faster of the eager/compile times over the triton time (nan if either is missing)."""
    refs = [times[p] for p in ("eager", "compile") if not math.isnan(times.get(p, math.nan))]
    return min(refs, default=math.nan) / times.get("triton", math.nan)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument(
        "--providers",
        default=DEFAULT_PROVIDERS,
        help=f"comma-separated subset of {PROVIDERS}; triton_compile is torch.compile of the "
        "triton backend (separates host launch overhead from kernel time)",
    )
    parser.add_argument("--ops", default="", help="comma-separated subset of op names")
    parser.add_argument(
        "--no-graph", action="store_true", help="skip the gpu times (CUDA graph replays)"
    )
    args = parser.parse_args(list(argv) or None)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    import triton

    from tzrec_ops.ops.validation import set_value_checks

    set_value_checks(False)
    s = Shapes(args.batch, args.max_len)
    timers: Dict[str, Timer] = {"wall": time_fwd_bwd}
    if not args.no_graph:
        timers["gpu"] = time_fwd_bwd_graph
    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
        f"{triton.__version__}"
    )
    print(
        f"tokens {s.tokens} = {s.batch} sequences x U[{int(0.9 * s.max_len)}, {s.max_len}), "
        f"E={s.embed}, H={s.heads}, A=V={s.head_dim}, bf16, forward+backward, median ms "
        f"(triton.testing.do_bench); wall = eager calls, gpu = CUDA graph replay; value "
        f"checks disabled while timing"
    )
    providers = [p for p in args.providers.split(",") if p]
    for p in providers:
        _backend(p)
    width = 9 * len(timers)
    print(f"{'':40s}" + "".join(f"{p:>{width}s}" for p in [*providers, "speed-up"]))
    print(f"{'op':40s}" + "".join(f"{m:>9s}" for m in timers) * (len(providers) + 1))
    wanted = set(filter(None, args.ops.split(",")))
    for name, setup in op_cases(s).items():
        if wanted and name not in wanted:
            continue
        times: Dict[Tuple[str, str], float] = {}
        for p in providers:
            fn, inputs = setup(p)
            if p.endswith("compile"):
                fn = torch.compile(fn)
            for m, timer in timers.items():
                times[p, m] = _time(f"{name} [{p}] {m}", timer, fn, inputs)
            del inputs
        row = "".join(f"{times[p, m]:9.3f}" for p in providers for m in timers)
        speedups = "".join(f"{_speedup({p: times[p, m] for p in providers}):8.2f}x" for m in timers)
        print(f"{name:40s}{row}{speedups}", flush=True)
    print("\nSTU layer (preprocess + attention + output), forward+backward, median ms")
    print(f"{'layer':40s}" + "".join(f"{m:>9s}" for m in timers))
    layers: Dict[str, Dict[str, float]] = {}
    for name, (fn, inputs) in stu_layer_cases(s).items():
        layers[name] = {m: _time(f"{name} {m}", t, fn, inputs) for m, t in timers.items()}
        print(f"{name:40s}" + "".join(f"{layers[name][m]:9.3f}" for m in timers), flush=True)
    fused = layers["STU layer fused (triton)"]
    for other in ("unfused triton ops", "eager pytorch"):
        ratios = ", ".join(f"{layers[f'STU layer {other}'][m] / fused[m]:.2f}x {m}" for m in timers)
        print(f"fused vs {other}: {ratios}")


if __name__ == "__main__":
    main()
