"""``python -m tzrec_acc``: turn a saved tzrec-gr model into a served package, and run one.

::

    python -m tzrec_acc export --model run/best.pt --format aoti --output ranking.pt2
    python -m tzrec_acc export --model run --output retrieval.pt2     # a run's folder
    python -m tzrec_acc run ranking.pt2
    python -m tzrec_acc run ranking.pt2 --input users.csv          # = predict ranking.pt2 ...
    python -m tzrec_acc predict run/best.pt --input users.parquet --output top10.parquet
    python -m tzrec_acc predict run --input users.parquet --output top10.parquet
    python -m tzrec_acc predict ranking.pt2 --input users.csv --output scores.csv
    python -m tzrec_acc predict retrieval.pt2 --input users.csv --output top10.csv

``export`` reads :mod:`tzrec_acc.settings` for what the options leave open (the format
from ``ENABLE_TRT`` / ``ENABLE_AOT``, embedding quantization from ``QUANT_EMB``, TF32 from
``TF32_MATMUL`` / ``TF32_CUDNN``), rebuilds the model (a tzrec-bench checkpoint, or
``--config`` + a state dict; a run's folder reads its ``best.pt``, else ``checkpoint.pt``),
optionally quantizes it or casts it to half precision,
exports it with dynamic dims, builds the package (``aoti``: an AOTInductor package;
``fx``: the exported FX program saved with ``torch.export.save``; ``trt``: a
TensorRT-compiled program), loads that package in a fresh process and prints the
per-output parity with the eager model it exported (the quantized or half-precision one,
when so exported: this checks the packaging) on the sample batch and on a batch of one more
user. With ``--quantize`` other than ``none`` or ``--precision`` other than ``fp32`` it also
prints what that costs against the float32 model on the same batches: each output's error
and, for ranking models, each task's AUC change against the float model's decisions (see
:func:`_against_float`; the sample has no labels). Next to
``OUTPUT`` it writes ``OUTPUT.sample.pt``: the sample batches, the eager outputs, the
package kind and the modules its loader imports, and what ``predict`` needs to know of the
model (its kind, catalogue and bounds, the form and the dynamic dims) and the checkpoint's
id vocabularies (``vocabulary``: :meth:`tzrec_gr.vocabulary.IdVocabularies.state`, when the
checkpoint has them); ``run`` and ``predict`` read it.
For a retrieval model it also writes ``OUTPUT.items.pt``: the catalogue as the model's top-K
scores it (:func:`tzrec_acc.gr.item_table`, the L2-normalized item embeddings in the
exported model's dtype), which the package (the user tower) does not hold.
``export`` checks ``--output`` (its suffix, that its folder exists and is writable), the
options and the model file before any export or compile work.

``run PACKAGE`` replays the stored sample batch and prints the outputs and their parity
with the stored eager outputs. ``run PACKAGE --input FILE [--output FILE]`` is
``predict PACKAGE --input FILE`` (the same function, with predict's defaults for the options
``run`` does not take); without ``--output`` the rows go to stdout as CSV.

``predict`` writes top-K recommendations (retrieval) or per-task candidate probabilities
(ranking) for every user of a Parquet, CSV or JSONL file (the columns, the bad-row handling
and the output: :mod:`tzrec_gr.serving.files`, shared with ``tzrec-bench predict``; item ids
are raw ids through the model's vocabulary unless ``--ids model``, seen items are kept unless
``--exclude-seen``). Its model is a checkpoint or a tzrec-bench run's folder (or
``--config`` + a state dict), served by
:class:`tzrec_gr.serving.ServingSession`, or a ``--form full`` package (``.pt2``) served by
:class:`tzrec_acc.serving.PackageSession` in this process, in batches of at most its
``--max-batch``: a ranking package scores the candidates, a retrieval package gives the user
embeddings that top-K ranks against the ``OUTPUT.items.pt`` catalogue written beside it. A
``--form serving`` package scores against a cache that only the model's prefill makes, so
it is refused, naming the checkpoint route.

Exit status: 0 on success, 1 when the package's outputs do not match eager or a bad row
under ``predict --on-error fail``, 2 for bad options, files, models, settings or a missing
extra (the message says which).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import pathlib
import sys
import tempfile
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
    ex.add_argument(
        "--model",
        required=True,
        help="tzrec-bench checkpoint or run folder (its best.pt, else checkpoint.pt), or a "
        "state dict",
    )
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
    run = sub.add_parser(
        "run",
        help="score the sample batch with an exported package, or a file of users (--input)",
        description="Without --input: run the package on the sample batch stored beside it "
        "and compare with the eager outputs stored at export. With --input: predict for "
        "every user of the file, exactly as 'predict PACKAGE --input FILE' does.",
    )
    run.add_argument("package", help="a package written by export")
    run.add_argument(
        "--input",
        metavar="FILE",
        help="users' histories (.parquet, .csv or .jsonl, the columns of predict --input); "
        "the package must be one predict takes (a --form full package)",
    )
    run.add_argument(
        "--output",
        metavar="FILE",
        help="with --input: predictions to .parquet or .csv (default: CSV on stdout)",
    )
    run.add_argument("--batch-size", type=int, metavar="B", help="with --input: as predict's")
    run.add_argument("--on-error", choices=("skip", "fail"), help="with --input: as predict's")
    run.add_argument("--ids", choices=("raw", "model"), help="with --input: as predict's")
    run.add_argument(
        "--no-progress", dest="progress", action="store_false", help="with --input: no bar"
    )
    pr = sub.add_parser(
        "predict",
        help="top-K recommendations or candidate scores for a file of users' histories",
        description="Predict for every user of --input (Parquet, CSV or JSONL) and write "
        "--output (Parquet or CSV): top --k items (retrieval checkpoints and packages) or each "
        "candidate's probability per task (ranking checkpoints and packages); packages: "
        "written by export --form full.",
    )
    pr.add_argument(
        "model",
        help="a tzrec-bench checkpoint or run folder (its best.pt, else checkpoint.pt), a "
        "state dict (with --config) or a package (.pt2) written by export --form full",
    )
    pr.add_argument("--config", help="JSON/TOML model config, for a plain state dict")
    pr.add_argument("--backend", help="ops backend to build the model with (checkpoints)")
    try:
        _files().add_predict_arguments(pr)
    except ImportError:  # without tzrec-gr: ``predict`` says what to install when run
        pr.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _files() -> Any:
    from tzrec_ops.extras import require

    return require("tzrec_gr.serving.files", "tzrec-acc[gr]", "predict")


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


def _model_file(model: str, config: Optional[str]) -> pathlib.Path:
    """``--model``: the file, or a tzrec-bench run's folder's ``best.pt``, else its
    ``checkpoint.pt`` (:func:`tzrec_gr.serving.resolve_checkpoint`; a state dict with
    ``--config`` is a file)."""
    if config is not None or not pathlib.Path(model).is_dir():
        return pathlib.Path(model)
    from tzrec_acc.checkpoint import resolve_path

    return resolve_path(model)


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
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {args.device!r} is not a device ({exc})") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine")


def _export(args: argparse.Namespace) -> int:
    from tzrec_acc import aot, gr, settings
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

        kind_of_model = model_kind(model)
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
    # the catalogue a retrieval package's top-K ranks against, from the exported model
    items = gr.item_table(_retrieval_model(module)) if kind_of_model == "retrieval" else None
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
        for line in _against_float(reference, expected, kind_of_model == "ranking"):
            print("  " + line)
    print(f"wrote {args.output} ({args.format}) and {' and '.join(written)}")
    return 0 if ok else 1


def _vocabulary_key() -> str:
    from tzrec_gr.vocabulary import VOCABULARY_KEY

    return VOCABULARY_KEY


def _lossy(args: argparse.Namespace) -> str:
    """What makes the exported model differ from the float32 model ("" for nothing)."""
    if args.quantize != "none":
        return f"--quantize {args.quantize}"
    return f"--precision {args.precision}" if args.precision != "fp32" else ""


def _float_outputs(
    model: torch.nn.Module, args: argparse.Namespace, batches: Sequence[Tuple[Any, ...]]
) -> List[List[torch.Tensor]]:
    """The float32 ``model``'s outputs on the batches the exported module ran: the same
    seeds give the same ids, lengths and times (checked); a serving step's cache is the
    float model's own prefill of the same histories, so its error is part of the measure."""
    from torch.utils import _pytree as pytree

    from tzrec_acc import aot

    plain = argparse.Namespace(**{**vars(args), "precision": "fp32"})
    module, ours, _ = _module_and_batches(model, plain)
    ours = [_to(b, args.device) for b in ours][: len(batches)]
    for mine, theirs in zip(ours, batches):
        a, b = pytree.tree_leaves(mine), pytree.tree_leaves(theirs)
        same = len(a) == len(b) and all(
            torch.equal(x.cpu(), y.cpu())
            for x, y in zip(a, b)
            if isinstance(x, torch.Tensor) and not x.is_floating_point()
        )
        if not same:  # a bug here, not a user error: the comparison would be meaningless
            raise RuntimeError("the float model's sample batches differ from the exported ones")
    with torch.no_grad():
        return [aot.flat_outputs(module(*b)) for b in ours]


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> Optional[float]:
    """Binary AUC (Mann-Whitney, ties counted one half); None with a single class."""
    labels = labels.bool().flatten()
    pos = int(labels.sum())
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return None
    values, inverse, counts = torch.unique(
        scores.double().flatten(), return_inverse=True, return_counts=True
    )
    end = torch.cumsum(counts, 0).double()
    ranks = (end - (counts.double() - 1) / 2)[inverse]  # 1-based, ties averaged
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _against_float(
    reference: Sequence[Sequence[torch.Tensor]],
    lossy: Sequence[Sequence[torch.Tensor]],
    ranking: bool,
) -> List[str]:
    """Lines of the lossy model's error against the float32 model over all sample batches.

    Per output: the max and mean absolute error and the max elementwise relative error. For
    a ranking model's logits ([L_t, tasks]), per task: the max absolute error of the
    probabilities and the AUC change. The sample has no labels, so the AUC is taken against
    pseudo-labels from the float model: a candidate is positive when its float probability
    is above the median of the sample's (its top half; a fixed 0.5 threshold would leave a
    model of rare clicks no positive). The float model's AUC against them is 1 (less with
    ties at the median), so the change says how much of the float model's order the lossy
    model keeps across that split: agreement with the float model, not accuracy.
    """
    lines = []
    for i in range(len(reference[0])):
        want = torch.cat([r[i].detach().cpu().double() for r in reference])
        got = torch.cat([q[i].detach().cpu().double() for q in lossy])
        err = (got - want).abs()
        rel = err / want.abs().clamp(min=torch.finfo(torch.float64).tiny)
        lines.append(
            f"error of output {i}: shape {list(want.shape)}  max abs err {float(err.max()):.3g}"
            f"  mean abs err {float(err.mean()):.3g}  max rel err {float(rel.max()):.3g}"
        )
        if not ranking or i != 0 or want.dim() != 2:
            continue
        for task in range(want.shape[1]):
            p_float, p_lossy = torch.sigmoid(want[:, task]), torch.sigmoid(got[:, task])
            labels = p_float > p_float.median()
            auc_float, auc_lossy = _auc(p_float, labels), _auc(p_lossy, labels)
            drift = float((p_lossy - p_float).abs().max())
            drift = f"task {task}: probability max abs err {drift:.3g}"
            if auc_float is None or auc_lossy is None:
                lines.append(f"{drift}; AUC: n/a (the float probabilities are all equal)")
                continue
            lines.append(
                f"{drift}; AUC change {auc_lossy - auc_float:+.4f} ({auc_lossy:.4f} vs the "
                f"float model's {auc_float:.4f}; labels: the float model's top half of the "
                f"{want.shape[0]} sample candidates, not real labels)"
            )
    return lines


