"""The model a load test serves: a registered model with a server
(:mod:`tzrec_gr.models.registry`, :func:`tzrec_gr.serving.server.server_for`), built with
random weights at the command's sizes, and what the load test needs to know of it, asked of
its server rather than of its name or class."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import types
from typing import List

import torch
from torch import nn

from tzrec_gr.models.registry import TASKS, get_model, model_names
from tzrec_gr.serving import ModelServer
from tzrec_gr.serving.server import servable_models, server_for

__all__ = [
    "DTYPES",
    "TASK_BITS",
    "Served",
    "build_model",
    "model_choices",
    "weights_digest",
    "probe",
    "resolve_model",
    "served_names",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: the label bit of each task of a model with a head per task (two tasks, as the serving
#: benchmark's model); a model of one head ignores them
TASK_BITS = [1, 2]


def served_names() -> List[str]:
    """The registered models that have a server and that the load test can build (from a
    trainer's sizes), in the registry's order."""
    served = set(servable_models())
    return [
        name for name in model_names()
        if get_model(name).model_class.__name__ in served
        and get_model(name).trainer_kwargs is not None
    ]


def model_choices() -> List[str]:
    """What ``--model`` accepts: a served model's name, or a task (its first served model)."""
    names = served_names()
    return names + [task for task in TASKS if set(model_names(task)) & set(names)]


def resolve_model(choice: str) -> str:
    """The registered name of ``choice``: a served model's name, or a task's first served
    model (``retrieval`` and ``ranking``, the spellings of the load test before models had
    names).

    Raises:
        ValueError: ``choice`` is neither (the message lists what is).
    """
    names = served_names()
    if choice in names:
        return choice
    if choice in TASKS:
        of_task = [name for name in model_names(choice) if name in names]
        if of_task:
            return of_task[0]
    raise ValueError(f"--model must be one of {', '.join(model_choices())}, got {choice!r}")


@dataclasses.dataclass(frozen=True)
class Served:
    """What the load test needs to know of the model it serves, from its server and the
    server's predictions (:meth:`ModelServer.predict_limits`).

    Attributes:
        name: the model's registered name.
        model_class: its class's name (the header's).
        call: the session call that answers a scoring request (``recommend``, ``score``).
        request_size: that call's size, a ``ServingSession.warm_up`` argument and the
            option giving it (``k``, ``candidates``).
        takes_k: a scoring request asks for the top ``--k`` items of the catalogue.
        candidates: a scoring request carries ``--candidates`` candidates.
        actions: the model reads the histories' action bitmasks.
        time_encoded: the model encodes the events' times.
    """

    name: str
    model_class: str
    call: str
    request_size: str
    takes_k: bool
    candidates: bool
    actions: bool
    time_encoded: bool

    @classmethod
    def of(cls, name: str, server: ModelServer) -> "Served":
        """The facts of the model registered as ``name``, served by ``server``."""
        predicts = server.predict_limits().predicts
        return cls(
            name=name,
            model_class=type(server.model).__name__,
            call=server.call,
            request_size=server.request_size,
            takes_k=predicts.takes_k,
            candidates="candidates" in predicts.columns,
            actions=server.needs_actions,
            time_encoded=server.time_encoded,
        )


def _construct(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """``args.model_name``'s model at the command's sizes, as its trainer builds it."""
    record = get_model(args.model_name)
    assert record.trainer_kwargs is not None  # resolve_model takes no other
    settings = types.SimpleNamespace(
        embedding_dim=args.dim, max_seq_len=args.max_history, num_heads=args.heads,
        num_layers=args.layers, dropout=0.0, num_negatives=128, temperature=0.05,
        num_candidates=args.candidates, backend=args.backend,
    )
    kwargs = record.trainer_kwargs(settings, args.items, TASK_BITS)
    # --no-time-encoding turns off a model's time encoding, where its constructor has one
    if args.no_time_encoding and record.takes("use_time_encoding"):
        kwargs["use_time_encoding"] = False
    return record.model_class(**kwargs, device=device)


def build_model(args: argparse.Namespace) -> nn.Module:
    """The model of ``args`` with random weights (seeded), in eval mode and ``args.dtype``."""
    torch.manual_seed(args.seed)
    return _construct(args, args.device).eval().to(DTYPES[args.dtype])


def probe(args: argparse.Namespace) -> Served:
    """The facts of ``args``' model, asked of the server of a copy on the meta device (no
    memory and no weights: the facts are known before the model is built)."""
    return Served.of(args.model_name, server_for(_construct(args, torch.device("meta"))))


def weights_digest(model: nn.Module) -> str:
    """A BLAKE2 digest of the model's parameters and buffers (names, dtypes and bytes):
    the load test and the service it starts build the same seeded model, and say so."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
