"""An exponential moving average of a model's weights (``--ema-decay``): Polyak averaging as
in TensorFlow's ``ExponentialMovingAverage`` or timm's ``ModelEmaV2``, written for this
trainer.

After each optimizer step ``t`` (0-based) every parameter's average moves towards it::

    d = min(decay, (1 + t) / (10 + t))
    average = d * average + (1 - d) * parameter

The warm-up of ``d`` (TensorFlow's ``num_updates`` rule) keeps the first validations from
being mostly the random initial weights: ``d`` is 0.1 after the first step, 0.5 after the
ninth, and reaches 0.999 after about 9,000; until ``decay`` is reached the average weighs
roughly the last ninth of the steps. ``t`` is the trainer's step, so a resumed run
takes the same decays as an uninterrupted one.

The averages are kept on the parameters' device in their dtype (the trainer's parameters are
float32; bf16 autocast casts operations, not parameters) and updated with one
``torch._foreach_lerp_`` call: no host synchronization, no Python loop over parameters. The
update runs after the step, outside any captured CUDA graph: a captured step updates the
parameters in place, so the same tensors are read after each replay. Buffers are not
averaged; the averaged model uses the live ones.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Mapping

import torch
from torch import nn

#: the warm-up ``(1 + t) / (WARMUP + t)`` bounds the decay at step ``t``
WARMUP = 10


def decay_at(decay: float, step: int) -> float:
    """The decay applied after the optimizer step ``step`` (0-based): ``decay``, bounded by
    the warm-up ``(1 + step) / (10 + step)``."""
    return min(decay, (1 + step) / (WARMUP + step))


class WeightAverage:
    """The averaged parameters of ``model``, starting from its current weights.

    Args:
        model: the trained module; its parameters must stay the same tensors (they are
            updated in place by the optimizer, as every strategy's are).
        decay: the decay, in (0, 1).
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        self.params: List[torch.Tensor] = [p for _, p in named]
        self.averages: List[torch.Tensor] = [p.detach().clone() for p in self.params]

    def describe(self) -> str:
        """The header's line."""
        return (f"  weights averaged (EMA, decay {self.decay:g}, warm-up min(decay, "
                f"(1+t)/({WARMUP}+t))): validation, best.pt and the test use the average")

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Moves the averages towards the parameters after the optimizer step ``step``."""
        weight = 1.0 - decay_at(self.decay, step)
        torch._foreach_lerp_(self.averages, self.params, weight)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own ones again after
        (copied in place: the tensors an optimizer or a captured graph holds stay valid)."""
        live = self._swap_in()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, live)

    def copy_to_model(self) -> None:
        """Puts the averaged weights into the model for good (the run's end)."""
        self._swap_in()

    @torch.no_grad()
    def _swap_in(self) -> List[torch.Tensor]:
        live = [p.detach().clone() for p in self.params]
        torch._foreach_copy_(self.params, self.averages)
        return live

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The averages by parameter name (checkpoint.pt's ``average``)."""
        return dict(zip(self.names, self.averages))

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Loads what :meth:`state_dict` gave; raises ``ValueError`` naming a missing or
        unexpected parameter."""
        if set(state) != set(self.names):
            odd = sorted(set(state) ^ set(self.names))
            raise ValueError(f"the saved weight average does not match the model's "
                             f"parameters ({', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''})")
        for name, average in zip(self.names, self.averages):
            average.copy_(state[name])