def _served(model: torch.nn.Module, kind: str, args: argparse.Namespace) -> Dict[str, Any]:
    """What ``predict`` needs to know of a package's model (stored in its sample file)."""
    served: Dict[str, Any] = {
        "model": kind,
        "form": args.form,
        "dynamic": list(args.dynamic),
        "max_batch": args.max_batch,
        "num_items": int(model.num_items),
    }
    if kind == "retrieval":
        from tzrec_acc.serving import items_path

        served["max_events"] = int(model.max_seq_len)
        served["items"] = pathlib.Path(items_path(args.output)).name  # beside the package
        return served
    pre = model.transducer.input_preprocessor
    width = pre.contextual_seq_len() * pre.contextual_feature_dim if model.contextual_seq_len else 0
    served.update(
        max_events=int(model.max_uih_len),
        max_candidates=int(model.max_targets),
        contextual_width=int(width),
        num_tasks=int(model.num_tasks),
    )
    return served


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


def _retrieval_model(module: torch.nn.Module) -> torch.nn.Module:
    """The retrieval model inside what ``export`` exports (the model, its serving step, or
    either in half precision), in the dtype and with the tables of the package."""
    from tzrec_acc import gr
    from tzrec_acc.precision import HalfPrecision

    inner = module.model if isinstance(module, HalfPrecision) else module
    return inner.model if isinstance(inner, gr.RetrievalServingStep) else inner


