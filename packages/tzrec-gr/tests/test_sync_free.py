"""Sync-free steps: a jagged batch's index tensors are read back at most once per batch.

The ops check the values of offsets, lengths and ``num_targets`` on host copies of them
(:mod:`tzrec_ops.jagged`). CPU: a batch's index tensors are each read at most once,
however many layers see them, and not at all when the caller registered their CPU values
(``remember_host_copy``, the CPU analogue of ``to_device``); the index tensors the modules
derive (cache offsets, truncation plans, the preprocessors' offsets) get copies without a
read. GPU (``-m gpu``): a second training step and a second cached serving step run under
``torch.cuda.set_sync_debug_mode("error")``, so any device-to-host sync in them raises.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest
import torch

from tzrec_gr import (
    ContextualInterleavePreprocessor,
    HSTUPositionalEncoder,
    HSTUTransducer,
    SimpleActionEncoder,
    SimpleContextualizedMLP,
    SliceContentEncoder,
    STULayer,
    STUStack,
)
from tzrec_gr.serving import RankingServer, RetrievalServer
from tzrec_ops.jagged import known_host_copy, offsets_from_lengths, remember_host_copy, to_device
from tzrec_ops.ops import host_copies, validation

E, H, D = 16, 2, 8
PT = "pytorch"

Batch = Tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> List[torch.Tensor]:
    """The tensors whose values were read to make a host copy, in order.

    These are the ``_snapshot`` calls made by ``host_copy``. ``remember_host_copy`` (and so
    ``to_device`` and ``mirror``) copies through ``_snapshot`` too, but it copies values the
    host already holds: that is no read, so it is not counted.
    """
    seen: List[torch.Tensor] = []
    snapshot = host_copies._snapshot

    def counting(values: torch.Tensor) -> torch.Tensor:
        if sys._getframe(1).f_code.co_name == "host_copy":
            seen.append(values)
        return snapshot(values)

    monkeypatch.setattr(host_copies, "_snapshot", counting)
    return seen


@pytest.fixture
def check_runs(monkeypatch: pytest.MonkeyPatch) -> List[object]:
    """The keys of the value checks that ran: ``validation.check_once`` calls (those of
    ``check_jagged`` among them) that were not skipped because the same tensors had passed
    them already."""
    runs: List[object] = []
    check_once = validation.check_once

    def counting(key, tensors, check) -> None:
        def counted(*values):
            runs.append(key)
            return check(*values)

        check_once(key, tensors, counted)

    monkeypatch.setattr(validation, "check_once", counting)
    return runs


def _stack(layers: int, **kw) -> STUStack:
    kw.setdefault("backend", PT)
    return STUStack([STULayer(E, H, D, D, scaling_seqlen=64, **kw) for _ in range(layers)])


def _known(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its CPU values registered as its host copy."""
    return remember_host_copy(t, t.cpu())


def _batch(
    lengths: Sequence[int],
    targets: Sequence[int],
    known: bool,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    width: int = E,
) -> Batch:
    """``(x, x_offsets, max_seq_len, num_targets)``, the index tensors built on the CPU.

    ``known``: their CPU values are registered as their host copies. On a GPU they are
    always moved with ``to_device``, which registers them.
    """
    offsets = offsets_from_lengths(torch.tensor(lengths))
    num_targets = torch.tensor(targets)
    if device != "cpu":
        offsets, num_targets = to_device(offsets, device), to_device(num_targets, device)
    elif known:
        offsets, num_targets = _known(offsets), _known(num_targets)
    x = torch.randn(sum(lengths), width, device=device, dtype=dtype)
    return x, offsets, max(lengths), num_targets


def _train_step(
    stack: STUStack, batch: Batch, optimizer: Optional[torch.optim.Optimizer] = None, **kw
) -> torch.Tensor:
    x, offsets, max_len, targets = batch
    out = stack(x.requires_grad_(), offsets, max_len, targets, **kw)
    out.x.float().square().mean().backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out.x_offsets


def _only_inputs_once(reads: List[torch.Tensor], *inputs: torch.Tensor) -> None:
    """Every read was of one of ``inputs``, and none was read twice."""
    assert all(any(r is t for t in inputs) for r in reads), "a derived tensor was read"
    assert len({id(r) for r in reads}) == len(reads), "a tensor was read twice"


