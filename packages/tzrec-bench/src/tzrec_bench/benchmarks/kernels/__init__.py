"""Kernel benchmarks, one module per op family
(``python -m tzrec_bench.benchmarks.kernels.<name>``)."""
