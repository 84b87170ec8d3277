"""What ``export`` exports: the module, its sample batches and their dynamic shapes."""

from __future__ import annotations

import argparse
from typing import Any, List, Sequence, Tuple

import torch


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
        # --new candidates per user (a model that scores no candidates ignores them)
        batches = [
            gr.sample_inputs(model, args.batch + extra, args.history, args.new, seed=extra)
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


def _to(value: Any, device: torch.device) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)
