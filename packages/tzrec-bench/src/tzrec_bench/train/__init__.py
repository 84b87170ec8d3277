"""Training and evaluation harness.

- :mod:`~tzrec_bench.train.loop`: ``train(config)`` and ``evaluate(path)`` (the CLI's
  subcommands) and the gradient loop, ``Trainer``;
- :mod:`~tzrec_bench.train.run`: what every run shares (validation, checkpoint.pt, the test
  split, the report); :mod:`~tzrec_bench.train.fitted`: the count baselines' run;
- :mod:`~tzrec_bench.train.strategies`: ``Replicated`` and ``Sharded``, where the weights
  live (``--sharding``); :mod:`~tzrec_bench.train.sharding`: torchrec's side of ``Sharded``;
- :mod:`~tzrec_bench.train.config`: ``TrainConfig``, every setting of a run;
  :mod:`~tzrec_bench.train.validation`: ``validate``, every check of them;
- :mod:`~tzrec_bench.train.checkpoint`: the files of a run and RNG states;
- :mod:`~tzrec_bench.train.averaging`: the exponential moving average of the weights
  (``--ema-decay``) that validation, best.pt and the test then use;
- :mod:`~tzrec_bench.train.factory`: models (from :mod:`tzrec_gr.models.registry`) and
  tasks by name;
- :mod:`~tzrec_bench.train.retrieval` / :mod:`~tzrec_bench.train.ranking`: the two tasks;
  :mod:`~tzrec_bench.train.tasks`: what the rest of the trainer knows about each, looked up
  from a model's record;
- :mod:`~tzrec_bench.train.metrics`: metrics (the losses are the models' own, from
  :mod:`tzrec_gr.losses`).

Importing this package registers tzrec-bench's baselines (:mod:`tzrec_bench.baselines`) in
the model registry, so that ``--model`` names them; nothing else is imported here, so that a
module of this package imports without the loop and its dependencies.
"""

import tzrec_bench.baselines  # noqa: F401  (registers the baselines' models)
