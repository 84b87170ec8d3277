"""Id embedding tables behind one interface: plain ``nn.Embedding`` or torchrec.

tzrec-gr's models hold their id tables (the item table) as an :class:`EmbeddingTable`, made
by :func:`embedding_table` from the models' ``embedding_tables`` argument:

* ``"plain"`` (the default): a ``torch.nn.Embedding`` itself, not a subclass, so a model's
  state dict, ``torch.fx`` graph (``nn.Embedding`` is a leaf module), export and tzrec-acc's
  table passes (quantization, sparse/dense split) are what they were. No torchrec needed.
* ``"torchrec"``: a :class:`TorchrecEmbeddingTable`, a torchrec ``EmbeddingCollection`` of one
  table fed a ``KeyedJaggedTensor``, which torchrec's ``DistributedModelParallel`` can shard.
  Needs ``pip install 'tzrec-gr[torchrec]'``; torchrec is imported only when one is built.

Both give the same rows and gradients for the same weights. A caller that builds its tables
itself (a trainer that builds a torchrec table on the ``meta`` device for
``DistributedModelParallel`` to materialize shard by shard) passes a :data:`TableFactory`
instead of a name, and :func:`init_rows_` initializes any shard of a table to the values the
whole table would have. Legend: N = rows, D = width.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Protocol, Union, runtime_checkable

import torch
from torch import nn

from tzrec_ops.extras import require

__all__ = [
    "EMBEDDING_TABLE_KINDS",
    "EmbeddingTable",
    "TableFactory",
    "TorchrecEmbeddingTable",
    "embedding_table",
    "init_rows_",
    "to_plain_state_dict",
]

EMBEDDING_TABLE_KINDS = ("plain", "torchrec")


INIT_BLOCK_ROWS = 65536
# a TorchrecEmbeddingTable's weight in a state dict, and the plain table's key it stands for
_TORCHREC_WEIGHT = re.compile(r"^(?P<table>(?:.*\.)?)collection\.embeddings\.[^.]+\.weight$")


@runtime_checkable
class EmbeddingTable(Protocol):
    """What a model needs of an id table; ``nn.Embedding`` is one.

    Attributes:
        num_embeddings (int): N; ids are in ``[0, N)``.
        embedding_dim (int): D.
        weight (torch.Tensor): [N, D] the whole table (the parameter itself).

    Call Args:
        ids (torch.Tensor): integer ids of any shape (e.g. jagged values [L]).

    Returns:
        torch.Tensor: ``[*ids.shape, D]`` the ids' rows (in the table's dtype for
        ``nn.Embedding``, float32 for :class:`TorchrecEmbeddingTable`).
    """

    num_embeddings: int
    embedding_dim: int

    @property
    def weight(self) -> torch.Tensor: ...

    def __call__(self, ids: torch.Tensor) -> torch.Tensor: ...


class TorchrecEmbeddingTable(nn.Module):
    """One table in a torchrec ``EmbeddingCollection``, looked up through a
    ``KeyedJaggedTensor``.

    Each call flattens ``ids`` into one bag of one feature, so every process of a sharded
    model feeds a KeyedJaggedTensor of the same stride (1) whatever its number of ids. The
    collection is the child ``collection`` (its state dict key is
    ``collection.embeddings.<name>.weight``), the module ``DistributedModelParallel``
    replaces with its sharded form; :attr:`weight` is the unsharded table only. A state
    dict of a plain table (key ``weight``) loads into this one.

    Args:
        num_embeddings (int): N.
        embedding_dim (int): D.
        name (str): the table's name; its feature is ``f"{name}_id"``. Default: ``"item"``.
        device (torch.device | None): the table's device (``meta`` to build it for
            sharding). Default: None.

    Call Args:
        ids (torch.Tensor): integer ids of any shape.

    Returns:
        torch.Tensor: ``[*ids.shape, D]`` rows in float32 (torchrec's collection returns
        float32 whatever the table's dtype; equal to a plain table's rows for a float32 one).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        name: str = "item",
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        torchrec = require("torchrec", "tzrec-gr[torchrec]", "embedding_tables='torchrec'")
        self._keyed_jagged_tensor = torchrec.KeyedJaggedTensor
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.name = name
        self.feature = f"{name}_id"
        config = torchrec.EmbeddingConfig(
            name=name,
            embedding_dim=embedding_dim,
            num_embeddings=num_embeddings,
            feature_names=[self.feature],
        )
        self.collection = torchrec.EmbeddingCollection(tables=[config], device=device)
        self.register_load_state_dict_pre_hook(self._from_plain)

    @property
    def weight(self) -> torch.Tensor:
        """[N, D] the unsharded table (the collection's parameter)."""
        return self.collection.embeddings[self.name].weight

    def _from_plain(
        self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any
    ) -> None:
        """Renames a plain table's ``weight`` key to the collection's."""
        if prefix + "weight" in state_dict:
            key = f"{prefix}collection.embeddings.{self.name}.weight"
            state_dict[key] = state_dict.pop(prefix + "weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        values = ids.reshape(-1)
        lengths = torch.full((1,), values.shape[0], dtype=torch.int32, device=ids.device)
        features = self._keyed_jagged_tensor(keys=[self.feature], values=values, lengths=lengths)
        rows = self.collection(features)[self.feature].values()
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, name={self.name!r}"


#: ``factory(num_embeddings, embedding_dim, *, name, device) -> EmbeddingTable``
TableFactory = Callable[..., EmbeddingTable]


def embedding_table(
    kind: Union[str, TableFactory],
    num_embeddings: int,
    embedding_dim: int,
    *,
    name: str = "item",
    device: Optional[torch.device] = None,
) -> EmbeddingTable:
    """An id table of ``kind`` (the models' ``embedding_tables`` argument).

    Args:
        kind (str | TableFactory): ``"plain"`` (an ``nn.Embedding``), ``"torchrec"`` (a
            :class:`TorchrecEmbeddingTable`), or a :data:`TableFactory` called with these
            arguments (by keyword from ``name`` on).
        num_embeddings (int): N.
        embedding_dim (int): D.
        name (str): the table's name (torchrec only). Default: ``"item"``.
        device (torch.device | None): Default: None.

    Returns:
        EmbeddingTable: with the implementation's default initialization.

    Raises:
        ValueError: an unknown ``kind``, naming ``embedding_tables``.
        TypeError: a factory that returns no :class:`EmbeddingTable` of ``num_embeddings``
            rows of width ``embedding_dim``.
        ImportError: ``"torchrec"`` without torchrec installed, naming ``tzrec-gr[torchrec]``.
    """
    if callable(kind):
        table = kind(num_embeddings, embedding_dim, name=name, device=device)
        if not (
            isinstance(table, EmbeddingTable)
            and (table.num_embeddings, table.embedding_dim) == (num_embeddings, embedding_dim)
        ):
            raise TypeError(
                f"embedding_tables: the factory {kind!r} must return an EmbeddingTable of "
                f"{num_embeddings} rows of width {embedding_dim}, got {table!r}"
            )
        return table
    if kind == "plain":
        return nn.Embedding(num_embeddings, embedding_dim, device=device)
    if kind == "torchrec":
        return TorchrecEmbeddingTable(num_embeddings, embedding_dim, name, device)
    kinds: List[str] = [repr(k) for k in EMBEDDING_TABLE_KINDS]
    raise ValueError(f"embedding_tables must be one of {', '.join(kinds)}, got {kind!r}")


@torch.no_grad()
def init_rows_(
    rows: torch.Tensor,
    first_row: int,
    *,
    seed: int,
    std: float = 0.02,
    first_column: int = 0,
    table_width: Optional[int] = None,
) -> torch.Tensor:
    """Fills ``rows`` in place with rows ``[first_row, first_row + len(rows))`` (columns
    ``[first_column, first_column + rows.shape[1])``) of a table drawn N(0, std²).

    The table is drawn in blocks of 65,536 rows, block ``b`` from a generator seeded with
    ``(seed, b)``, so any shard of a table (row-wise, table-wise or column-wise) is filled
    with the values it has in the whole table, whatever the number of processes: a sharded
    run starts from the weights of a one-process run. Only the blocks the shard overlaps
    are drawn (one block at a time), never the whole table.

    Args:
        rows (torch.Tensor): [R, C] a shard of the table (any float dtype and device).
        first_row (int): the table row of ``rows[0]``.
        seed (int): the table's seed.
        std (float): standard deviation. Default: 0.02.
        first_column (int): the table column of ``rows[:, 0]``. Default: 0.
        table_width (int | None): D, the whole table's width. Default: ``rows.shape[1]``
            (a shard of whole rows).

    Returns:
        torch.Tensor: ``rows``.
    """
    if rows.dim() != 2:
        raise ValueError(f"rows must be [R, C], got {tuple(rows.shape)}")
    if first_row < 0 or first_column < 0:
        raise ValueError(f"first_row and first_column must be >= 0, got {first_row}, "
                         f"{first_column}")
    width = rows.shape[1] if table_width is None else table_width
    if first_column + rows.shape[1] > width:
        raise ValueError(f"columns [{first_column}, {first_column + rows.shape[1]}) are outside "
                         f"a table of width {width} (table_width)")
    stop = first_row + rows.shape[0]
    block = first_row // INIT_BLOCK_ROWS
    generator = torch.Generator()
    while block * INIT_BLOCK_ROWS < stop:
        start = block * INIT_BLOCK_ROWS
        generator.manual_seed(seed * 1_000_003 + block)
        values = torch.randn(INIT_BLOCK_ROWS, width, generator=generator).mul_(std)
        lo, hi = max(start, first_row), min(start + INIT_BLOCK_ROWS, stop)
        columns = slice(first_column, first_column + rows.shape[1])
        rows[lo - first_row : hi - first_row].copy_(values[lo - start : hi - start, columns])
        block += 1
    return rows


def to_plain_state_dict(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` with each :class:`TorchrecEmbeddingTable`'s weight under the key of a
    plain table (``<table>.collection.embeddings.<name>.weight`` -> ``<table>.weight``), so
    that a model trained with torchrec tables loads into one built with plain tables
    (``load_state_dict`` of a torchrec table takes either key already)."""
    return {_TORCHREC_WEIGHT.sub(r"\g<table>weight", key): value
            for key, value in state_dict.items()}