LENGTHS, TARGETS = [7, 3, 12, 5], [2, 1, 3, 0]


def test_checks_run_once_per_batch_whatever_the_depth(reads, check_runs):
    """A 3-layer training step reads and checks no more than a 1-layer one."""
    seen = {}
    for layers in (1, 3):
        reads.clear()
        check_runs.clear()
        batch = _batch(LENGTHS, TARGETS, known=False)
        _train_step(_stack(layers).train(), batch)
        _only_inputs_once(reads, batch[1], batch[3])
        seen[layers] = (len(reads), len(check_runs))
    assert seen[3] == seen[1]


def test_training_step_with_known_copies_reads_nothing(reads):
    _train_step(_stack(3).train(), _batch(LENGTHS, TARGETS, known=True))
    assert reads == []


@pytest.mark.parametrize("known", [False, True])
def test_prefill_takes_the_cache_total_from_the_host_copy(reads, known):
    """total_kv_caching_len=None: the sum comes from the lengths' host copy (read once for
    the whole stack, or not at all when known); the caches match a given total's."""
    stack = _stack(3).eval()
    x, offsets, max_len, targets = _batch(LENGTHS, TARGETS, known)
    cache_lengths = torch.tensor(LENGTHS) - 3
    if known:
        _known(cache_lengths)
    with torch.inference_mode():
        caches = stack(x, offsets, max_len, targets, kv_caching_lengths=cache_lengths).kv_caches
        if known:
            assert reads == []
        _only_inputs_once(reads, offsets, targets, cache_lengths)
        given = stack(
            x,
            offsets,
            max_len,
            targets,
            kv_caching_lengths=cache_lengths,
            total_kv_caching_len=int(cache_lengths.sum()),
        ).kv_caches
    assert all(known_host_copy(c.offsets) is not None for c in caches)
    for cache, expected in zip(caches, given):
        assert torch.equal(cache.offsets, expected.offsets)
        assert torch.equal(cache.k, expected.k) and torch.equal(cache.v, expected.v)


def _prefilled(stack: STUStack, delta: int):
    """Caches of all but the last ``delta`` tokens of a known batch."""
    x, offsets, max_len, targets = _batch(LENGTHS, TARGETS, known=True)
    cache_lengths = _known(torch.tensor(LENGTHS) - delta)
    return stack(
        x,
        offsets,
        max_len,
        targets,
        kv_caching_lengths=cache_lengths,
        max_kv_caching_len=max_len - delta,
    ).kv_caches


@pytest.mark.parametrize("update_cache", [True, False])
def test_cached_serving_step_reads_nothing(reads, update_cache):
    stack = _stack(3).eval()
    batch, delta = len(LENGTHS), 3
    with torch.inference_mode():
        caches = _prefilled(stack, delta)
        reads.clear()
        delta_x = torch.randn(batch * delta, E)
        targets = _known(torch.tensor([1, 3, 0, 2]))
        _, new = stack.cached_forward(delta_x, caches, targets, update_cache=update_cache)
        assert reads == []
        if update_cache:
            assert all(known_host_copy(c.offsets) is not None for c in new)
            # the next decoding step, on the extended caches, and one that trims them
            stack.cached_forward(delta_x, new, targets)
            trim = _known(torch.tensor(LENGTHS) + delta - 1)
            stack.cached_forward(delta_x, new, targets, kv_caching_lengths=trim)
            assert reads == []


def _truncating_stack() -> STUStack:
    layers = [STULayer(E, H, D, D, contextual_seq_len=2, backend=PT) for _ in range(3)]
    return STUStack(layers, truncate_split_layer=1, truncate_tail_len=2).train()


# LENGTHS with C = 2, TARGETS and a tail of 2: every sample keeps at most 2 + 2 + T_b rows
KEPT = sum(min(n, 4 + t) for n, t in zip(LENGTHS, TARGETS))


def test_truncation_with_given_total_reads_nothing(reads):
    new_offsets = _train_step(
        _truncating_stack(), _batch(LENGTHS, TARGETS, known=True), truncated_total_len=KEPT
    )
    assert reads == []
    assert known_host_copy(new_offsets) is not None
    assert int(new_offsets[-1]) == KEPT


