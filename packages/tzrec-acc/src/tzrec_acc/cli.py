"""``python -m tzrec_acc``: turn a saved tzrec-gr model into a served package, and run one.

::

    python -m tzrec_acc export --model run/best.pt --format aoti --output ranking.pt2
    python -m tzrec_acc run ranking.pt2

``export`` reads :mod:`tzrec_acc.settings` for what the options leave open (the format
from ``ENABLE_TRT`` / ``ENABLE_AOT``, embedding quantization from ``QUANT_EMB``, TF32 from
``TF32_MATMUL`` / ``TF32_CUDNN``), rebuilds the model (a tzrec-bench checkpoint, or
``--config`` + a state dict), optionally quantizes it or casts it to half precision,
exports it with dynamic dims, builds the package (``aoti``: an AOTInductor package;
``fx``: the exported FX program saved with ``torch.export.save``; ``trt``: a
TensorRT-compiled program), loads that package in a fresh process and prints the
per-output parity with eager on the sample batch and on a batch of one more user. Next to
``OUTPUT`` it writes ``OUTPUT.sample.pt``: the sample batches, the eager outputs, the
package kind and the modules its loader imports; ``run`` reads it.

Exit status: 0 on success, 1 when the package's outputs do not match eager, 2 for bad
options, files, models, settings or a missing extra (the message says which).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["main"]

FORMATS = ("aoti", "fx", "trt")
FORMS = ("full", "serving")
QUANTIZE = ("none", "emb-int8", "emb-int4", "emb-fp16", "dense-int8")
PRECISIONS = ("fp32", "bf16", "fp16")
DYNAMIC = ("users", "tokens")


class UsageError(Exception):
    """A bad option, file or model: exit status 2 with the message."""


def _dynamic(text: str) -> Tuple[str, ...]:
    if text == "none":
        return ()
    dims = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in dims if d not in DYNAMIC]
    if bad or not dims:
        raise argparse.ArgumentTypeError(
            f"--dynamic takes 'none' or a comma list of {', '.join(DYNAMIC)}, got {text!r}"
        )
    return dims


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tzrec_acc", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="export a saved tzrec-gr model as a package")
    ex.add_argument("--model", required=True, help="tzrec-bench checkpoint, or a state dict")
    ex.add_argument("--config", help="JSON/TOML model config, for a plain state dict")
    ex.add_argument(
        "--format",
        choices=FORMATS,
        help="default: trt with ENABLE_TRT=1, aoti with ENABLE_AOT=1, else fx",
    )
    ex.add_argument("--output", required=True, help="the package path (.pt2)")
    ex.add_argument(
        "--form",
        choices=FORMS,
        default="full",
        help="full forward, or the cached serving step (score / extend against a cache)",
    )
    ex.add_argument(
        "--dynamic",
        type=_dynamic,
        default=DYNAMIC,
        help="dynamic dims: 'users,tokens' (default), 'users', 'tokens' or 'none'",
    )
    ex.add_argument("--max-batch", type=int, default=256, help="users per call, at most")
    ex.add_argument(
        "--quantize",
        choices=QUANTIZE,
        help="default: from QUANT_EMB (FP32: none, INT8: emb-int8, ...)",
    )
    ex.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ex.add_argument("--backend", help="ops backend to build the model with (e.g. pytorch)")
    ex.add_argument("--device", default="cpu")
    ex.add_argument("--batch", type=int, default=4, help="users in the sample batch")
    ex.add_argument("--history", type=int, help="history events per user (default: bound)")
    ex.add_argument("--new", type=int, default=4, help="candidates / new events per user")
    ex.add_argument("--workspace-size", type=int, default=1 << 30, help="TensorRT bytes")
    ex.add_argument("--min-block-size", type=int, default=5, help="TensorRT block size")
    run = sub.add_parser("run", help="score the sample batch with an exported package")
    run.add_argument("package", help="a package written by export")
    return parser


def _quantize(model: torch.nn.Module, quantize: str, precision: str) -> torch.nn.Module:
    if quantize != "none" and precision != "fp32":
        raise UsageError("--quantize and --precision cannot be combined; choose one")
    if quantize == "dense-int8":
        raise UsageError(
            "--quantize dense-int8 uses torch's dynamic int8 quantization, which runs in "
            "eager mode on the CPU and does not export; use tzrec_acc.quant.quantize_dense "
            "in the serving process, or emb-int8 / emb-int4 / emb-fp16 here"
        )
    if quantize == "none":
        return model
    from tzrec_acc.quant import quantize_embeddings

    return quantize_embeddings(model, quantize.split("-")[1])


def _restrict(shapes: Any, dims: Sequence[str]) -> Any:
    """``shapes`` with the dims not named in ``dims`` made static."""
    from torch.export import Dim

    keep = set(dims)

    def fix(spec: Any) -> Any:
        if isinstance(spec, Dim):
            kind = "users" if spec.__name__.startswith("users") else "tokens"
            return spec if kind in keep else Dim.STATIC
        if isinstance(spec, dict):
            return {k: fix(v) for k, v in spec.items()}
        if isinstance(spec, (list, tuple)):
            return type(spec)(fix(v) for v in spec)
        return spec

    return fix(shapes)


def _module_and_batches(
    model: torch.nn.Module, args: argparse.Namespace
) -> Tuple[torch.nn.Module, List[Tuple[Any, ...]], Any]:
    """(the module to export, [sample batch, batch of one more user], dynamic shapes)."""
    from tzrec_acc import gr

    if args.form == "serving":
        history = args.history or 8
        step, call, shapes = gr.serving_step(
            model, history, args.new, args.batch, max_batch=args.max_batch
        )
        _, other, _ = gr.serving_step(model, history, args.new, args.batch + 1, 1, args.max_batch)
        module, batches = step, [call, other]
    else:
        new = args.new if gr.model_kind(model) == "ranking" else None
        batches = [
            gr.sample_inputs(model, args.batch + extra, args.history, new, seed=extra)
            for extra in (0, 1)
        ]
        module, shapes = model, gr.dynamic_shapes(model, batches[0], args.max_batch)
    if args.precision != "fp32":
        from tzrec_acc.precision import HalfPrecision

        # the wrapper takes *args: its one parameter holds the whole argument tuple
        module, shapes = HalfPrecision(module, args.precision).eval(), (tuple(shapes),)
        # the package takes its inputs in the compute dtype (a serving cache above all: a
        # float32 one would be converted in every call)
        batches = [module.cast(batch) for batch in batches]
    return module, batches, shapes


def _export(args: argparse.Namespace) -> int:
    from tzrec_acc import aot, settings
    from tzrec_acc.checkpoint import load_model

    try:
        toggles = settings.read()
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.format is None:
        args.format = "trt" if toggles.enable_trt else "aoti" if toggles.enable_aot else "fx"
    if args.quantize is None:
        args.quantize = "none" if toggles.quant_emb == "fp32" else f"emb-{toggles.quant_emb}"
    settings.apply_tf32(toggles.tf32_matmul, toggles.tf32_cudnn)

    if args.max_batch < 1 or args.batch < 1 or args.new < 1:
        raise UsageError("--max-batch, --batch and --new must be >= 1")
    if args.batch + 1 > args.max_batch:
        raise UsageError(f"--batch ({args.batch}) must be < --max-batch ({args.max_batch})")
    if not str(args.output).endswith(".pt2"):
        raise UsageError(f"--output must end with .pt2, got {args.output!r}")
    try:
        model = load_model(args.model, args.config, args.backend)
        from tzrec_acc.gr import model_kind

        model_kind(model)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    model = _quantize(model.to(args.device), args.quantize, args.precision)
    module, batches, shapes = _module_and_batches(model, args)
    batches = [_to(b, args.device) for b in batches]
    shapes = _restrict(shapes, args.dynamic)
    if set(args.dynamic) != set(DYNAMIC):
        # with a static dim the program takes only the example's size along it; a jagged
        # batch of another number of users has other token counts too
        batches = batches[:1]
    with torch.no_grad():
        expected = [aot.flat_outputs(module(*b)) for b in batches]
    program = aot.export(module, batches[0], shapes)
    imports: List[str] = []
    if args.format == "aoti":
        aot.compile_package(program, args.output)
        kind = "aoti"
    elif args.format == "fx":
        aot.save_program(program, args.output)
        kind = "program"
        imports = _op_libraries(program)
    else:
        from tzrec_acc import tensorrt

        small, large = batches[0], batches[-1]
        compiled = tensorrt.compile(
            program,
            small,
            small,
            large,
            workspace_size=args.workspace_size,
            min_block_size=args.min_block_size,
        )
        tensorrt.save(compiled, args.output, batches[0])
        kind = "program"
        imports = ["torch_tensorrt", *_op_libraries(program)]
    sample = {"kind": kind, "imports": imports, "batches": batches, "expected": expected}
    torch.save(sample, _sample_path(args.output))
    got = aot.run_in_fresh_process(args.output, batches, kind, imports)
    ok = True
    for i, (want, have) in enumerate(zip(expected, got)):
        report = aot.parity(want, have)
        print(f"batch {i} ({_describe(batches[i])}), package vs eager:")
        print("  " + str(report).replace("\n", "\n  "))
        ok = ok and report.ok
    print(f"wrote {args.output} ({args.format}) and {_sample_path(args.output)}")
    return 0 if ok else 1


def _op_libraries(program: torch.export.ExportedProgram) -> List[str]:
    """The modules a loader imports for the graph's custom ops: tzrec_ops' triton library,
    and fbgemm_gpu (the pytorch backend's jagged ops where fbgemm is installed)."""
    names = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    libraries = {"tzrec_ops.": "tzrec_ops.backends.triton.library", "fbgemm.": "fbgemm_gpu"}
    return [module for prefix, module in libraries.items() if any(prefix in n for n in names)]


def _to(value: Any, device: str) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _describe(args: Tuple[Any, ...]) -> str:
    from torch.utils import _pytree as pytree

    leaves = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    return f"{len(leaves)} input tensors, {sum(t.numel() for t in leaves)} elements"


def _sample_path(package: str) -> str:
    return str(package) + ".sample.pt"


def _run(args: argparse.Namespace) -> int:
    from tzrec_acc import aot

    package = pathlib.Path(args.package)
    sample_path = pathlib.Path(_sample_path(args.package))
    for path in (package, sample_path):
        if not path.is_file():
            raise UsageError(f"no file at {path} (write both with python -m tzrec_acc export)")
    sample: Dict[str, Any] = torch.load(sample_path, weights_only=False)
    batch = sample["batches"][0]
    (out,) = aot.run_in_fresh_process(str(package), [batch], sample["kind"], sample["imports"])
    for i, tensor in enumerate(out):
        print(f"output {i}: shape {list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}")
        print(f"  first rows: {tensor[:3].tolist()}")
    report = aot.parity(sample["expected"][0], out)
    print("package vs the eager outputs stored at export:")
    print("  " + str(report).replace("\n", "\n  "))
    return 0 if report.ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _export(args) if args.command == "export" else _run(args)
    except (UsageError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
