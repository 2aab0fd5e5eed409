"""The seeded subset of images the `similarity` analysis keeps: a pseudo-random key per image id
(`subset_keys`, splitmix64 in int64 tensor arithmetic), the same for every model, shard and resumed run.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15


def subset_keys(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """A pseudo-random int64 key per image id (splitmix64 of the id and the seed): the images kept are the
    ``n_subset`` smallest keys, so the subset depends on the ids alone, never on arrival order, shards or
    resumption, and two models fed the same images keep the same ones.

    Computed in int64 tensor arithmetic on the ids' device (no copy to the host): additions and products wrap
    modulo 2^64 as the uint64 ones do, and the logical right shifts are arithmetic shifts with the sign bits
    masked off, so the bits are those of the uint64 recipe."""
    z = ids.long() + _signed((int(seed) * _MIX + _MIX) % 2 ** 64)
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _shr(z, 31)
    return _shr(z, 1)


def _signed(c: int) -> int:
    """The int64 with the bits of the uint64 ``c``."""
    return c - 2 ** 64 if c >= 2 ** 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (as uint64) by ``s`` in 1..63."""
    return (z >> s) & ((1 << (64 - s)) - 1)
