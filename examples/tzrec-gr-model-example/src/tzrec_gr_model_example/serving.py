"""The server of :class:`~tzrec_gr_model_example.model.OneLayerHSTU`.

The model keeps tzrec-gr's retrieval serving protocol (``item_embeddings``, ``transducer``,
``embed_features``, ``check_history``, ``last_rows``, ``item_embedding``, ``num_items``,
``max_seq_len``), so :class:`~tzrec_gr.serving.RetrievalServer`'s prefill, extend, score,
top-K and export steps serve it unchanged; only the model class it accepts is this
server's own.
"""

from __future__ import annotations

from tzrec_gr.serving import RetrievalServer
from tzrec_gr_model_example.model import OneLayerHSTU

__all__ = ["OneLayerHSTUServer"]


class OneLayerHSTUServer(RetrievalServer):
    """Serves a :class:`OneLayerHSTU` as tzrec-gr serves its HSTU retrieval model.

    Raises:
        TypeError: ``model`` is not a OneLayerHSTU.
    """

    model_class = OneLayerHSTU
