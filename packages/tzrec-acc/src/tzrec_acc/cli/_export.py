"""``export``: check the options, build the package, write its sample file, check parity."""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
from typing import Any, Dict, List, Tuple

import torch

from tzrec_acc.cli._batches import _module_and_batches, _restrict, _to
from tzrec_acc.cli._options import DYNAMIC, UsageError, _model_file
from tzrec_acc.cli._quality import _against_float, _float_outputs, _lossy


def _check_export_options(args: argparse.Namespace) -> None:
    """Every option, the files named and the extras needed, before the model is loaded."""
    _check_output(args.output)
    if args.max_batch < 1 or args.batch < 1 or args.new < 1:
        raise UsageError("--max-batch, --batch and --new must be >= 1")
    if args.batch + 1 > args.max_batch:
        raise UsageError(f"--batch ({args.batch}) must be < --max-batch ({args.max_batch})")
    if args.history is not None and args.history < 1:
        raise UsageError(f"--history must be >= 1, got {args.history}")
    if args.quantize is not None and args.quantize != "none" and args.precision != "fp32":
        raise UsageError("--quantize and --precision cannot be combined; choose one")
    model = _model_file(args.model, args.config)
    if not model.is_file():
        where = f"{args.model} (a folder without best.pt or checkpoint.pt)" if (
            model != pathlib.Path(args.model)
        ) else args.model
        raise UsageError(f"--model: no checkpoint or state dict at {where}")
    if args.config is not None and not pathlib.Path(args.config).is_file():
        raise UsageError(f"--config: no model config at {args.config}")


