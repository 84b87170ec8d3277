"""What ``--quantize`` or ``--precision`` costs: the lossy model against the float32 one."""

from __future__ import annotations

import argparse
from typing import Any, List, Optional, Sequence, Tuple

import torch

from tzrec_acc.cli._batches import _module_and_batches, _to


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
