"""tzrec-bench's benchmarks: what a piece of tzrec costs, each measured on its own.

- :mod:`.opbench`: ``tzrec-bench ops``, any tzrec-ops op on any registered backend;
- :mod:`.kernels`: kernel benchmarks beside the op table
  (``python -m tzrec_bench.benchmarks.kernels.delta_attention``: cached attention);
- :mod:`.modules`: tzrec-gr modules on tzrec-ops backends
  (``python -m tzrec_bench.benchmarks.modules.stu_stack`` and ``.ranking_model``);
- :mod:`.train_speed`: ``tzrec-bench train-speed``, training throughput of run configs;
- :mod:`.table_memory`: peak memory with a large item table, replicated or sharded;
- :mod:`.data`: reading a large event log (first load, cached load, memory, cache size);
- :mod:`.export`: what AOTInductor export and int8 quantization buy for HSTU ranking;
- :mod:`.serving`: what a ``ServingSession`` costs per ranking request;
- :mod:`.load_test`: a served model under a stream of requests (sustained rate, latency).

Each module runs with ``python -m tzrec_bench.benchmarks.<name> --help``, except those a
``tzrec-bench`` subcommand runs. Importing this package imports none of them.
"""
