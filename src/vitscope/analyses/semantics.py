"""Which layer knows what (math in `vitscope.metrics.semantics`): per layer and token view, a bounded
store of pooled features (one float16 vector per image), then k-NN, a linear probe and k-means, each
against its random-chance baseline (Gaussian features of the same shape, seed 003 B.3); across models,
the agreement of the probes' predictions (seed 000 §2.4)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.capture.views import token_view
from vitscope.metrics import semantics as S


@register_analysis
class Semantics(Analysis):
    """k-NN (DINO voting, k in {10, 20, 100, 200}; top-1/top-5), a linear probe (L-BFGS, standardised
    features) and k-means purity/NMI/ARI (k = number of classes) per layer and token view ('cls', 'gap',
    'gap_spatial') [seed 000 §2.3; seed 003 §5.2, §6.1], with chance rows (``*_chance``) computed on Gaussian
    features of the same shape. Images whose id is a multiple of ``test_every`` form the test split. At most
    ``max_images`` images are kept (float16: max_images x layers x views x dim x 2 bytes)."""

    name = "semantics"
    description = "k-NN, linear probe and k-means per layer and token view, with chance baselines"

    def __init__(self, vm: Any, layers: Any = None, views: Any = ("cls", "gap", "gap_spatial"),
                 max_images: int = 5000, test_every: int = 5, ks: Any = (10, 20, 100, 200), kmeans: bool = True,
                 probe: bool = True, seed: int = 0):
        super().__init__(vm)
        self.layers = self.layers_param(layers)
        views = [views] if isinstance(views, str) else list(views)
        self.views = [v for v in views if v != "cls" or self.has_cls_token]
        self.max_images, self.test_every, self.ks = int(max_images), int(test_every), tuple(int(k) for k in ks)
        self.kmeans, self.probe, self.seed = bool(kmeans), bool(probe), int(seed)
        self.feats: dict[str, list[torch.Tensor]] = {v: [] for v in self.views}  # per batch (L, B, D) float16
        self.labels: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []
        self.unlabelled = 0

    def required_taps(self) -> list[str]:
        return [f"block{i}.out" for i in self.layers]

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        if batch.labels is None:
            self.unlabelled += len(batch)
            return
        room = self.max_images - sum(len(i) for i in self.ids)
        if room <= 0:
            return
        take = min(room, len(batch))
        for v in self.views:
            per_layer = [token_view(feats[f"block{i}.out"][:take], v, self.num_prefix_tokens, self.has_cls_token)
                         for i in self.layers]
            self.feats[v].append(torch.stack(per_layer).half().cpu())
        self.labels.append(batch.labels[:take].cpu().long())
        self.ids.append(batch.index[:take].cpu().long())
        self.n_images += take

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Semantics) and other.layers == self.layers and other.views == self.views
        for v in self.views:
            self.feats[v].extend(other.feats[v])
        self.labels.extend(other.labels)
        self.ids.extend(other.ids)
        self.n_images += other.n_images
        self.unlabelled += other.unlabelled

    def state_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "views": self.views, "feats": {v: _cat(f, 1) for v, f in self.feats.items()},
                "n_images": self.n_images, "labels": _cat(self.labels, 0, torch.long),
                "ids": _cat(self.ids, 0, torch.long), "unlabelled": self.unlabelled}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.views = list(state["layers"]), list(state["views"])
        self.feats = {v: ([f] if f.numel() else []) for v, f in state["feats"].items()}
        self.labels = [state["labels"]] if len(state["labels"]) else []
        self.ids = [state["ids"]] if len(state["ids"]) else []
        self.n_images, self.unlabelled = int(state["n_images"]), int(state["unlabelled"])

    def _data(self) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """Features, labels and ids, each concatenated once and kept so (finalize and every cross pair reuse it)."""
        s = self.state_dict()
        self.load_state_dict(s)
        return s["feats"], s["labels"], s["ids"]

    def _split(self, ids: torch.Tensor) -> torch.Tensor:
        return ids % self.test_every == 0

    def _scores(self, x: torch.Tensor, y: torch.Tensor, test: torch.Tensor, c: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if test.any() and (~test).any():
            for k, (t1, t5) in S.knn_classify(x[~test], y[~test], x[test], y[test], ks=self.ks, num_classes=c).items():
                out[f"knn{k}_top1"], out[f"knn{k}_top5"] = t1, t5
            if self.probe:
                out["probe_top1"] = S.linear_probe(x[~test], y[~test], x[test], y[test], num_classes=c)[0]
        if self.kmeans and len(x) > c:
            for m, v in S.kmeans_scores(x.float().numpy(), y.numpy(), k=c, seed=self.seed).items():
                out[f"kmeans_{m}"] = v
        return out

    def finalize(self) -> pd.DataFrame:
        feats, y, ids = self._data()
        rows: list[dict[str, Any]] = []
        if len(y) < 2:
            df = self.tidy(rows)
            df["n_images"] = self.n_images
            return df
        c = int(y.max()) + 1
        test = self._split(ids)
        gen = torch.Generator().manual_seed(self.seed)
        for v in self.views:
            for j, layer in enumerate(self.layers):
                for metric, val in self._scores(feats[v][j].float(), y, test, c).items():
                    rows.append({"metric": metric, "layer": layer, "token_view": v, "value": val})
            noise = torch.randn(feats[v].shape[1:], generator=gen)  # same shape as one layer's features
            for metric, val in self._scores(noise, y, test, c).items():
                rows.append({"metric": f"{metric}_chance", "layer": None, "token_view": v, "value": val})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        df["n_test"] = int(test.sum())
        return df

    def probe_logits(self, view: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(test logits of the probe, test labels, test ids) at one layer and view."""
        feats, y, ids = self._data()
        test = self._split(ids)
        j = self.layers.index(layer)
        x = feats[view][j].float()
        _, logits = S.linear_probe(x[~test], y[~test], x[test], y[test], num_classes=int(y.max()) + 1)
        return logits, y[test], ids[test]

    @classmethod
    def cross(cls, analyses: list[Analysis]) -> pd.DataFrame | None:
        """Agreement of the last-layer probes of every pair of models on the same test images."""
        frames = []
        for i, a in enumerate(analyses):
            for b in analyses[i + 1:]:
                assert isinstance(a, Semantics) and isinstance(b, Semantics)
                views = [v for v in a.views if v in b.views]
                if not views or not a.probe or not b.probe or a.n_images < 2 or b.n_images < 2:
                    continue
                la, ya, ia = a.probe_logits(views[0], a.layers[-1])
                lb, _, ib = b.probe_logits(views[0], b.layers[-1])
                if not torch.equal(ia, ib):
                    continue
                agree = S.prediction_agreement(la, lb, ya)
                rows = [{"metric": k, "layer": a.layers[-1], "layer_b": b.layers[-1], "token_view": views[0],
                         "model_b": b.model_name, "value": v} for k, v in agree.items()]
                frames.append(a.tidy(rows))
        return pd.concat(frames, ignore_index=True) if frames else None


def _cat(parts: list[torch.Tensor], dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Concatenate per-batch parts; a single part is returned as is (no copy)."""
    if not parts:
        return torch.empty(0, dtype=dtype) if dtype is not None else torch.empty(0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
