"""``tzrec-bench run-configs``: train/eval configs run several times and checked against
baseline thresholds.

- :mod:`~tzrec_bench.regression.configs`: a named run config (a small TOML file), the shipped
  ones, and whether its data is there;
- :mod:`~tzrec_bench.regression.baseline`: baseline thresholds and the improved / unchanged /
  regressed / failed verdict of one metric;
- :mod:`~tzrec_bench.regression.harness`: the repeated runs, their mean and spread, the
  summary table and JSON;
- :mod:`~tzrec_bench.regression.published`: papers' results on a data set (shipped TOML
  files), shown beside the runs under the published protocol, never judged;
- :mod:`~tzrec_bench.regression.command`: the subcommand's options.
"""
