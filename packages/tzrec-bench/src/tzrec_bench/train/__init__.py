"""Training and evaluation harness.

- :mod:`~tzrec_bench.train.loop`: ``train(config)`` and ``evaluate(path)`` (the CLI's
  subcommands), the loop and its checkpoints;
- :mod:`~tzrec_bench.train.config`: ``TrainConfig``, every setting of a run;
- :mod:`~tzrec_bench.train.factory`: models and tasks by name;
- :mod:`~tzrec_bench.train.retrieval` / :mod:`~tzrec_bench.train.ranking`: the two tasks;
- :mod:`~tzrec_bench.train.metrics`: metrics (the losses are the models' own, from
  :mod:`tzrec_gr.losses`).

Nothing is imported here, so that a module of this package imports without the loop and
its dependencies.
"""
