"""``tzrec-bench ops``: time any tzrec-ops op on any registered backend.

- :mod:`.shapes`: the benchmark batch (jagged lengths, offsets, targets) and the architecture
  §6 FLOP formulas;
- :mod:`.cases`: per op, the inputs and the call for a named backend (and torch's SDPA as the
  attention reference);
- :mod:`.timing`: median times and peak memory of one point;
- :mod:`.sweep`: the sweep over ops, backends, modes and lengths;
- :mod:`.report`: the table, the CSV rows and the PNG plot;
- :mod:`.command`: the ``ops`` subcommand's options and checks.
"""
