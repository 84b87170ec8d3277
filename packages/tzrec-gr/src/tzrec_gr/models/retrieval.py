"""HSTU retrieval: next-item prediction over user histories with a sampled softmax.

Legend: B = batch, L = total history tokens, E = embedding width, N = negatives,
T = candidates per user.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from tzrec_gr._backend import BackendArg
from tzrec_gr.features import (
    UIH_LENGTHS,
    UIH_SEQUENCE,
    UIH_TIMESTAMPS,
)
from tzrec_gr.hstu_transducer import HSTUTransducer
from tzrec_gr.losses import sampled_softmax_loss
from tzrec_gr.models._inputs import (
    check_appended,
    check_batch,
    check_bound,
    check_int_tensor,
    check_item_ids,
    check_lengths,
    check_rows,
)
from tzrec_gr.positional_encoder import HSTUPositionalEncoder
from tzrec_gr.postprocessors import L2NormPostprocessor
from tzrec_gr.preprocessors import UIHPreprocessor
from tzrec_gr.serving import ServingCache, longest
from tzrec_gr.stu import STULayer, STUStack
from tzrec_ops.jagged import mirror, offsets_from_lengths

__all__ = ["HSTURetrieval"]

# extend_step: (rows [L', E], keys, values, offsets [B + 1], lengths [B], users [B, E])
ExtendStepOutput = Tuple[
    torch.Tensor, List[torch.Tensor], List[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor
]


class HSTURetrieval(nn.Module):
    """Causal HSTU over item-id histories; token p is trained to predict item p + 1.

    The loss is a sampled softmax (HSTU paper, retrieval): for each position with a next
    item, logits are ``cos(user_p, item_next) / temperature`` against N shared negatives
    drawn uniformly from the catalogue (a negative equal to the positive is masked out).
    User and item embeddings are L2-normalized. Positions count forward from each history's
    start; timestamps are carried but not encoded.

    Args:
        num_items (int): catalogue size; ids are in ``[0, num_items)``.
        embedding_dim (int): E (item table and STU width).
        num_heads (int): H. Default: 2.
        attention_dim (int): A per head. Default: E // H.
        hidden_dim (int): V per head. Default: E // H.
        num_layers (int): STU layers. Default: 2.
        num_position_buckets (int): position table rows. Default: 512.
        num_negatives (int): N. Default: 128.
        temperature (float): softmax temperature. Default: 0.05.
        dropout_ratio (float): input and STU output dropout. Default: 0.2.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.
        max_seq_len (int): the longest history the model takes (keyword only). Attention
            divides by it, so a user's embeddings depend neither on a call's
            ``max_seq_len`` nor on the other users of the batch, and the serving methods
            give what ``forward`` gives. Default: 512.
        validate_inputs (bool): also check item ids that are on a GPU (one device read per
            call; ids on the CPU are always checked). Keyword only. Default: False.

    Call Args:
        item_ids (torch.Tensor): [L] integer history item ids.
        lengths (torch.Tensor): [B] integer history lengths, in ``[0, max_seq_len]``.
        timestamps (torch.Tensor): [L] integer timestamps.
        max_seq_len (int | None): an upper bound on ``lengths`` for this call, at most the
            constructor's. Default: the constructor's.

    Returns:
        torch.Tensor: [L, E] L2-normalized user embedding after each history token.

    Input errors are ``ValueError`` naming the argument: a float or non-1-D tensor, a
    negative length or one above ``max_seq_len``, lengths that do not sum to
    ``item_ids.shape[0]``, an item id outside ``[0, num_items)`` (see ``validate_inputs``),
    a call bound above the constructor's. Every input is an integer, so no NaN can enter.

    Serving (eval mode; see :meth:`prefill`, :meth:`extend`, :meth:`score`)::

        cache = model.prefill(item_ids, lengths, timestamps)      # histories, once
        scores = model.score(cache, candidate_ids)                # [B, T] cosines
        new_rows, cache = model.extend(cache, new_ids, new_lengths, new_timestamps)

    :meth:`extend_step`, :meth:`event_embeddings_step` and :meth:`score_step` are the same
    steps as functions of the cache's tensors, which ``torch.export`` can record (the
    methods over a cache check their inputs and call them).
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int,
        num_heads: int = 2,
        attention_dim: Optional[int] = None,
        hidden_dim: Optional[int] = None,
        num_layers: int = 2,
        num_position_buckets: int = 512,
        num_negatives: int = 128,
        temperature: float = 0.05,
        dropout_ratio: float = 0.2,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
        *,
        max_seq_len: int = 512,
        validate_inputs: bool = False,
    ) -> None:
        super().__init__()
        if num_items <= 1:
            raise ValueError(f"num_items must be > 1, got {num_items}")
        if num_negatives <= 0:
            raise ValueError(f"num_negatives must be > 0, got {num_negatives}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be an int > 0, got {max_seq_len!r}")
        self.num_items = num_items
        self.embedding_dim = embedding_dim
        self.num_negatives = num_negatives
        self.temperature = temperature
        self.max_seq_len = max_seq_len
        # the most tokens a user's cache holds (one per event)
        self.max_cached_len = max_seq_len
        self.validate_inputs = validate_inputs
        self.item_embeddings = nn.Embedding(num_items, embedding_dim, device=device)
        nn.init.normal_(self.item_embeddings.weight, std=0.02)
        layers = [
            STULayer(
                embedding_dim,
                num_heads,
                hidden_dim or embedding_dim // num_heads,
                attention_dim or embedding_dim // num_heads,
                output_dropout_ratio=dropout_ratio,
                target_aware=False,
                backend=backend,
                device=device,
            )
            for _ in range(num_layers)
        ]
        self.transducer = HSTUTransducer(
            UIHPreprocessor(embedding_dim, embedding_dim, backend=backend, device=device),
            STUStack(layers),
            positional_encoder=HSTUPositionalEncoder(
                embedding_dim, num_position_buckets, backend=backend, device=device
            ),
            output_postprocessor=L2NormPostprocessor(),
            input_dropout_ratio=dropout_ratio,
            return_full_embeddings=True,
            backend=backend,
            max_uih_len=max_seq_len,
        )

    def item_embedding(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., E] L2-normalized item embeddings."""
        emb = self.item_embeddings(item_ids)
        return emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True).clamp(min=1e-6)

    def _check_history(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: int,
    ) -> None:
        """Checks a history (or new events) with at most ``max_seq_len`` events per user."""
        check_int_tensor("item_ids", item_ids)
        check_int_tensor("timestamps", timestamps)
        check_rows("timestamps", timestamps, item_ids.shape[0], "item_ids")
        check_lengths("lengths", lengths, max_seq_len, "max_seq_len", item_ids.shape[0], "item_ids")
        check_item_ids("item_ids", item_ids, self.num_items, self.validate_inputs)

    def embed_features(
        self, item_ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor
    ) -> Dict[str, torch.Tensor]:
        """The transducer's features of a history (unchecked): ``uih.sequence`` [L, E]
        (the ids' embeddings), ``uih.sequence_length`` [B], ``uih_timestamp.sequence`` [L]."""
        return {
            UIH_SEQUENCE: self.item_embeddings(item_ids),
            UIH_LENGTHS: lengths,
            UIH_TIMESTAMPS: timestamps,
        }

    def forward(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: Optional[int] = None,
    ) -> torch.Tensor:
        max_seq_len = check_bound("max_seq_len", max_seq_len, self.max_seq_len)
        self._check_history(item_ids, lengths, timestamps, max_seq_len)
        features = self.embed_features(item_ids, lengths, timestamps)
        out = self.transducer(features, max_seq_len)
        if out.full_embeddings is None:
            raise RuntimeError("the transducer must return full embeddings")
        return out.full_embeddings

    @staticmethod
    def _last_rows(full: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, E] each user's last row of ``full`` (zeros for users without rows)."""
        if full.shape[0] == 0:
            return full.new_zeros(lengths.shape[0], full.shape[1])
        last = (mirror(offsets_from_lengths, lengths)[1:] - 1).clamp(min=0)
        return full[last] * (lengths > 0).unsqueeze(1).to(full.dtype)

    def user_embedding(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: Optional[int] = None,
    ) -> torch.Tensor:
        """[B, E] the embedding after each user's last token (zeros for empty histories)."""
        return self._last_rows(self.forward(item_ids, lengths, timestamps, max_seq_len), lengths)

    def loss(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: Optional[int] = None,
        negatives: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Mean sampled-softmax loss over positions that have a next item
        (:func:`tzrec_gr.losses.sampled_softmax_loss`).

        Args:
            negatives (torch.Tensor | None): [N] negative ids; None draws N uniformly.

        Returns:
            torch.Tensor: scalar.
        """
        user = self.forward(item_ids, lengths, timestamps, max_seq_len)
        if negatives is None:
            negatives = torch.randint(
                0, self.num_items, (self.num_negatives,), device=item_ids.device
            )
        else:
            check_int_tensor("negatives", negatives)
            check_item_ids("negatives", negatives, self.num_items, self.validate_inputs)
        return sampled_softmax_loss(
            user, item_ids, lengths, self.item_embedding, negatives, self.temperature
        )

    # -- serving ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_seq_len: Optional[int] = None,
    ) -> ServingCache:
        """Encode B users' histories once and cache every layer's keys and values.

        Arguments as in ``forward``. ``cache.user_embeddings`` is
        ``user_embedding(item_ids, lengths, timestamps)``.

        Returns:
            ServingCache: for :meth:`extend` and :meth:`score` of this model.
        """
        max_seq_len = check_bound("max_seq_len", max_seq_len, self.max_seq_len)
        self.transducer.check_cache(None)
        self._check_history(item_ids, lengths, timestamps, max_seq_len)
        features = self.embed_features(item_ids, lengths, timestamps)
        out, cache = self.transducer.prefill(features, max_seq_len)
        if out.full_embeddings is None:
            raise RuntimeError("the transducer must return full embeddings")
        users = self._last_rows(out.full_embeddings, lengths)
        return dataclasses.replace(cache, user_embeddings=users)

    @torch.no_grad()
    def extend(
        self,
        cache: ServingCache,
        item_ids: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor,
        update_cache: bool = True,
    ) -> Tuple[torch.Tensor, Optional[ServingCache]]:
        """Append ``lengths[b]`` new events to user b's cached history.

        Exact: the returned rows are the rows of the new events in
        ``forward(history + events)`` and the new cache is ``prefill(history + events)``'s
        (up to rounding), because positions count forward and the layers are causal with a
        fixed attention divisor: no cached token depends on later ones.

        Args:
            cache (ServingCache): from :meth:`prefill` or :meth:`extend` of this model.
            item_ids (torch.Tensor): [L'] the new events' item ids, user-major.
            lengths (torch.Tensor): [B] new events per user (0 allowed); a user's cached and
                new events together stay within ``max_seq_len``.
            timestamps (torch.Tensor): [L'] their timestamps.
            update_cache (bool): return the extended cache; False returns None and leaves
                the cache as it was (a what-if, without copying the cache). Default: True.

        Returns:
            (torch.Tensor [L', E] the user embedding after each new event,
            ServingCache | None).
        """
        self.transducer.check_cache(cache)
        check_batch("lengths", lengths, cache.batch_size, "the cache")
        self._check_history(item_ids, lengths, timestamps, self.max_seq_len)
        check_appended("lengths", cache.lengths, lengths, 1, self.max_seq_len, "max_seq_len")
        tensors = (cache.keys, cache.values, cache.offsets, cache.lengths)
        events = (item_ids, lengths, timestamps)
        bounds = (longest(lengths), cache.max_len)
        if not update_cache:
            return self.event_embeddings_step(*tensors, *events, *bounds), None
        out, keys, values, offsets, new_lengths, users = self.extend_step(
            *tensors, self._user_embeddings(cache), *events, *bounds
        )
        new = self.transducer.cache_from_tensors(
            keys, values, offsets, new_lengths, longest(new_lengths), user_embeddings=users
        )
        return out, new

    def _cache(
        self,
        keys: List[torch.Tensor],
        values: List[torch.Tensor],
        offsets: torch.Tensor,
        lengths: torch.Tensor,
        max_cached_len: Optional[int],
    ) -> ServingCache:
        bound = self.max_cached_len if max_cached_len is None else max_cached_len
        return self.transducer.cache_from_tensors(keys, values, offsets, lengths, bound)

    def event_embeddings_step(
        self,
        keys: List[torch.Tensor],
        values: List[torch.Tensor],
        offsets: torch.Tensor,
        lengths: torch.Tensor,
        item_ids: torch.Tensor,
        new_lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_events: Optional[int] = None,
        max_cached_len: Optional[int] = None,
    ) -> torch.Tensor:
        """``extend(cache, ..., update_cache=False)[0]`` as a function of plain tensors,
        which ``torch.export`` can record: the user embedding after each new event, the
        cache unchanged. Nothing is checked or read on the host.

        Args:
            keys, values (List[torch.Tensor]): each STU layer's cached keys / values
                (``cache.keys``, ``cache.values``).
            offsets (torch.Tensor): [B + 1] ``cache.offsets``.
            lengths (torch.Tensor): [B] ``cache.lengths``.
            item_ids, new_lengths, timestamps: the new events, as ``extend``'s ``item_ids``,
                ``lengths`` and ``timestamps``.
            max_events (int | None): an upper bound on new events per user; each user's
                are padded to it (which changes no output). Default: ``max_seq_len``.
            max_cached_len (int | None): an upper bound on ``lengths``. Default: the
                model's ``max_cached_len``.

        Returns:
            torch.Tensor: [L', E].
        """
        cache = self._cache(keys, values, offsets, lengths, max_cached_len)
        features = self.embed_features(item_ids, new_lengths, timestamps)
        max_new = self.max_seq_len if max_events is None else max_events
        out, _, _ = self.transducer.cached_forward(features, cache, max_new, targets=False)
        return out

    def extend_step(
        self,
        keys: List[torch.Tensor],
        values: List[torch.Tensor],
        offsets: torch.Tensor,
        lengths: torch.Tensor,
        user_embeddings: torch.Tensor,
        item_ids: torch.Tensor,
        new_lengths: torch.Tensor,
        timestamps: torch.Tensor,
        max_events: Optional[int] = None,
        max_cached_len: Optional[int] = None,
    ) -> ExtendStepOutput:
        """:meth:`extend` as a function of plain tensors, which ``torch.export`` can record:
        the cache comes as its tensors and the extended one goes back as new tensors;
        nothing is checked, read on the host or changed in place.

        Args: as for :meth:`event_embeddings_step`, plus ``user_embeddings`` [B, E]
        (``cache.user_embeddings``).

        Returns:
            (rows [L', E] the user embedding after each new event, then the extended cache's
            keys, values, offsets [B + 1], lengths [B] and user embeddings [B, E]).
        """
        before = self.max_cached_len if max_cached_len is None else max_cached_len
        cache = self._cache(keys, values, offsets, lengths, before)
        features = self.embed_features(item_ids, new_lengths, timestamps)
        max_new = self.max_seq_len if max_events is None else max_events
        after = min(before + max_new, self.max_cached_len)
        out, _, new = self.transducer.cached_forward(
            features, cache, max_new, targets=False, update_cache=True, max_cached_len=after
        )
        if new is None:
            raise RuntimeError("the transducer returned no cache with update_cache=True")
        last = self._last_rows(out, new_lengths)
        users = torch.where((new_lengths > 0).unsqueeze(1), last, user_embeddings)
        return out, new.keys, new.values, new.offsets, new.lengths, users

    @staticmethod
    def _user_embeddings(cache: ServingCache) -> torch.Tensor:
        if cache.user_embeddings is None:
            raise ValueError("cache holds no user embeddings: it was not built by HSTURetrieval")
        return cache.user_embeddings

    @torch.no_grad()
    def score(self, cache: ServingCache, candidate_ids: torch.Tensor) -> torch.Tensor:
        """Cosine similarity of each user's embedding with candidate items.

        Equals ``user_embedding(history) @ item_embedding(candidates)`` per user.

        Args:
            cache (ServingCache): from :meth:`prefill` or :meth:`extend` of this model.
            candidate_ids (torch.Tensor): [B, T] candidates per user, or [T] shared by all.

        Returns:
            torch.Tensor: [B, T] in ``[-1, 1]``.
        """
        self.transducer.check_cache(cache)
        if not isinstance(candidate_ids, torch.Tensor) or candidate_ids.dim() not in (1, 2):
            raise ValueError(
                "candidate_ids must be a [B, T] or [T] integer tensor, got "
                f"{getattr(candidate_ids, 'shape', type(candidate_ids).__name__)}"
            )
        check_int_tensor("candidate_ids", candidate_ids, candidate_ids.dim())
        if candidate_ids.dim() == 2:
            check_batch("candidate_ids", candidate_ids, cache.batch_size, "the cache")
        check_item_ids("candidate_ids", candidate_ids, self.num_items, self.validate_inputs)
        return self.score_step(self._user_embeddings(cache), candidate_ids)

    def score_step(
        self, user_embeddings: torch.Tensor, candidate_ids: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`score` as a function of plain tensors (unchecked): [B, T] cosines of
        ``user_embeddings`` [B, E] (``cache.user_embeddings``) with the candidates' item
        embeddings, ``candidate_ids`` [B, T] or [T]."""
        items = self.item_embedding(candidate_ids).to(user_embeddings.dtype)
        if items.dim() == 2:
            return user_embeddings @ items.t()
        return torch.einsum("be,bte->bt", user_embeddings, items)
