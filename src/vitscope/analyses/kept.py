"""Rows of the few images with the smallest dataset ids, kept on the features' device without waiting for it.

Some analyses keep per-image data of a bounded number ``k`` of images (single-image maps, tokens for a plot):
those with the ``k`` smallest distinct dataset ids seen, so the choice does not depend on the order in which
batches or shards arrive. Choosing them with value-sized operations (boolean masks, ``unique``) would make
every batch wait for the device; here every size follows from the shapes alone: the buffers hold
``min(k, rows offered)`` rows, ascending by id, and where fewer distinct ids than that were offered (an id
seen twice) the rows at the end carry the id `NO_ID` and are dropped by `valid_rows` (called when a state is
saved or finalized, where waiting is fine).
"""

from __future__ import annotations

import torch

from vitscope.host import host_copy

NO_ID = torch.iinfo(torch.long).max
"""The id of a buffer row that holds no image (sorts after every dataset id)."""


def smallest_distinct(ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``min(k, len(ids))`` smallest distinct values of the 1-D long tensor ``ids``, ascending, and the
    position in ``ids`` of each one's first occurrence: ``(positions, values)``. Where ``ids`` holds fewer
    distinct values (repeats, or `NO_ID` rows), the trailing values are `NO_ID` (at some valid position)."""
    order = torch.sort(ids, stable=True).indices
    sorted_ids = ids[order]
    repeat = torch.zeros_like(sorted_ids, dtype=torch.bool)
    repeat[1:] = sorted_ids[1:] == sorted_ids[:-1]
    keys = torch.where(repeat, NO_ID, sorted_ids)  # a repeat drops behind every first occurrence
    values, second = torch.sort(keys, stable=True)
    n = min(int(k), len(ids))
    return order[second[:n]], values[:n]


def keep_smallest(k: int, ids: torch.Tensor, rows: list[torch.Tensor], new_ids: torch.Tensor,
                  new_rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merge new rows into kept ones: the rows of the ``k`` smallest distinct ids of both (a kept row wins over
    a new one with its id), ascending by id. ``rows[j]`` and ``new_rows[j]`` are aligned with ``ids`` and
    ``new_ids`` along their first dimension; the new ones' device is the result's."""
    dev = new_ids.device
    pos, kept = smallest_distinct(torch.cat([ids.to(dev), new_ids]), k)
    return kept, [torch.cat([old.to(dev), new])[pos] for old, new in zip(rows, new_rows, strict=True)]


def valid_rows(ids: torch.Tensor, rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The buffers without their `NO_ID` rows (which sort last), copied to the CPU: what a state saves."""
    n = int((ids != NO_ID).sum())
    return host_copy(ids[:n]), [host_copy(r[:n]) for r in rows]
