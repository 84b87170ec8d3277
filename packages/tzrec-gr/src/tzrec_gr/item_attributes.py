"""Item attributes (categories, brands, ...) as a learned row added to each item's id row.

An item's attribute row is the mean of its attributes' embeddings, zero for an item without
attributes: items that share attributes start out close, which helps the rarely seen ones.
Legend: I = items, A = attributes, K = (item, attribute) links, E = embedding width.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["ItemAttributeEmbedding", "item_attribute_table"]


class ItemAttributeEmbedding(nn.Module):
    """``out[i] = mean over the attributes a of item i of W[a]``, every item at once.

    The links are buffers (in the state dict), so a model rebuilt from its constructor
    arguments gets them back from a checkpoint; :meth:`set_links` fills them from jagged
    lists. Until then every item has no attribute (a zero row).

    Args:
        num_items (int): I.
        num_attributes (int): A, the rows of the attribute table; ids are in ``[0, A)``.
        num_links (int): K, the (item, attribute) pairs :meth:`set_links` will hold.
        embedding_dim (int): E.
        device (torch.device | None): Default: None.

    Returns (call, no arguments):
        torch.Tensor: [I, E] in the table's dtype.
    """

    def __init__(
        self,
        num_items: int,
        num_attributes: int,
        num_links: int,
        embedding_dim: int,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        for name, value in (("num_items", num_items), ("num_attributes", num_attributes),
                            ("num_links", num_links)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be an int > 0, got {value!r}")
        self.num_items = num_items
        self.num_attributes = num_attributes
        self.num_links = num_links
        self.table = nn.Embedding(num_attributes, embedding_dim, device=device)
        nn.init.normal_(self.table.weight, std=0.02)
        long = dict(dtype=torch.long, device=device)
        self.register_buffer("link_items", torch.zeros(num_links, **long))
        self.register_buffer("link_attributes", torch.zeros(num_links, **long))
        # attributes per item (an integer: exact whatever dtype the model is cast to)
        self.register_buffer("item_counts", torch.zeros(num_items, 1, **long))

    @torch.no_grad()
    def set_links(self, offsets: torch.Tensor, attribute_ids: torch.Tensor) -> None:
        """Item i's attributes are ``attribute_ids[offsets[i]:offsets[i + 1]]``.

        Args:
            offsets (torch.Tensor): [I + 1] integer, from 0 to K, non-decreasing.
            attribute_ids (torch.Tensor): [K] integer ids in ``[0, A)``.

        Raises:
            ValueError: naming the argument that does not fit the sizes given at
                construction.
        """
        for name, t in (("offsets", offsets), ("attribute_ids", attribute_ids)):
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if offsets.shape[0] != self.num_items + 1:
            raise ValueError(f"offsets must be [num_items + 1] = [{self.num_items + 1}], got "
                             f"{tuple(offsets.shape)}")
        offsets = offsets.to("cpu", torch.long)
        counts = offsets.diff()
        if offsets[0] != 0 or offsets[-1] != self.num_links or bool((counts < 0).any()):
            raise ValueError(f"offsets must rise from 0 to num_links = {self.num_links} and "
                             f"never fall; got {offsets[0]} ... {offsets[-1]}")
        if attribute_ids.shape[0] != self.num_links:
            raise ValueError(f"attribute_ids must be [num_links] = [{self.num_links}], got "
                             f"{tuple(attribute_ids.shape)}")
        attribute_ids = attribute_ids.to("cpu", torch.long)
        if bool(((attribute_ids < 0) | (attribute_ids >= self.num_attributes)).any()):
            raise ValueError(f"attribute_ids must lie in [0, {self.num_attributes}); got "
                             f"[{attribute_ids.min()}, {attribute_ids.max()}]")
        items = torch.repeat_interleave(torch.arange(self.num_items), counts)
        self.link_items.copy_(items)
        self.link_attributes.copy_(attribute_ids)
        self.item_counts.copy_(counts.unsqueeze(1))

    def forward(self) -> torch.Tensor:
        rows = self.table(self.link_attributes)
        sums = rows.new_zeros(self.num_items, rows.shape[1]).index_add(0, self.link_items, rows)
        counts = self.item_counts
        # an item without attributes gets zeros (also before set_links, whose zero-filled
        # links point at item 0)
        return torch.where(counts > 0, sums / counts.clamp(min=1).to(sums.dtype), 0.0)

    def extra_repr(self) -> str:
        return (f"num_items={self.num_items}, num_attributes={self.num_attributes}, "
                f"num_links={self.num_links}")


def item_attribute_table(
    num_items: int,
    num_attributes: int,
    num_links: int,
    embedding_dim: int,
    device: Optional[torch.device] = None,
) -> Optional[ItemAttributeEmbedding]:
    """The attribute table of a model's ``num_attributes`` and ``num_attribute_links``
    arguments, or None for ``num_attributes == 0`` (errors name those arguments)."""
    if not isinstance(num_attributes, int) or isinstance(num_attributes, bool) or (
        num_attributes < 0
    ):
        raise ValueError(f"num_attributes must be an int >= 0, got {num_attributes!r}")
    if num_attributes == 0:
        if num_links:
            raise ValueError(
                f"num_attribute_links must be 0 without num_attributes, got {num_links!r}"
            )
        return None
    if isinstance(num_links, bool) or not isinstance(num_links, int) or num_links <= 0:
        raise ValueError(
            f"num_attribute_links must be an int > 0 with num_attributes, got {num_links!r}"
        )
    return ItemAttributeEmbedding(num_items, num_attributes, num_links, embedding_dim, device)

