"""Tiny tzrec-gr models (pytorch backend) and their configs, for the tests."""

from __future__ import annotations

from typing import Any, Dict

import torch

from tzrec_gr.models import HSTURanking, HSTURetrieval

RANKING: Dict[str, Any] = {
    "num_items": 40,
    "item_embedding_dim": 8,
    "embedding_dim": 16,
    "task_bitmasks": [1, 2],
    "action_weights": [1, 2, 4],
    "contextual_feature_dim": 3,
    "max_contextual_seq_len": 2,
    "dropout_ratio": 0.0,
    "max_uih_len": 10,
    "max_targets": 4,
    "backend": "pytorch",
}
RETRIEVAL: Dict[str, Any] = {
    "num_items": 40,
    "embedding_dim": 16,
    "num_layers": 2,
    "dropout_ratio": 0.0,
    "max_seq_len": 12,
    "backend": "pytorch",
}


def ranking(**overrides: Any) -> HSTURanking:
    torch.manual_seed(0)
    return HSTURanking(**{**RANKING, **overrides}).eval()


def retrieval(**overrides: Any) -> HSTURetrieval:
    torch.manual_seed(0)
    return HSTURetrieval(**{**RETRIEVAL, **overrides}).eval()
