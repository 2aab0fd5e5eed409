"""Representation diversity inside self-attention (`diversity`): similarity between heads, between spatial
tokens, and before/after attention, by minibatch CKA and by cosine similarity (Park et al. 2023; Wang 2023).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.similarity.cka import _with_interval
from vitscope.analyses.similarity.grams import CkaBatch, GramGroups
from vitscope.host import on_device, to_host
from vitscope.metrics import cka as C


@register_analysis
class Diversity(Analysis):
    """Representation diversity inside self-attention [Park et al. 2023 "The attention collapse reduces the
    diversity"; Wang 2023 Fig. 12], per layer, by minibatch CKA and by cosine similarity:

    heads   between the per-head attention outputs (``block{i}.heads``, attn @ v per head, all tokens
            flattened for CKA; per token for cosine): mean over head pairs h != h'.
    tokens  between spatial positions: CKA between position p and p' across images (each position a
            representation of the images), mean over p != p'; cosine between the spatial tokens of an
            image, mean over pairs and images.
    depth   before vs after self-attention: the block input against ``resid_mid`` (input + attention
            branch), CKA across images (all tokens flattened) and cosine per token.
    High similarity = low diversity (contrastive models in late layers, per the sources).
    Only sums are kept (HSIC sums per CKA batch group, cosine sums): memory is constant in the images.

    Each value carries ``stderr`` and the 95 % interval ``value_lo``, ``value_hi`` (value ± t stderr, with the
    units - 1 degrees of freedom): for the cosines, over images (a sum of squares of the per-image values); for
    the CKAs, by batch means (the value of each CKA minibatch alone, their spread over the minibatches, as `cka`).
    """

    name = "diversity"
    state_version = 3  # 3: t intervals (CKA: groups - 1 degrees of freedom); 2: sums of squares (stderr)
    description = "similarity between heads, between spatial tokens, and before/after attention (CKA, cosine)"

    def __init__(self, vm: Any, layers: Any = None, batch_size: CkaBatch = 32):
        super().__init__(vm)
        self.layers = self.layers_param(layers)
        self.batch_size = int(batch_size)
        self.groups = GramGroups(self.batch_size)
        L, H, S = len(self.layers), self.num_heads, self.grid_size[0] * self.grid_size[1]
        self.hsic_heads = torch.zeros(L, H, H, dtype=torch.float64)
        self.hsic_tokens = torch.zeros(L, S, S, dtype=torch.float64)
        self.hsic_depth = torch.zeros(L, 3, dtype=torch.float64)  # (K,L), (K,K), (L,L)
        self.n_groups = 0
        self.cos_heads = torch.zeros(L, dtype=torch.float64)
        self.cos_tokens = torch.zeros(L, dtype=torch.float64)
        self.cos_depth = torch.zeros(L, dtype=torch.float64)
        self.cos_sq = torch.zeros(3, L, dtype=torch.float64)  # per-image sums of squares: heads, tokens, depth
        self.cka_group = torch.zeros(2, 3, L, dtype=torch.float64)  # per-group CKA: sums, sums of squares

    def _input_tap(self, i: int) -> str:
        return "embed" if i == 0 else f"block{i - 1}.out"

    def state_bytes(self, n_images: int) -> int:
        """The token sums (float64, S x S per layer) and the rows of the last, open CKA group, which the finished
        state keeps: per image and layer the heads' Gram rows, the spatial tokens, the input and ``resid_mid``."""
        S = self.grid_size[0] * self.grid_size[1]
        T, D = self.num_prefix_tokens + S, self.embed_dim or 0
        per_image = self.num_heads * T * (T - 1) // 2 + S * D + 2 * T * D
        return 4 * (n_images % self.batch_size) * len(self.layers) * per_image + 8 * len(self.layers) * S * S

    def required_taps(self) -> list[str]:
        taps = []
        for i in self.layers:
            taps += [f"block{i}.heads", self._input_tap(i), f"block{i}.resid_mid", f"block{i}.out"]
        return list(dict.fromkeys(taps))

    def on_grid(self, grid: tuple[int, int]) -> None:
        S = grid[0] * grid[1]
        self.hsic_tokens = torch.zeros(len(self.layers), S, S, dtype=torch.float64)

    def _on_device(self, device: torch.device) -> None:
        """Move the sums to the features' device (once: at the first batch, or after a load or merge)."""
        for name in self._TENSORS:
            setattr(self, name, on_device(getattr(self, name), device))

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self.pass_grid(batch)
        self._on_device(feats[f"block{self.layers[0]}.heads"].device)
        P, H = self.num_prefix_tokens, self.num_heads
        streams: dict[str, torch.Tensor] = {}
        for j, i in enumerate(self.layers):
            heads = feats[f"block{i}.heads"].float()
            B, T, D = heads.shape
            per_head = heads.reshape(B, T, H, D // H)
            # cosines of unit vectors in float32 (bounded terms), summed in float64. The sum over head pairs
            # h != g of <u_h, u_g> is |sum_h u_h|^2 - sum_h |u_h|^2, and |u_h|^2 is 1 (0 for a zero head):
            # one pass over the heads instead of an H x H contraction
            norm = torch.linalg.vector_norm(per_head, dim=-1, keepdim=True)
            u_sum = (per_head / norm.clamp_min(1e-12)).sum(2)
            per_image = (u_sum.square().sum(dim=(1, 2), dtype=torch.float64) - (norm > 0).sum(dim=(1, 2, 3))) \
                / (H * (H - 1)) / T
            self.cos_heads[j] += per_image.sum()
            self.cos_sq[0, j] += per_image.square().sum()
            spatial = feats[f"block{i}.out"][:, P:].float()
            v = torch.nn.functional.normalize(spatial, dim=-1)
            S = v.shape[1]
            tot = (v.sum(1).double().pow(2).sum(-1) - S) / (S * (S - 1))  # mean over pairs p != p' per image
            self.cos_tokens[j] += tot.sum()
            self.cos_sq[1, j] += tot.square().sum()
            x_in, x_mid = feats[self._input_tap(i)].float(), feats[f"block{i}.resid_mid"].float()
            dot = (x_in * x_mid).sum(-1)
            norms = torch.linalg.vector_norm(x_in, dim=-1) * torch.linalg.vector_norm(x_mid, dim=-1)
            cos = dot / norms.clamp_min(1e-8)
            per_image = cos.mean(1, dtype=torch.float64)
            self.cos_depth[j] += per_image.sum()
            self.cos_sq[2, j] += per_image.square().sum()
            streams[f"*h{j}"] = per_head.permute(0, 2, 1, 3)  # (B, H, T, hd): one stream per head
            streams[f"*t{j}"] = spatial  # (B, S, D): one stream per spatial position
            streams[f"in{j}"], streams[f"mid{j}"] = feats[self._input_tap(i)], feats[f"block{i}.resid_mid"]
        self._reduce(self.groups.add(streams, batch.index, batch.extra.get("position")))
        self.n_images += len(batch)

    def _reduce(self, closed: list[tuple[torch.Tensor, dict]]) -> None:
        for _ids, grams in closed:
            if len(_ids) < C.MIN_HSIC1_EXAMPLES:
                warnings.warn(f"diversity: a last CKA batch of {len(_ids)} images "
                              "is too small for HSIC_1 and was left out of the CKA terms", stacklevel=2)
                continue
            self.n_groups += 1
            for j in range(len(self.layers)):
                gh = grams[f"*h{j}"][:, None]  # (H, 1, n, n)
                heads = C.hsic1_cross(gh, gh)[:, :, 0]
                self.hsic_heads[j] += heads
                gt = grams[f"*t{j}"][:, None]  # (S, 1, n, n)
                tokens = C.hsic1_cross(gt, gt)[:, :, 0]
                self.hsic_tokens[j] += tokens
                k, m = grams[f"in{j}"], grams[f"mid{j}"]
                depth = torch.stack([C.hsic1(k, m), C.hsic1(k, k), C.hsic1(m, m)])
                self.hsic_depth[j] += depth
                # this group's own CKA values, for the spread over groups (batch means)
                one = torch.stack([_mean_offdiag_cka(heads), _mean_offdiag_cka(tokens), _depth_cka(depth)])
                self.cka_group[0, :, j] += one
                self.cka_group[1, :, j] += one.square()

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Diversity) and other.layers == self.layers
        self._check_grid_merge(other)
        other = other._finished()
        self._reduce(self.groups.flush())
        for name in self._TENSORS:
            mine = getattr(self, name)
            setattr(self, name, mine + getattr(other, name).to(mine.device))
        self.n_groups += other.n_groups
        self.n_images += other.n_images

    def _finished(self) -> Diversity:
        done = copy.copy(self)
        done.load_state_dict(self.state_dict())
        done._reduce(done.groups.flush())
        return done

    _TENSORS = ("hsic_heads", "hsic_tokens", "hsic_depth", "cos_heads", "cos_tokens", "cos_depth", "cos_sq",
                "cka_group")

    def state_dict(self) -> dict[str, Any]:
        """CPU tensors (copies: the sums keep growing), whatever device the pass ran on."""
        s = dict(zip(self._TENSORS, to_host(*(getattr(self, k) for k in self._TENSORS)), strict=True))
        return {**s, "layers": list(self.layers), "batch_size": self.batch_size, "n_images": self.n_images,
                "grid": list(self.grid_size),
                "n_groups": self.n_groups, "groups": self.groups.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k in self._TENSORS:
            setattr(self, k, state[k].clone())
        self.layers, self.batch_size = list(state["layers"]), int(state["batch_size"])
        self.n_images, self.n_groups = int(state["n_images"]), int(state["n_groups"])
        self.grid_size = tuple(int(v) for v in state.get("grid", self.grid_size))
        self.groups = GramGroups(self.batch_size)
        self.groups.load_state_dict(state["groups"])

    def finalize(self) -> pd.DataFrame:
        d = self._finished()
        n = max(d.n_images, 1)
        cos_se = _stderr(torch.stack([d.cos_heads, d.cos_tokens, d.cos_depth]), d.cos_sq, d.n_images)
        cka_se = _stderr(d.cka_group[0], d.cka_group[1], d.n_groups)
        rows = []
        for j, i in enumerate(d.layers):
            values = {"cosine_heads": float(d.cos_heads[j] / n), "cosine_tokens": float(d.cos_tokens[j] / n),
                      "cosine_depth": float(d.cos_depth[j] / n),
                      "cka_heads": float(_mean_offdiag_cka(d.hsic_heads[j])),
                      "cka_tokens": float(_mean_offdiag_cka(d.hsic_tokens[j])),
                      "cka_depth": float(_depth_cka(d.hsic_depth[j]))}
            ses = {"cosine_heads": cos_se[0, j], "cosine_tokens": cos_se[1, j], "cosine_depth": cos_se[2, j],
                   "cka_heads": cka_se[0, j], "cka_tokens": cka_se[1, j], "cka_depth": cka_se[2, j]}
            rows += [{"metric": k, "layer": i,
                      **_with_interval(v, float(ses[k]), d.n_groups if k.startswith("cka") else d.n_images)}
                     for k, v in values.items()]
        df = self.tidy(rows)
        df["n_images"] = d.n_images
        return df


def _stderr(sums: torch.Tensor, sumsq: torch.Tensor, n: int) -> torch.Tensor:
    """Standard error of a mean from the sum and sum of squares of ``n`` values (ddof 1); NaN below 2."""
    if n < 2:
        return torch.full_like(sums, float("nan"))
    var = (sumsq - sums.square() / n) / (n - 1)
    return torch.sqrt(var.clamp_min(0) / n)


def _depth_cka(hsic: torch.Tensor) -> torch.Tensor:
    """CKA (0-d tensor, on ``hsic``'s device) from the three HSIC terms (K,L), (K,K), (L,L)."""
    kl, kk, ll = hsic
    return kl / (kk * ll).sqrt()


def _mean_offdiag_cka(hsic: torch.Tensor) -> torch.Tensor:
    """The mean CKA over the pairs i != j of an (m, m) HSIC matrix (0-d tensor, on its device; NaN pairs
    count as 0)."""
    d = hsic.diagonal().clamp_min(0).sqrt()
    cka = hsic / (d[:, None] * d[None, :])
    n = cka.shape[0]
    return (cka.nansum() - cka.diagonal().nansum()) / (n * (n - 1))
