"""The load test's former path, :mod:`tzrec_bench.benchmarks.load_test` under its old names:
``python -m tzrec_bench.load_test`` (documented before the load test moved) runs it, and
``tzrec_bench.load_test`` and its submodules import the same modules."""

import sys

from tzrec_bench.benchmarks import load_test as _load_test
from tzrec_bench.benchmarks.load_test import *  # noqa: F403  (its __all__)
from tzrec_bench.benchmarks.load_test import model, run, search, stream

__all__ = _load_test.__all__

# ``import tzrec_bench.load_test.run`` finds the moved module (one module object per file)
for _module in (model, run, search, stream):
    sys.modules["tzrec_bench.load_test." + _module.__name__.rsplit(".", 1)[1]] = _module

if __name__ == "__main__":
    raise SystemExit(_load_test.main())
