"""``tzrec-bench show``: what a run's model knows, in raw ids.

::

    tzrec-bench show runs/hstu --user 17            # the history predict --users 17 uses
    tzrec-bench show runs/hstu --user 17 --data events.csv
    tzrec-bench show runs/hstu --items > items.tsv   # the item vocabulary: row, raw id

``--user`` reads the user's history from the run's event log exactly as ``predict --users``
does (:mod:`tzrec_bench.predict_users`) and prints one event a line, oldest first: its time
and raw item id, tab-separated (and ``unknown`` after an item the model does not know, which
predict drops). ``--items`` prints the checkpoint's item vocabulary, one ``row<TAB>raw id`` a
line in row order. Lines for people (counts, where from) go to stderr, so stdout holds only
the table.

Exit status: 0; 1 for a user the log does not hold or a missing data file; 2 for a bad
option or checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, formatter: type) -> argparse.ArgumentParser:
    """The ``show`` subcommand's parser."""
    p = subparsers.add_parser(
        "show",
        help="a user's history or the item vocabulary of a trained run, in raw ids",
        description=(
            "Print what a run's model sees: --user ID: the user's history from the run's "
            "event log (read as predict --users reads it: time<TAB>raw item id, oldest "
            "first); --items: the item vocabulary (row<TAB>raw item id). Counts and sources "
            "go to stderr."
        ),
        epilog="examples:\n  tzrec-bench show runs/hstu --user 17\n"
        "  tzrec-bench show runs/hstu --items > items.tsv",
        formatter_class=formatter,
    )
    p.add_argument("checkpoint", metavar="PATH",
                   help="a run's --out-dir (its best.pt, else checkpoint.pt) or a .pt file")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--user", metavar="ID", help="a raw user id of the run's event log")
    what.add_argument("--items", action="store_true", help="the model's item vocabulary")
    p.add_argument("--data", metavar="LOG",
                   help="with --user: the event log to read, with the run's --columns and "
                   "--min-events (default: the run's --data)")
    return p


def _fail(parser: argparse.ArgumentParser, message: str, status: int) -> int:
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return status


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs ``show``; returns the exit status."""
    from tzrec_bench.predict import load_session
    from tzrec_gr.checkpoint import resolve_checkpoint

    if args.data is not None and args.user is None:
        return _fail(parser, "--data applies with --user", 2)
    file = resolve_checkpoint(args.checkpoint)
    if not file.is_file():
        return _fail(parser, f"checkpoint: no checkpoint at {file}", 2)
    try:
        session, _, config = load_session(file)
    except ValueError as exc:  # CheckpointError: damaged, or not a model predict serves
        return _fail(parser, str(exc), 2)
    items = session.vocabularies.items if session.vocabularies is not None else None
    if args.items:
        return _show_items(file, items, session.model.num_items)
    return _show_user(parser, args, config, items, session.server.max_events)


def _show_items(file: Any, items: Any, num_items: int) -> int:
    if items is None:
        print(f"{file} holds no id vocabulary: its {num_items} items are the rows "
              f"0..{num_items - 1}", file=sys.stderr)
        return 0
    print(f"{len(items)} {items.kind} item ids of {file} (row<TAB>raw id)", file=sys.stderr)
    for row, raw in enumerate(items.raw(range(len(items)))):
        print(f"{row}\t{raw}")
    return 0


def _show_user(parser: argparse.ArgumentParser, args: argparse.Namespace, config: dict,
               items: Optional[Any], max_events: int) -> int:
    from tzrec_bench.data import DataFormatError
    from tzrec_bench.predict_users import history, load_run_data, lookup_users

    try:
        data = load_run_data(config, args.data)  # FileNotFoundError: exit 1, by main
    except DataFormatError:
        raise  # a malformed log: exit 1, by main
    except ValueError as exc:
        return _fail(parser, str(exc), 2)
    lookup = lookup_users(data.dataset, [args.user])
    if not lookup.found:
        return _fail(parser, f"user {args.user!r} is not in {data.source}", 1)
    user, row = lookup.found[0]
    record = history(data.dataset, row)
    n = len(record["item_ids"])
    known = (items.rows(record["item_ids"]) >= 0).tolist() if items is not None else [True] * n
    newest = f"; the model reads the newest {max_events}" if n > max_events else ""
    print(f"user {user!r}: {n} events in {data.source} (time<TAB>raw item id, oldest "
          f"first{newest})", file=sys.stderr)
    for time, item, ok in zip(record["timestamps"], record["item_ids"], known):
        print(f"{time}\t{item}" + ("" if ok else "\tunknown"))
    return 0
