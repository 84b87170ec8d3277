"""The benchmarks of tzrec-bench: what each part of the stack costs, measured."""