def _check_output(output: str) -> None:
    """``--output``: a .pt2 file name in a folder that exists and is writable."""
    if not str(output).endswith(".pt2"):
        raise UsageError(f"--output must end with .pt2, got {output!r}")
    path = pathlib.Path(output)
    if path.is_dir():
        raise UsageError(f"--output {output} is a folder; give a file name ending with .pt2")
    if not path.parent.is_dir():
        raise UsageError(f"--output {output}: its folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UsageError(f"--output {output}: its folder {path.parent} is not writable")


def _export(args: argparse.Namespace) -> int:
    from tzrec_acc import aot, settings
    from tzrec_acc.checkpoint import load_checkpoint
    from tzrec_acc.serving import items_path, sample_path

    _check_export_options(args)  # before the settings are applied and the model loaded
    try:
        toggles = settings.read()
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.format is None:
        args.format = "trt" if toggles.enable_trt else "aoti" if toggles.enable_aot else "fx"
    if args.quantize is None:
        args.quantize = "none" if toggles.quant_emb == "fp32" else f"emb-{toggles.quant_emb}"
    if args.quantize == "dense-int8" or (args.quantize != "none" and args.precision != "fp32"):
        _quantize(torch.nn.Identity(), args.quantize, args.precision)  # raises the UsageError
    if args.format == "trt":  # the ImportError naming tzrec-acc[tensorrt], before any work
        from tzrec_ops.extras import require

        require("torch_tensorrt", "tzrec-acc[tensorrt]", "TensorRT compilation")
    settings.apply_tf32(toggles.tf32_matmul, toggles.tf32_cudnn)
    try:
        model, vocabularies = load_checkpoint(args.model, args.config, args.backend)
        from tzrec_acc.gr import model_kind

        kind_of_model = model_kind(model)  # a label, for the sample file
    except (FileNotFoundError, ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    served = _served(model, kind_of_model, args)
    model = model.to(args.device)
    lossy = _lossy(args)
    # quantize_embeddings changes the model in place (HalfPrecision copies it): the float
    # model the quantization is measured against is a copy taken first
    float_model = copy.deepcopy(model) if args.quantize != "none" else model
    model = _quantize(model, args.quantize, args.precision)
    module, batches, shapes = _module_and_batches(model, args)
    batches = [_to(b, args.device) for b in batches]
    shapes = _restrict(shapes, args.dynamic)
    if set(args.dynamic) != set(DYNAMIC):
        # with a static dim the program takes only the example's size along it; a jagged
        # batch of another number of users has other token counts too
        batches = batches[:1]
    with torch.no_grad():
        expected = [aot.flat_outputs(module(*b)) for b in batches]
    reference = _float_outputs(float_model, args, batches) if lossy else None
    del float_model
    # the catalogue a retrieval package's top-K ranks against, from the exported model (a
    # model that scores candidates has none)
    exported = _exported_server(module)
    items = exported.item_table()
    if items is not None:
        served["items"] = pathlib.Path(items_path(args.output)).name  # beside the package
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
    sample = {
        "kind": kind,
        "imports": imports,
        "batches": batches,
        "expected": expected,
        "served": served,
    }
    if vocabularies is not None:  # the raw ids predict reads and writes (tzrec_gr.vocabulary)
        sample[_vocabulary_key()] = vocabularies.state()
    torch.save(sample, sample_path(args.output))
    written = [sample_path(args.output)]
    if items is not None:
        torch.save(items.detach().cpu(), items_path(args.output))
        written.append(items_path(args.output))
    got = aot.run_in_fresh_process(args.output, batches, kind, imports)
    ok = True
    eager = f"the eager {lossy} model" if lossy else "the eager float32 model"
    for i, (want, have) in enumerate(zip(expected, got)):
        report = aot.parity(want, have)
        print(f"batch {i} ({_describe(batches[i])}), package vs {eager} (the packaging):")
        print("  " + str(report).replace("\n", "\n  "))
        ok = ok and report.ok
    if reference is None:
        print(
            "not quantized (--quantize none, --precision fp32): the package vs eager lines "
            "above are its error against the float32 model"
        )
    else:
        print(
            f"{lossy} eager model vs the float32 model on the same batches (what {lossy} "
            "costs; reported, not checked):"
        )
        # logits with a column per task (a ranking model's) get a per-task report
        per_task = bool(exported.predict_limits().tasks)
        for line in _against_float(reference, expected, per_task):
            print("  " + line)
    print(f"wrote {args.output} ({args.format}) and {' and '.join(written)}")
    return 0 if ok else 1


def _served(model: torch.nn.Module, kind: str, args: argparse.Namespace) -> Dict[str, Any]:
    """What ``predict`` needs to know of a package's model (stored in its sample file; the
    catalogue's file is added where the model has one)."""
    served: Dict[str, Any] = {
        "model": kind,
        "form": args.form,
        "dynamic": list(args.dynamic),
        "max_batch": args.max_batch,
        "num_items": int(model.num_items),
    }
    served.update(_server(model).package_fields())  # the sizes its serving checks against
    return served


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


def _exported_server(module: torch.nn.Module) -> Any:
    """The server of the model inside what ``export`` exports (the model, its serving step,
    or either in half precision), in the dtype and with the tables of the package."""
    from tzrec_acc.precision import HalfPrecision

    inner = module.model if isinstance(module, HalfPrecision) else module
    step_server = getattr(inner, "server", None)  # a serving step holds its model's server
    return step_server if step_server is not None else _server(inner)


def _server(model: torch.nn.Module) -> Any:
    from tzrec_gr.serving import server_for

    return server_for(model)


def _op_libraries(program: torch.export.ExportedProgram) -> List[str]:
    """The modules a loader imports for the graph's custom ops: tzrec_ops' triton library,
    and fbgemm_gpu (the pytorch backend's jagged ops where fbgemm is installed)."""
    names = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    libraries = {"tzrec_ops.": "tzrec_ops.backends.triton.library", "fbgemm.": "fbgemm_gpu"}
    return [module for prefix, module in libraries.items() if any(prefix in n for n in names)]


def _vocabulary_key() -> str:
    from tzrec_gr.vocabulary import VOCABULARY_KEY

    return VOCABULARY_KEY


def _describe(args: Tuple[Any, ...]) -> str:
    from torch.utils import _pytree as pytree

    leaves = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    return f"{len(leaves)} input tensors, {sum(t.numel() for t in leaves)} elements"
