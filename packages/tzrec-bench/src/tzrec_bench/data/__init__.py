"""Data sets for the train/eval harness: users' interaction sequences, sorted by time.

``load_dataset(name)`` gives a :class:`SequenceDataset` (per-user item sequences, timestamps,
ratings or action bitmasks, items remapped to dense ids ``[0, num_items)`` with no padding id);
:func:`leave_one_out` splits it; :func:`make_batch` turns rows into jagged CPU tensors::

    ds = load_dataset("ml-100k", data_dir="path/to/ml-100k")
    split = leave_one_out(ds)
    batch = make_batch(split.train, rows=[0, 1, 2], max_seq_len=200)
    model.loss(batch.item_ids, batch.lengths, batch.timestamps, batch.max_len)
"""

from tzrec_bench.data.actions import Action
from tzrec_bench.data.batch import SequenceBatch, make_batch, make_eval_batch, row_batches
from tzrec_bench.data.cache import default_cache_dir
from tzrec_bench.data.dataset import SequenceDataset
from tzrec_bench.data.load import DATASETS, load_dataset
from tzrec_bench.data.split import HeldOut, LeaveOneOutSplit, leave_one_out
from tzrec_bench.data.synthetic import synthetic
from tzrec_bench.data.text_format import DataFormatError

__all__ = [
    "DATASETS",
    "Action",
    "DataFormatError",
    "HeldOut",
    "LeaveOneOutSplit",
    "SequenceBatch",
    "SequenceDataset",
    "default_cache_dir",
    "leave_one_out",
    "load_dataset",
    "make_batch",
    "make_eval_batch",
    "row_batches",
    "synthetic",
]
