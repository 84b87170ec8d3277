"""A baseline fitted from counts (:mod:`tzrec_bench.baselines.simple`): no gradient step
and no optimizer. The model is fitted once on the training events, then validated, saved
and tested like a trained one."""

from __future__ import annotations

import time
from typing import Any, Dict, Tuple

from tzrec_bench.train.config import TrainConfig
from tzrec_bench.train.distributed import DistContext
from tzrec_bench.train.run import Run
from tzrec_bench.train.strategies import WholeModel


class FittedRun(Run):
    """Fits ``config.model`` (a model whose registry record is ``fitted``); ``--resume``
    fits again."""

    def __init__(self, config: TrainConfig, ctx: DistContext) -> None:
        super().__init__(config, ctx, WholeModel.embedding_tables)
        self.strategy = WholeModel(self.model, self.files)

    def header(self) -> str:
        c = self.config
        return (
            f"tzrec-bench train: {c.model} on {c.shown('data')} ({self.task.describe()})\n"
            f"  {self.ctx.placement}, fitted from the training events (no gradient steps)"
        )

    def advance(self) -> Tuple[float, int]:
        started = time.perf_counter()
        self.model.fit(self.task.split.train)
        seconds = time.perf_counter() - started
        self.log(f"fitted in {seconds:.2f} s")
        return seconds, 0

    def model_states(self) -> Dict[str, Any]:
        # checkpoint.pt keeps the keys of a trained run's; there is nothing to schedule
        return {"model": self.model.state_dict(), "optimizer": {}, "scheduler": {}}
