"""The one driver of the ``predict`` commands, ``tzrec-bench predict`` and ``python -m
tzrec_acc predict``: what runs once a command has parsed its options
(:func:`~tzrec_gr.serving.files.add_predict_arguments` and its own) and loaded its
predictor (a checkpoint's :class:`~tzrec_gr.serving.ServingSession`, or a package's
session) and :class:`~tzrec_gr.serving.files.Limits`.

::

    status = run_predict(session, session_limits(session), args, prog="my-tool predict",
                         title=f"{model_name} on cpu", model_file="best.pt",
                         batch_size=args.batch_size)

It prints the header line (what the command says of its model, then which seen-items rule
applies where the predictions are each user's top ``k`` of the catalogue) and the ids line
(:func:`~tzrec_gr.serving.files.item_vocabulary`), then writes the predictions
(:func:`~tzrec_gr.serving.files.write_predictions`: the summary line and the exit status).
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Tuple, Union

from tzrec_gr.serving._predict import Records
from tzrec_gr.serving.files import (
    Limits,
    Predictor,
    item_vocabulary,
    seen_rule,
    write_predictions,
)
from tzrec_gr.vocabulary import Vocabulary

__all__ = ["Users", "run_predict"]

#: a source of users other than ``--input``: called with the vocabulary of the run's raw
#: item ids (None: the model's ids) once the header is printed, it returns ``(total,
#: records)`` of its users, or an exit status that ends the run (after saying why)
Users = Callable[[Optional[Vocabulary]], Union[int, Tuple[Optional[int], Records]]]


def run_predict(
    predictor: Predictor,
    limits: Limits,
    args: argparse.Namespace,
    *,
    prog: str,
    title: str,
    model_file: str,
    batch_size: int,
    users: Optional[Users] = None,
    destination: Optional[str] = None,
) -> int:
    """A ``predict`` command's run with its predictor loaded.

    Prints ``{prog}: {title}`` (and the seen-items rule where ``limits`` predicts each
    user's top ``k``) and the ids line on stdout, then writes the predictions of
    ``args.input``, or of ``users``, to ``args.output``.

    Args:
        predictor: the session to predict with; its ``vocabularies`` (None: none) map the
            raw ids (``--ids``).
        limits: what a row must fit (the predictor's).
        args: the options of :func:`~tzrec_gr.serving.files.add_predict_arguments`.
        prog: the command, which starts the header and any error line.
        title: what the header says of the model.
        model_file: the checkpoint or package, named by the ids line and its errors.
        batch_size: users per predictor call.
        users: the users, instead of ``args.input`` (see :data:`Users`).
        destination: where the summary line says the rows went. Default: ``args.output``.

    Returns:
        int: 0; 1 after one error line on stderr for a bad row under ``--on-error fail`` or
        no row answered (nothing written either way); or the exit status ``users`` gave.

    Raises:
        PredictError: a bad option or file (the caller's exit status 2).
    """
    items, ids_line = item_vocabulary(args.ids, predictor.vocabularies, model_file)
    rules = f"; {seen_rule(args.exclude_seen)}" if limits.predicts.takes_k else ""
    print(f"{prog}: {title}{rules}")
    print(ids_line)
    records = None
    if users is not None:
        records = users(items)
        if isinstance(records, int):
            return records
    return write_predictions(predictor, limits, args, prog=prog, items=items,
                             batch_size=batch_size, records=records, destination=destination)
