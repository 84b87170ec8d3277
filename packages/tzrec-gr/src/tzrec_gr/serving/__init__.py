"""Serving: encode users' histories once, then score candidates and append events.

Legend: B = users, E = embedding width.

* :mod:`tzrec_gr.serving.session`: :class:`ServingSession`, the one serving API over both
  models: ``recommend`` (top-K of the catalogue, retrieval), ``score`` (per-task
  probabilities, ranking), per-user state (``open`` / ``extend``) and CUDA graphs inside;
* :mod:`tzrec_gr.serving.inputs`: :class:`Histories` and :class:`Candidates`, its inputs
  (the model's item ids; ``from_raw`` maps the users' raw ids through a checkpoint's
  :class:`~tzrec_gr.vocabulary.IdVocabularies`, which ``TopK.raw_ids`` maps back);
* :func:`resolve_checkpoint`: a run's folder to its ``best.pt``, else ``checkpoint.pt`` (the
  one rule, for tzrec-bench and tzrec-acc);
* :mod:`tzrec_gr.serving.topk`: :func:`catalogue_topk`, exact top-K over a catalogue of any
  size, in chunks on the device;
* :mod:`tzrec_gr.serving.cache`: :class:`ServingCache`, the value every serving call takes
  and returns (a pytree of its tensors);
* :mod:`tzrec_gr.serving.transducer`: an :class:`~tzrec_gr.HSTUTransducer`'s ``prefill``
  and ``cached_forward`` (new tokens against a cache);
* :mod:`tzrec_gr.serving.ranking` and :mod:`tzrec_gr.serving.retrieval`: the models'
  serving calls (``prefill``, ``score``, ``extend``) and their pure steps (``score_step``,
  ``extend_step``, ``event_embeddings_step``: functions of the cache and the new tokens that
  check nothing and read nothing on the host, which ``torch.export`` records).

The models keep the public methods (``model.prefill(...)``, ``model.score(...)``,
``model.score_step(...)``...), which call these functions: the model classes hold the model,
these modules the serving around it.
"""

from tzrec_gr.serving._checkpoint import resolve_checkpoint
from tzrec_gr.serving.cache import ServingCache
from tzrec_gr.serving.inputs import Candidates, Histories
from tzrec_gr.serving.session import ServingSession
from tzrec_gr.serving.topk import TopK, catalogue_topk

__all__ = [
    "Candidates",
    "Histories",
    "ServingCache",
    "ServingSession",
    "TopK",
    "catalogue_topk",
    "resolve_checkpoint",
]
