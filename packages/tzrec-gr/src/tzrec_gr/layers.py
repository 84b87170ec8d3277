"""Small building blocks over tzrec_ops: linear, layer norm, swish layer norm, MLP.

Each module resolves its ops backend once in ``__init__`` and passes it to every op call.
Inputs are 2-D ``[N, D]`` (jagged values or dense rows).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from tzrec_gr._backend import BackendArg, resolve_module_backend
from tzrec_ops import addmm, layer_norm, swish_layer_norm

__all__ = ["Linear", "LayerNorm", "SwishLayerNorm", "MLP"]


def _check_dim(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_input(module: str, x: torch.Tensor, dim: int) -> None:
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"{module} input must be [N, {dim}], got {tuple(x.shape)}")


class Linear(nn.Module):
    """``y = x @ W + b`` through the ``addmm`` op; the weight is stored ``[in, out]``.

    Args:
        in_features (int): input width.
        out_features (int): output width.
        backend (str | Backend | None): ops backend. Default: None (best available).
        device (torch.device | None): parameter device. Default: None.

    Call Args:
        x (torch.Tensor): [N, in_features].

    Returns:
        torch.Tensor: [N, out_features] in x's dtype (parameters are cast to it).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        _check_dim("in_features", in_features)
        _check_dim("out_features", out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device))
        self._backend = resolve_module_backend(backend, ("addmm",))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weight, zero bias."""
        if self.weight.device.type != "meta":
            nn.init.xavier_uniform_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input("Linear", x, self.in_features)
        return addmm(self.bias.to(x.dtype), x, self.weight.to(x.dtype), backend=self._backend)


class LayerNorm(nn.Module):
    """Layer norm over the last dim with a learned scale and shift.

    Args:
        dim (int): normalized width D.
        eps (float): variance epsilon. Default: 1e-5.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.

    Call Args:
        x (torch.Tensor): [N, D].

    Returns:
        torch.Tensor: [N, D] in x's dtype.
    """

    # the tzrec-ops op this norm calls (a subclass names another of the same signature)
    op_name = "layer_norm"
    _op = staticmethod(layer_norm)

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        _check_dim("dim", dim)
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.bias = nn.Parameter(torch.zeros(dim, device=device))
        self._backend = resolve_module_backend(backend, (self.op_name,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(type(self).__name__, x, self.dim)
        return self._op(
            x, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps, backend=self._backend
        )


class SwishLayerNorm(LayerNorm):
    """``y = x * sigmoid(LayerNorm(x))`` (arguments, parameters and shapes as
    :class:`LayerNorm`)."""

    op_name = "swish_layer_norm"
    _op = staticmethod(swish_layer_norm)


class MLP(nn.Module):
    """A stack of ``Linear -> activation`` layers (the last layer has no activation if
    ``final_activation`` is False).

    Args:
        in_features (int): input width.
        hidden_dims (Sequence[int]): output width of each layer; the last one is the output.
        activation (str): ``"silu"``, ``"relu"`` or ``"swish_layernorm"``. Default: "silu".
        final_activation (bool): apply the activation after the last layer. Default: True.
        backend (str | Backend | None): ops backend. Default: None.
        device (torch.device | None): parameter device. Default: None.

    Call Args:
        x (torch.Tensor): [N, in_features].

    Returns:
        torch.Tensor: [N, hidden_dims[-1]].
    """

    _ACTIVATIONS = ("silu", "relu", "swish_layernorm")

    def __init__(
        self,
        in_features: int,
        hidden_dims: Sequence[int],
        activation: str = "silu",
        final_activation: bool = True,
        backend: BackendArg = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if len(hidden_dims) == 0:
            raise ValueError("hidden_dims must name at least one layer width, got []")
        if activation not in self._ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(self._ACTIVATIONS)}, got {activation!r}"
            )
        dims: List[int] = [in_features, *hidden_dims]
        layers: List[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(Linear(d_in, d_out, backend=backend, device=device))
            if final_activation or i < len(hidden_dims) - 1:
                if activation == "silu":
                    layers.append(nn.SiLU())
                elif activation == "relu":
                    layers.append(nn.ReLU())
                else:
                    layers.append(SwishLayerNorm(d_out, backend=backend, device=device))
        self.layers = nn.Sequential(*layers)
        self.in_features = in_features
        self.output_dim = dims[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
