"""Content encoders: put history and candidate item embeddings into one jagged sequence.

Legend: B = batch, L_u / L_t = total history / candidate tokens, Du / Dt = their widths.
Every encoder returns the per-sample concatenation ``[history_b ; candidates_b]``,
``[L_u + L_t, output_dim]``.
"""

from __future__ import annotations

import abc
from typing import Optional

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_gr.layers import MLP
from tzrec_ops import concat_2D_jagged

__all__ = ["ContentEncoder", "SliceContentEncoder", "PadContentEncoder", "MLPContentEncoder"]


class ContentEncoder(nn.Module, abc.ABC):
    """Interface of a content encoder.

    Call Args:
        uih_embeddings (torch.Tensor): [L_u, Du] history item embeddings.
        target_embeddings (torch.Tensor): [L_t, Dt] candidate item embeddings.
        max_uih_len (int): upper bound on history lengths.
        max_targets (int): upper bound on candidate counts.
        uih_offsets (torch.Tensor): [B + 1] history offsets.
        target_offsets (torch.Tensor): [B + 1] candidate offsets.

    Returns:
        torch.Tensor: [L_u + L_t, output_dim].
    """

    output_dim: int

    def __init__(self, backend: BackendArg = None) -> None:
        super().__init__()
        self._concat_backend = resolve_module_backend(backend, ("concat_2D_jagged",))

    def _concat(
        self,
        uih: torch.Tensor,
        target: torch.Tensor,
        max_uih_len: int,
        max_targets: int,
        uih_offsets: torch.Tensor,
        target_offsets: torch.Tensor,
    ) -> torch.Tensor:
        return concat_2D_jagged(
            values_left=uih,
            values_right=target.to(uih.dtype),
            max_len_left=max_uih_len,
            max_len_right=max_targets,
            offsets_left=uih_offsets,
            offsets_right=target_offsets,
            backend=self._concat_backend,
        )

    @abc.abstractmethod
    def forward(
        self,
        uih_embeddings: torch.Tensor,
        target_embeddings: torch.Tensor,
        max_uih_len: int,
        max_targets: int,
        uih_offsets: torch.Tensor,
        target_offsets: torch.Tensor,
    ) -> torch.Tensor: ...


def _check_width(name: str, x: torch.Tensor, dim: int) -> None:
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"{name} must be [rows, {dim}], got {tuple(x.shape)}")


class SliceContentEncoder(ContentEncoder):
    """Candidates keep their first ``Du`` features, so both sides are ``Du`` wide.

    Args:
        uih_embedding_dim (int): Du.
        target_embedding_dim (int): Dt, must be >= Du.
        backend (str | Backend | None): ops backend. Default: None.

    ``output_dim`` = Du.
    """

    def __init__(
        self, uih_embedding_dim: int, target_embedding_dim: int, backend: BackendArg = None
    ) -> None:
        super().__init__(backend)
        if target_embedding_dim < uih_embedding_dim:
            raise ValueError(
                f"target_embedding_dim ({target_embedding_dim}) must be >= "
                f"uih_embedding_dim ({uih_embedding_dim}) to slice candidates"
            )
        self.uih_embedding_dim = uih_embedding_dim
        self.target_embedding_dim = target_embedding_dim
        self.output_dim = uih_embedding_dim

    def forward(
        self,
        uih_embeddings,
        target_embeddings,
        max_uih_len,
        max_targets,
        uih_offsets,
        target_offsets,
    ):
        _check_width("uih_embeddings", uih_embeddings, self.uih_embedding_dim)
        _check_width("target_embeddings", target_embeddings, self.target_embedding_dim)
        return self._concat(
            uih_embeddings,
            target_embeddings[:, : self.uih_embedding_dim],
            max_uih_len,
            max_targets,
            uih_offsets,
            target_offsets,
        )


class PadContentEncoder(ContentEncoder):
    """History rows are padded to ``Dt`` with one learned vector (init N(0, 0.1)).

    Args:
        uih_embedding_dim (int): Du.
        target_embedding_dim (int): Dt, must be > Du.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.

    ``output_dim`` = Dt.
    """

    def __init__(
        self,
        uih_embedding_dim: int,
        target_embedding_dim: int,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(backend)
        if target_embedding_dim <= uih_embedding_dim:
            raise ValueError(
                f"target_embedding_dim ({target_embedding_dim}) must be > "
                f"uih_embedding_dim ({uih_embedding_dim}) to pad history rows"
            )
        self.uih_embedding_dim = uih_embedding_dim
        self.target_embedding_dim = target_embedding_dim
        self.output_dim = target_embedding_dim
        self.pad = nn.Parameter(
            torch.randn(1, target_embedding_dim - uih_embedding_dim, device=device) * 0.1
        )

    def forward(
        self,
        uih_embeddings,
        target_embeddings,
        max_uih_len,
        max_targets,
        uih_offsets,
        target_offsets,
    ):
        _check_width("uih_embeddings", uih_embeddings, self.uih_embedding_dim)
        _check_width("target_embeddings", target_embeddings, self.target_embedding_dim)
        pad = self.pad.to(uih_embeddings.dtype).expand(uih_embeddings.shape[0], -1)
        padded = torch.cat([uih_embeddings, pad], dim=1)
        return self._concat(
            padded, target_embeddings, max_uih_len, max_targets, uih_offsets, target_offsets
        )


class MLPContentEncoder(ContentEncoder):
    """History and candidates go through their own MLPs with equal output widths.

    Args:
        uih_mlp (MLP): Du -> D.
        target_mlp (MLP): Dt -> D.
        backend (str | Backend | None): ops backend for the concat. Default: None.

    ``output_dim`` = D.
    """

    def __init__(self, uih_mlp: MLP, target_mlp: MLP, backend: BackendArg = None) -> None:
        super().__init__(backend)
        if uih_mlp.output_dim != target_mlp.output_dim:
            raise ValueError(
                f"uih_mlp.output_dim ({uih_mlp.output_dim}) must equal "
                f"target_mlp.output_dim ({target_mlp.output_dim})"
            )
        self.uih_mlp = uih_mlp
        self.target_mlp = target_mlp
        self.output_dim = uih_mlp.output_dim

    def forward(
        self,
        uih_embeddings,
        target_embeddings,
        max_uih_len,
        max_targets,
        uih_offsets,
        target_offsets,
    ):
        return self._concat(
            self.uih_mlp(uih_embeddings),
            self.target_mlp(target_embeddings),
            max_uih_len,
            max_targets,
            uih_offsets,
            target_offsets,
        )
