"""The argument parser of every tzrec command line (``python -m tzrec_ops``, ``python -m
tzrec_acc``, ``tzrec-bench`` and its subcommands, ``python -m
tzrec_bench.benchmarks.load_test``, ...).

It lives here because every tzrec package depends on tzrec-ops and on nothing else of the
project: tzrec-acc cannot import tzrec-bench, and tzrec-gr is only an extra of tzrec-acc.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line on stderr, exit status 2::

        tzrec-bench train: error: argument --lr: ... (tzrec-bench train --help lists the options)

    argparse's own error prints the whole usage first (8 to 23 lines here), which hides the
    line that matters. ``--help`` is argparse's, unchanged. Subcommand parsers made with
    :meth:`add_subparsers` are of this class too, so their errors name the subcommand.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")
