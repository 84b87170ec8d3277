"""``python -m tzrec_bench``: the ``tzrec-bench`` command (works under ``torchrun -m``)."""

import sys

from tzrec_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