@pytest.mark.parametrize("known", [False, True])
def test_wrong_truncated_total_len_is_rejected(known):
    batch = _batch(LENGTHS, TARGETS, known)
    with pytest.raises(ValueError, match=rf"truncated_total_len \({KEPT - 1}\) must equal"):
        _train_step(_truncating_stack(), batch, truncated_total_len=KEPT - 1)


def _transducer(interleave: bool, truncate: bool) -> HSTUTransducer:
    actions = SimpleActionEncoder(2, [1, 2], backend=PT)
    pre = ContextualInterleavePreprocessor(
        4,
        4,
        E,
        SliceContentEncoder(4, 4, backend=PT),
        SimpleContextualizedMLP(4, E, 8, backend=PT),
        action_encoder=actions,
        action_mlp=SimpleContextualizedMLP(actions.output_dim, E, 8, backend=PT),
        contextual_feature_dim=3,
        max_contextual_seq_len=2,
        enable_interleaving=interleave,
        backend=PT,
    )
    layers = [STULayer(E, H, D, D, contextual_seq_len=2, backend=PT) for _ in range(2)]
    stack = STUStack(layers, 1, 2) if truncate else STUStack(layers)
    encoder = HSTUPositionalEncoder(
        E, 64, 8, use_time_encoding=True, contextual_seq_len=2, backend=PT
    )
    return HSTUTransducer(pre, stack, positional_encoder=encoder, backend=PT)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("truncate", [False, True])
def test_transducer_step_with_known_lengths_reads_nothing(reads, interleave, truncate):
    """Every index tensor the preprocessor, the stack and the output split derive from the
    features' known lengths has a host copy (truncation planned from them, too)."""
    uih, cand = torch.tensor([2, 3]), torch.tensor([1, 2])
    features = {
        "uih.sequence": torch.randn(5, 4),
        "uih.sequence_length": _known(uih),
        "uih_timestamp.sequence": torch.tensor([10, 20, 30, 40, 50]),
        "uih_action.sequence": torch.tensor([1, 2, 3, 0, 1]),
        "candidate.sequence": torch.randn(3, 4),
        "candidate.sequence_length": _known(cand),
        "candidate_timestamp.sequence": torch.tensor([25, 60, 61]),
        "contextual": torch.randn(2, 6),
    }
    model = _transducer(interleave, truncate).train()
    model(features, 3, 2).candidate_embeddings.sum().backward()
    assert reads == []


def _model_inputs(device: str, known: bool):
    """A retrieval batch of two users and a ranking batch, lengths with known host copies
    (``to_device`` off the CPU, ``remember_host_copy`` on it)."""
    from _models import history_user, ranking_batch, ranking_user, retrieval_batch

    def move(t: torch.Tensor) -> torch.Tensor:
        if device != "cpu":
            return to_device(t, device)
        return _known(t) if known else t

    ids, lengths, ts = retrieval_batch([history_user(5), history_user(3)])
    retrieval = (ids.to(device), move(lengths), ts.to(device))
    ranking = ranking_batch([ranking_user(4, 2), ranking_user(2, 3)])
    ranking = {
        k: move(v) if k.endswith("sequence_length") else v.to(device) for k, v in ranking.items()
    }
    return retrieval, ranking


def _serving_step(retrieval_model, ranking_model, retrieval, ranking):
    """Prefill, then one retrieval extend and one ranking score; returns the steady step."""
    ids, lengths, ts = retrieval
    retrieval_server = RetrievalServer(retrieval_model)
    ranking_server = RankingServer(ranking_model)
    cache = retrieval_server.prefill(ids, lengths, ts)
    history = {k: v for k, v in ranking.items() if not k.startswith("candidate")}
    candidates = {k: v for k, v in ranking.items() if k.startswith("candidate")}
    ranking_cache = ranking_server.prefill(history, history.pop("query_time"))

    def step():
        retrieval_server.extend(cache, ids, lengths, ts)
        ranking_server.score(ranking_cache, candidates)

    return step


