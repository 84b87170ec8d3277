"""Early stopping on a validation metric where higher is better (HR, NDCG, MRR, AUC)."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional


class EarlyStopping:
    """Stops after ``patience`` evaluations in a row that do not beat the best by ``min_delta``.

    Args:
        patience (int): evaluations without improvement before stopping; 0 never stops.
        min_delta (float): how much a value must exceed the best to count as better.
    """

    def __init__(self, patience: int, min_delta: float = 0.0) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.bad_evaluations = 0

    def update(self, value: float, step: int) -> bool:
        """Records an evaluation at ``step``; True when it is the new best."""
        if not math.isnan(value) and (self.best is None or value > self.best + self.min_delta):
            self.best, self.best_step, self.bad_evaluations = value, step, 0
            return True
        self.bad_evaluations += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_evaluations >= self.patience

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad_evaluations}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.bad_evaluations = state["bad"]
