"""``python -m tzrec_acc``: turn a saved tzrec-gr model into a served package, and run one.

::

    python -m tzrec_acc export --model run/best.pt --format aoti --output ranking.pt2
    python -m tzrec_acc export --model run --output retrieval.pt2     # a run's folder
    python -m tzrec_acc run ranking.pt2
    python -m tzrec_acc run ranking.pt2 --input users.csv          # = predict ranking.pt2 ...
    python -m tzrec_acc predict run/best.pt --input users.parquet --output top10.parquet
    python -m tzrec_acc predict run --input users.parquet --output top10.parquet
    python -m tzrec_acc predict ranking.pt2 --input users.csv --output scores.csv
    python -m tzrec_acc predict retrieval.pt2 --input users.csv --output top10.csv

``export`` reads :mod:`tzrec_acc.settings` for what the options leave open (the format
from ``ENABLE_TRT`` / ``ENABLE_AOT``, embedding quantization from ``QUANT_EMB``, TF32 from
``TF32_MATMUL`` / ``TF32_CUDNN``), rebuilds the model (a tzrec-bench checkpoint, or
``--config`` + a state dict; a run's folder reads its ``best.pt``, else ``checkpoint.pt``),
optionally quantizes it or casts it to half precision,
exports it with dynamic dims, builds the package (``aoti``: an AOTInductor package;
``fx``: the exported FX program saved with ``torch.export.save``; ``trt``: a
TensorRT-compiled program), loads that package in a fresh process and prints the
per-output parity with the eager model it exported (the quantized or half-precision one,
when so exported: this checks the packaging) on the sample batch and on a batch of one more
user. With ``--quantize`` other than ``none`` or ``--precision`` other than ``fp32`` it also
prints what that costs against the float32 model on the same batches: each output's error
and, for ranking models, each task's AUC change against the float model's decisions (see
:func:`tzrec_acc.cli._quality._against_float`; the sample has no labels). Next to
``OUTPUT`` it writes ``OUTPUT.sample.pt``: the sample batches, the eager outputs, the
package kind and the modules its loader imports, and what ``predict`` needs to know of the
model (its kind, catalogue and bounds, the form and the dynamic dims) and the checkpoint's
id vocabularies (``vocabulary``: :meth:`tzrec_gr.vocabulary.IdVocabularies.state`, when the
checkpoint has them); ``run`` and ``predict`` read it.
For a retrieval model it also writes ``OUTPUT.items.pt``: the catalogue as the model's top-K
scores it (:func:`tzrec_acc.gr.item_table`, the L2-normalized item embeddings in the
exported model's dtype), which the package (the user tower) does not hold.
``export`` checks ``--output`` (its suffix, that its folder exists and is writable), the
options and the model file before any export or compile work.

``run PACKAGE`` replays the stored sample batch and prints the outputs and their parity
with the stored eager outputs. ``run PACKAGE --input FILE [--output FILE]`` is
``predict PACKAGE --input FILE`` (the same function, with predict's defaults for the options
``run`` does not take); without ``--output`` the rows go to stdout as CSV.

``predict`` writes top-K recommendations (retrieval) or per-task candidate probabilities
(ranking) for every user of a Parquet, CSV or JSONL file (the columns, the bad-row handling
and the output: :mod:`tzrec_gr.serving.files`, shared with ``tzrec-bench predict``; item ids
are raw ids through the model's vocabulary unless ``--ids model``, seen items are kept unless
``--exclude-seen``). Its model is a checkpoint or a tzrec-bench run's folder (or
``--config`` + a state dict), served by
:class:`tzrec_gr.serving.ServingSession`, or a ``--form full`` package (``.pt2``) served by
:class:`tzrec_acc.serving.PackageSession` in this process, in batches of at most its
``--max-batch``: a ranking package scores the candidates, a retrieval package gives the user
embeddings that top-K ranks against the ``OUTPUT.items.pt`` catalogue written beside it. A
``--form serving`` package scores against a cache that only the model's prefill makes, so
it is refused, naming the checkpoint route.

Exit status: 0 on success, 1 when the package's outputs do not match eager or a bad row
under ``predict --on-error fail``, 2 for bad options, files, models, settings or a missing
extra (the message says which).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from tzrec_acc.cli._export import _export
from tzrec_acc.cli._options import UsageError, _parser
from tzrec_acc.cli._predict import _predict
from tzrec_acc.cli._quality import _auc  # noqa: F401  (tested as tzrec_acc.cli._auc)
from tzrec_acc.cli._run import _run

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"export": _export, "run": _run, "predict": _predict}
    try:
        return commands[args.command](args)
    except (UsageError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
