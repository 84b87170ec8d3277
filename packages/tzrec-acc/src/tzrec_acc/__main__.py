"""``python -m tzrec_acc``: see :mod:`tzrec_acc.cli`."""

import sys

from tzrec_acc.cli import main

if __name__ == "__main__":
    sys.exit(main())
