"""tzrec-bench: Benchmarks for tzrec: kernel benchmarks and train/eval runs against baselines."""

__version__ = "0.1.0"
