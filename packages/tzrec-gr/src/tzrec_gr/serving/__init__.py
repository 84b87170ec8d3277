"""Serving: encode users' histories once, then score candidates and append events.

Legend: B = users, E = embedding width.

Serving stands on the models: it uses their public interface, and nothing below it (the
models, the transducer, the STU layers) imports it.

* :mod:`tzrec_gr.serving.session`: :class:`ServingSession`, the one serving API over both
  models: ``recommend`` (top-K of the catalogue, retrieval), ``score`` (per-task
  probabilities, ranking), per-user state (``open`` / ``extend``) and CUDA graphs inside;
* :mod:`tzrec_gr.serving.inputs`: :class:`Histories` and :class:`Candidates`, its inputs
  and the one door check of a serving request (the model's item ids; ``from_raw`` maps the
  users' raw ids through a checkpoint's :class:`~tzrec_gr.vocabulary.IdVocabularies`, which
  ``TopK.raw_ids`` maps back);
* :class:`RankingServer` and :class:`RetrievalServer` (:mod:`.ranking`, :mod:`.retrieval`):
  one per model kind, wrapping the model: its tensor API (``prefill``, ``score``,
  ``extend``) and the pure steps (``score_step``, ``extend_step``,
  ``event_embeddings_step``: functions of the cache and the new tokens that check nothing
  and read nothing on the host, which ``torch.export`` records); :class:`ModelServer`
  (:mod:`.server`) is what both answer the session; :func:`server_for` picks one;
* :class:`~tzrec_gr.stu.ServingCache` (re-exported here), the value every serving call takes
  and returns (a pytree of its tensors);
* :mod:`tzrec_gr.serving.transducer`: an :class:`~tzrec_gr.HSTUTransducer`'s ``prefill``
  and ``cached_forward`` (new tokens against a cache);
* :mod:`tzrec_gr.serving.topk`: :func:`catalogue_topk`, exact top-K over a catalogue of any
  size, in chunks on the device.
"""

from tzrec_gr.serving.inputs import Candidates, Histories
from tzrec_gr.serving.ranking import RankingServer
from tzrec_gr.serving.retrieval import RetrievalServer
from tzrec_gr.serving.server import ModelServer
from tzrec_gr.serving.session import ServingSession, server_for
from tzrec_gr.serving.topk import TopK, catalogue_topk
from tzrec_gr.stu import ServingCache

__all__ = [
    "Candidates",
    "Histories",
    "ModelServer",
    "RankingServer",
    "RetrievalServer",
    "ServingCache",
    "ServingSession",
    "TopK",
    "catalogue_topk",
    "server_for",
]
