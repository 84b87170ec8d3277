"""STU (sequential transduction unit) layers and stacks, with a functional KV cache.

Legend: B = batch, L = total tokens of the jagged batch, E = embedding dim, H = heads,
A = attention (q/k) dim per head, V = hidden (v/u) dim per head, C = contextual prefix
length, T_b = number of targets (candidates) at the end of sample b, N = ``max_seq_len``.

Each sample is laid out as ``[contextual prefix (C) | history (U_b) | targets (T_b)]``.

KV cache design: the cache is a **value**, not module state. :class:`KVCache` holds one
layer's cached keys/values; :meth:`STULayer.forward` returns a new cache when asked to
(``kv_caching_lengths``), and :meth:`STULayer.cached_forward` takes a cache and returns
``(output, full_cache)`` where ``full_cache`` is the input cache with the new tokens
appended (or ``None`` with ``update_cache=False``, for scoring candidates against a fixed
history). Keeping the old cache, rolling forward to the new one, or trimming it is the
caller's choice, so a layer can serve many requests at once and is safe to re-enter.
Attention reads the cache in place (the split form of ``delta_hstu_mha``); only
``update_cache=True`` copies it, to build the returned cache.

One module per idea, all re-exported here:

* :mod:`tzrec_gr.stu.interface`: the :class:`STU` contract and :class:`STUOutput`;
* :mod:`tzrec_gr.stu.kv_cache`: :class:`KVCache` and the jagged cuts that build one (a
  prefix of a forward's keys/values, a cache with new rows appended);
* :mod:`tzrec_gr.stu.serving_cache`: :class:`ServingCache`, every layer's cache for a batch of
  users plus what serving keeps beside it (a pytree, the value the servers of
  :mod:`tzrec_gr.serving` take and return);
* :mod:`tzrec_gr.stu.layer`: :class:`STULayer` (full, truncated and cached forwards);
* :mod:`tzrec_gr.stu.stack`: :class:`STUStack` and :class:`STUStackOutput`.
"""

from tzrec_gr.stu.interface import STU, STUOutput
from tzrec_gr.stu.kv_cache import KVCache
from tzrec_gr.stu.layer import STULayer
from tzrec_gr.stu.serving_cache import ServingCache
from tzrec_gr.stu.stack import STUStack, STUStackOutput

__all__ = [
    "KVCache",
    "STU",
    "STULayer",
    "STUOutput",
    "STUStack",
    "STUStackOutput",
    "ServingCache",
]
