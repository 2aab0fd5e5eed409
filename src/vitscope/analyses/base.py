"""The accumulator protocol every analysis honours, and the registry of analyses by name.

An analysis is created per model, declares the taps it needs, and sees each batch once:

    a = AttentionDistance(vm, layers=[0, 5])
    a.required_taps()            -> ["block0.attn", "block5.attn"]
    a.update(feats, batch)       # feats: {tap: tensor} for this batch only
    a.merge(other)               # same analysis, other images (a shard or a resumed part)
    a.state_dict() / a.load_state_dict(state)   # tensors and plain values only: cached, resumable
    a.finalize() -> pandas.DataFrame             # tidy: model, analysis, metric, layer, head, token_view, value

Memory must not grow with the number of images: keep sums, small per-batch statistics, or a bounded
number of pooled vectors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd
import torch

from vitscope.errors import VitscopeError, close_matches

if TYPE_CHECKING:
    from vitscope.data.base import Batch
    from vitscope.models.adapter import ViTModel

COLUMNS = ["model", "analysis", "metric", "layer", "head", "token_view", "value"]
PAIR_COLUMNS = ["model_b", "layer_b"]


class Analysis(ABC):
    name: ClassVar[str]
    description: ClassVar[str] = ""
    #: raised when the meaning or layout of ``state_dict`` changes: part of the cache key, so states written
    #: by an older version are recomputed instead of misread
    state_version: ClassVar[int] = 1

    def __init__(self, vm: ViTModel, **params: Any):
        self.model_name = vm.name
        self.depth = vm.depth
        self.num_heads = vm.num_heads
        self.grid_size = vm.grid_size
        self.patch_size = vm.patch_size
        self.num_prefix_tokens = vm.num_prefix_tokens
        self.has_cls_token = vm.has_cls_token
        self.n_images = 0

    def layers_param(self, layers: Any) -> list[int]:
        """``None``/'all' -> every block; negative indices count from the end."""
        if layers is None or layers == "all":
            return list(range(self.depth))
        out = []
        for i in ([layers] if isinstance(layers, int) else list(layers)):
            j = i + self.depth if i < 0 else i
            if not 0 <= j < self.depth:
                raise VitscopeError(f"{self.name}: layer {i} is out of range for a {self.depth}-block model")
            out.append(j)
        return out

    @abstractmethod
    def required_taps(self) -> list[str]: ...

    @abstractmethod
    def update(self, feats: Mapping[str, torch.Tensor], batch: Batch) -> None: ...

    @abstractmethod
    def merge(self, other: Analysis) -> None: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def finalize(self) -> pd.DataFrame: ...

    @classmethod
    def cross(cls, analyses: list[Analysis]) -> pd.DataFrame | None:
        """Results across models (one finished analysis per model), e.g. CKA of model A vs model B.
        None when the analysis has no cross-model part."""
        return None

    def tidy(self, rows: list[dict[str, Any]]) -> pd.DataFrame:
        df = pd.DataFrame(rows)
        for c in COLUMNS:
            if c not in df.columns:
                df[c] = None
        df["model"] = self.model_name
        df["analysis"] = self.name
        extra = [c for c in df.columns if c not in COLUMNS]
        return df[COLUMNS + extra]


ANALYSES: dict[str, type[Analysis]] = {}


def register_analysis(cls: type[Analysis]) -> type[Analysis]:
    if cls.name in ANALYSES:
        raise ValueError(f"analysis {cls.name!r} is registered twice")
    ANALYSES[cls.name] = cls
    return cls


def get_analysis(name: str) -> type[Analysis]:
    if name not in ANALYSES:
        hint = close_matches(name, ANALYSES)
        raise VitscopeError(f"unknown analysis {name!r}" + (f"; did you mean {', '.join(hint)}?" if hint else "")
                            + f" Available: {', '.join(sorted(ANALYSES))}.")
    return ANALYSES[name]