def test_model_steps_with_known_lengths_read_nothing(reads):
    """Training forwards and serving steps of both models: the models' own length checks
    and everything they derive use the host copies."""
    from _models import ranking_model, retrieval_model

    retrieval, ranking = _model_inputs("cpu", known=True)
    retrieval_m, ranking_m = retrieval_model().train(), ranking_model().train()
    retrieval_m.loss(*retrieval).backward()
    ranking_m(ranking).sum().backward()
    step = _serving_step(retrieval_m.eval(), ranking_m.eval(), retrieval, ranking)
    step()
    assert reads == []


# -- GPU: no device-to-host sync in a steady-state step ---------------------------------


def _cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@contextlib.contextmanager
def _no_syncs() -> Iterator[None]:
    """Any device-to-host sync inside raises a RuntimeError naming the synchronizing call
    (its traceback shows who made it)."""
    torch.cuda.synchronize()  # the warm-up's work is done before the checked step starts
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _gpu_lengths(batch: int, low: int, high: int) -> List[int]:
    return torch.randint(low, high, (batch,)).tolist()


@pytest.mark.gpu
def test_training_step_is_sync_free_gpu():
    """A 3-layer stack on the default backend (triton on a GPU), bf16 activations: the
    second training step (forward, backward, optimizer step) on a new batch, whose offsets
    and num_targets came with to_device, makes no device-to-host sync.

    The warm-up step autotunes the kernels (which syncs); the second batch has new values
    but the same sizes (B, total tokens, max length), so it hits the tuned configs.
    """
    _cuda_or_skip()
    torch.manual_seed(0)
    width = 128
    stack = STUStack([STULayer(width, 4, 32, 32, device="cuda") for _ in range(3)]).train()
    optimizer = torch.optim.SGD(stack.parameters(), lr=1e-3)
    lengths = _gpu_lengths(32, 64, 256)
    targets = [n // 8 for n in lengths]
    kw = {"device": "cuda", "dtype": torch.bfloat16, "width": width}
    _train_step(stack, _batch(lengths, targets, True, **kw), optimizer)
    # built (and moved) before the checked step: same sizes, reversed order
    second = _batch(lengths[::-1], targets[::-1], True, **kw)
    with _no_syncs():
        _train_step(stack, second, optimizer)


@pytest.mark.gpu
@pytest.mark.parametrize("update_cache", [True, False])
def test_cached_serving_step_is_sync_free_gpu(update_cache):
    """Prefill (total_kv_caching_len from the lengths' host copy), one warm-up cached step,
    then a second cached step with new tokens and num_targets (moved with to_device) under
    sync debug mode "error", on the default backend in bf16."""
    _cuda_or_skip()
    torch.manual_seed(0)
    width, delta, b = 128, 4, 16
    layers = [STULayer(width, 4, 32, 32, scaling_seqlen=1024, device="cuda") for _ in range(3)]
    stack = STUStack(layers).eval()
    cache_lengths = torch.tensor(_gpu_lengths(b, 200, 400))
    lengths = (cache_lengths + delta).tolist()
    targets = torch.randint(1, delta + 1, (b,))
    kw = {"device": "cuda", "dtype": torch.bfloat16, "width": width}
    with torch.inference_mode():
        x, offsets, max_len, num_targets = _batch(lengths, targets.tolist(), True, **kw)
        caches = stack(
            x,
            offsets,
            max_len,
            num_targets,
            kv_caching_lengths=to_device(cache_lengths, "cuda"),
            max_kv_caching_len=max_len - delta,
        ).kv_caches

        def step(new_targets: torch.Tensor):
            delta_x = torch.randn(b * delta, width, device="cuda", dtype=torch.bfloat16)
            return stack.cached_forward(delta_x, caches, new_targets, update_cache=update_cache)

        step(num_targets)
        second = to_device(targets.flip(0), "cuda")  # moved before the checked step
        with _no_syncs():
            _, new = step(second)
    assert (new is None) == (not update_cache)


@pytest.mark.gpu
def test_model_serving_steps_are_sync_free_gpu():
    """A retrieval extend and a ranking score (triton, lengths moved with to_device) make no
    device-to-host sync once warmed up."""
    _cuda_or_skip()
    from _models import ranking_model, retrieval_model

    retrieval, ranking = _model_inputs("cuda", known=True)
    step = _serving_step(
        retrieval_model("triton", "cuda"), ranking_model("triton", "cuda"), retrieval, ranking
    )
    step()
    with _no_syncs():
        step()