def _run(args: argparse.Namespace) -> int:
    from tzrec_acc import aot
    from tzrec_acc.serving import sample_path

    if args.input is not None:
        return _run_file(args)
    if any(v is not None for v in (args.output, args.batch_size, args.on_error, args.ids)):
        raise UsageError("--output, --batch-size, --on-error and --ids apply with --input FILE")
    package = pathlib.Path(args.package)
    if package.is_dir():
        raise UsageError(
            f"{package} is a folder: run without --input replays an exported package's sample "
            "batch; export the run first (export --model FOLDER), or give --input FILE to "
            "predict from its checkpoint"
        )
    sample_file = pathlib.Path(sample_path(args.package))
    for path in (package, sample_file):
        if not path.is_file():
            raise UsageError(f"no file at {path} (write both with python -m tzrec_acc export)")
    sample: Dict[str, Any] = torch.load(sample_file, weights_only=False)
    batch = sample["batches"][0]
    (out,) = aot.run_in_fresh_process(str(package), [batch], sample["kind"], sample["imports"])
    for i, tensor in enumerate(out):
        print(f"output {i}: shape {list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}")
        print(f"  first rows: {tensor[:3].tolist()}")
    report = aot.parity(sample["expected"][0], out)
    print("package vs the eager outputs stored at export:")
    print("  " + str(report).replace("\n", "\n  "))
    return 0 if report.ok else 1


