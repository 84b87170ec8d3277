"""``tzrec-bench ops``: time any tzrec-ops op on any registered backend.

- :mod:`~tzrec_bench.opbench.shapes`: the benchmark batch (jagged lengths, offsets, targets)
  and the architecture §6 FLOP formulas;
- :mod:`~tzrec_bench.opbench.cases`: per op, the inputs and the call for a named backend (and
  torch's SDPA as the attention reference);
- :mod:`~tzrec_bench.opbench.timing`: median times and peak memory of one point;
- :mod:`~tzrec_bench.opbench.sweep`: the sweep over ops, backends, modes and lengths;
- :mod:`~tzrec_bench.opbench.report`: the table, the CSV rows and the PNG plot;
- :mod:`~tzrec_bench.opbench.command`: the ``ops`` subcommand's options and checks.
"""
