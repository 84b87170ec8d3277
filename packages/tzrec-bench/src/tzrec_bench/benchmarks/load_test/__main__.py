"""``python -m tzrec_bench.benchmarks.load_test``: runs
:func:`tzrec_bench.benchmarks.load_test.main`."""

from tzrec_bench.benchmarks.load_test import main

if __name__ == "__main__":
    raise SystemExit(main())