def _run_file(args: argparse.Namespace) -> int:
    """``run PACKAGE --input FILE``: ``predict PACKAGE --input FILE`` (parsed by predict's
    own parser, so its defaults apply to what ``run`` does not take); no ``--output``: the
    rows are written to a temporary CSV and printed to stdout, the other lines to stderr."""
    argv = ["predict", args.package, "--input", args.input]
    if args.batch_size is not None:
        argv += ["--batch-size", str(args.batch_size)]
    if args.on_error is not None:
        argv += ["--on-error", args.on_error]
    if args.ids is not None:
        argv += ["--ids", args.ids]
    if not args.progress:
        argv.append("--no-progress")
    if args.output is not None:
        return _predict(_parser().parse_args([*argv, "--output", args.output]))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "predictions.csv")
        with contextlib.redirect_stdout(sys.stderr):
            code = _predict(_parser().parse_args([*argv, "--output", path]), "stdout")
        if code == 0:
            sys.stdout.write(pathlib.Path(path).read_text())
    return code


def _package_predictor(path: pathlib.Path, batch_size: int) -> Tuple[Any, Any, int]:
    """(session, limits, batch size) of a ``--form full`` package written by export
    (:class:`tzrec_acc.serving.PackageSession`), in batches of at most its ``--max-batch``."""
    from tzrec_acc import serving

    try:
        session = serving.PackageSession(path)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from exc
    return session, session.limits, min(batch_size, session.max_batch)


def _predict(args: argparse.Namespace, destination: Optional[str] = None) -> int:
    """``predict``; ``destination`` names where the rows go in the last line (default:
    ``--output``)."""
    files = _files()
    try:  # the options and files first: nothing is loaded for a run that cannot finish
        files.check_output_path(args.output)
        files.input_format(args.input)
        device = files.pick_device(args.device)
        if args.batch_size < 1 or args.k < 1:
            raise files.PredictError("--batch-size and --k must be >= 1")
        if not pathlib.Path(args.input).is_file():
            raise files.PredictError(f"--input: no file at {args.input}")
        model_path = _model_file(args.model, args.config)
        if not model_path.is_file():
            raise files.PredictError(f"model: no file at {model_path}")
    except files.PredictError as exc:
        raise UsageError(str(exc)) from exc
    batch_size = args.batch_size
    if model_path.suffix == ".pt2":
        if args.config is not None or args.backend is not None:
            raise UsageError("--config and --backend apply to checkpoints, not to packages")
        predictor, limits, batch_size = _package_predictor(model_path, batch_size)
        what = f"package {model_path}"
    else:
        from tzrec_acc.checkpoint import load_checkpoint

        serving = _serving()
        try:
            model, vocabularies = load_checkpoint(model_path, args.config, args.backend)
            predictor = serving.ServingSession(model, device=device, vocabularies=vocabularies)
        except (ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from exc
        limits = files.session_limits(predictor)
        what = f"{type(model).__name__} from {model_path} on {device}"
    try:
        items, ids_line = files.item_vocabulary(args.ids, predictor.vocabularies, str(model_path))
    except files.PredictError as exc:
        raise UsageError(str(exc)) from exc
    rules = f"; {files.seen_rule(args.exclude_seen)}" if limits.kind == "retrieval" else ""
    print(f"python -m tzrec_acc predict: {what} ({limits.kind}){rules}")
    print(ids_line)
    try:
        summary = files.predict_file(
            predictor,
            limits,
            args.input,
            args.output,
            k=args.k,
            exclude_seen=args.exclude_seen,
            items=items,
            batch_size=batch_size,
            on_error=args.on_error,
            progress=args.progress,
        )
    except files.BadRowError as exc:
        print(f"error: {args.input} {exc} (--on-error fail: nothing written)", file=sys.stderr)
        return 1
    except files.PredictError as exc:
        raise UsageError(str(exc)) from exc
    print(f"wrote {destination or args.output}: {summary}")
    return 0


def _serving() -> Any:
    """:mod:`tzrec_gr.serving` (``tzrec-acc[gr]``)."""
    from tzrec_ops.extras import require

    return require("tzrec_gr.serving", "tzrec-acc[gr]", "predict")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"export": _export, "run": _run, "predict": _predict}
    try:
        return commands[args.command](args)
    except (UsageError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
