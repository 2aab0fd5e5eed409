"""Geometry of representations per layer (math in `vitscope.metrics.geometry`): how much volume tokens and
images occupy, and how much high-frequency amplitude the token maps carry [Park et al. 2023]."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.kept import keep_smallest, smallest_distinct, valid_rows
from vitscope.bounds import Count, Iterations, Positive
from vitscope.capture.taps import expand_taps, parse_tap
from vitscope.capture.views import token_view
from vitscope.host import host_copy, moved
from vitscope.metrics import geometry as G
from vitscope.metrics.intervals import Z95
from vitscope.threads import few_threads


def _stderr(total: float, total_sq: float, n: int) -> float:
    """Standard error of a mean from the sum and the sum of squares of ``n`` values (ddof 1); NaN below 2."""
    if n < 2:
        return float("nan")
    return math.sqrt(max(total_sq - total * total / n, 0.0) / (n - 1) / n)


def _add_sums(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-tap sums of two parts added, on this part's device; a tap only one part has seen keeps its sum."""
    out = dict(mine)
    for t, v in theirs.items():
        out[t] = out[t] + v.to(out[t].device) if t in out else v
    return out


class _PerTap(Analysis):
    """Shared plumbing: per-tap float64 sums, merged by addition. The sums live on the features' device
    (`_on_device` at each batch: a loaded or new state moves at its first one); ``state_dict`` copies them to
    the CPU."""

    _sums: tuple[str, ...] = ()

    def __init__(self, vm: Any, taps: str | Sequence[str] = "block*.out"):
        super().__init__(vm)
        self.taps = expand_taps(list(taps) if not isinstance(taps, str) else taps, self.depth)

    def required_taps(self) -> list[str]:
        return list(self.taps)

    def _on_device(self, device: torch.device) -> None:
        """Move the sums to ``device`` (free for those already there)."""
        for k in self._sums:
            setattr(self, k, moved(getattr(self, k), device))

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, type(self)) and other.taps == self.taps
        self._check_grid_merge(other)
        for k in self._sums:
            setattr(self, k, _add_sums(getattr(self, k), getattr(other, k)))
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"taps": list(self.taps), "n_images": self.n_images, "grid": list(self.grid_size),
                **{k: {t: host_copy(v) for t, v in getattr(self, k).items()} for k in self._sums}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.taps, self.n_images = list(state["taps"]), int(state["n_images"])
        self.grid_size = tuple(int(v) for v in state.get("grid", self.grid_size))
        for k in self._sums:
            setattr(self, k, {t: v.clone() for t, v in state[k].items()})


@register_analysis
class SVDVolume(_PerTap):
    """Volume occupied by tokens and images, per layer [Park et al. 2023 "SVD analysis"]: token level, the log
    eigenvalues of the covariance of each image's patch tokens, averaged over images; image level, the log
    eigenvalues of the covariance of the images' pooled patch tokens (GAP without prefix), from streamed
    moments. The token level uses the images whose id is a multiple of ``token_every`` (an eigendecomposition
    per image and layer, as costly as a small ViT's forward at ``token_every=1``). Rows: the spectra
    (``index`` = rank of the eigenvalue) and ``*_log_volume`` = their mean over the top ``k`` eigenvalues
    (a larger volume = representations spread over more directions), and per layer
    ``*_log_volume_chance``: the same for Gaussian features of the same shape and the same mean variance
    (isotropic: the most volume that much variance can fill). The token level is a mean over images and
    carries its standard error (``stderr``) and 95 % interval (``value_lo``, ``value_hi``); the image level is
    one spectrum of all images, without a spread."""

    name = "svd_volume"
    description = "token- and image-level covariance spectra (log eigenvalues) per layer"
    state_version = 2  # 2: per-image sums of squares of the token-level volume
    _sums = ("tok", "tvar", "ntok", "sx", "sxx", "tokvol", "tokvol_sq")

    def __init__(self, vm: Any, taps: str | Sequence[str] = "block*.out", k: Count = 32, seed: int = 0,
                 token_every: Count = 4):
        super().__init__(vm, taps)
        self.k, self.seed, self.token_every = int(k), int(seed), max(1, int(token_every))
        self.tok: dict[str, torch.Tensor] = {}  # sums over the token-level images (id % token_every == 0)
        self.tvar: dict[str, torch.Tensor] = {}  # ... of the mean variance of their tokens
        self.ntok: dict[str, torch.Tensor] = {}  # ... and their number
        self.sx: dict[str, torch.Tensor] = {}
        self.sxx: dict[str, torch.Tensor] = {}
        self.tokvol: dict[str, torch.Tensor] = {}  # sums of each token-level image's volume (mean top-k log ev.)
        self.tokvol_sq: dict[str, torch.Tensor] = {}  # ... and of its square

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self.pass_grid(batch)
        dev = feats[self.taps[0]].device
        self._on_device(dev)
        # the token-level images, chosen by their ids (on the host in a study): the batch's one host sync
        chosen = [b for b, s in enumerate((batch.index % self.token_every == 0).tolist()) if s]
        take = torch.tensor(chosen, dtype=torch.long, device=dev)
        for t in self.taps:
            spatial = token_view(feats[t], "spatial", self.num_prefix_tokens, self.has_cls_token)
            if chosen:
                some = spatial[take]
                ev = G.covariance_spectrum(some)
                logs = ev.clamp_min(G.EPS).log()
                tok = logs.sum(0)
                tvar = ev.sum() / spatial.shape[-1]  # each covariance's trace: its mean channel variance x D
                vol = logs[:, : self.k].mean(1, dtype=torch.float64)  # each image's volume
                tokvol, tokvol_sq = vol.sum(), vol.square().sum()
            else:
                tok, tvar, tokvol, tokvol_sq = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(4))
            pooled = spatial.mean(1, dtype=torch.float64)
            self.tok[t] = self.tok[t] + tok if t in self.tok else tok
            self.tvar[t] = self.tvar[t] + tvar if t in self.tvar else tvar
            self.ntok[t] = self.ntok[t] + len(chosen) if t in self.ntok else torch.tensor(len(chosen), device=dev)
            self.tokvol[t] = self.tokvol[t] + tokvol if t in self.tokvol else tokvol
            self.tokvol_sq[t] = self.tokvol_sq[t] + tokvol_sq if t in self.tokvol_sq else tokvol_sq
            self.sx[t] = self.sx[t] + pooled.sum(0) if t in self.sx else pooled.sum(0)
            self.sxx[t] = self.sxx[t] + pooled.T @ pooled if t in self.sxx else pooled.T @ pooled
        self.n_images += len(batch)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "k": self.k, "seed": self.seed, "token_every": self.token_every}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.k, self.seed, self.token_every = int(state["k"]), int(state["seed"]), int(state["token_every"])

    def _chance_volumes(self, tokens_shape: tuple[int, int]) -> tuple[float, float]:
        """Mean top-k log eigenvalue of unit-variance Gaussian tokens (up to 64 images of ``tokens_shape``)
        and of unit-variance Gaussian pooled features of ``n_images`` images."""
        g = torch.Generator().manual_seed(self.seed)
        n_tok = max(1, min(int(next(iter(self.ntok.values()))), 64))
        tok = G.token_log_spectrum(torch.randn(n_tok, *tokens_shape, generator=g)).mean(0)
        img = G.covariance_spectrum(torch.randn(self.n_images, tokens_shape[1], generator=g)).clamp_min(G.EPS).log()
        return float(tok[: self.k].mean()), float(img[: self.k].mean())

    def finalize(self) -> pd.DataFrame:
        self._on_device(torch.device("cpu"))  # the spectra on the host, wherever the sums were: the same digits
        rows = []                             # for an uninterrupted run and a part read back from the cache
        n_tokens = self.grid_size[0] * self.grid_size[1]
        chance = None
        for t in self.taps:
            layer = parse_tap(t)[0]
            ntok = max(int(self.ntok[t]), 1)
            tok = (self.tok[t] / ntok).tolist()
            ev = G.spectrum_from_moments(self.sx[t], self.sxx[t], self.n_images)
            img = ev.clamp_min(G.EPS).log().tolist()
            if chance is None:
                chance = self._chance_volumes((n_tokens, len(ev)))
            var = {"token": float(self.tvar[t]) / ntok, "image": float(ev.sum()) / len(ev)}
            for (level, spec), base in zip((("token", tok), ("image", img)), chance, strict=True):
                for i, v in enumerate(spec):
                    rows.append({"metric": f"{level}_log_eigenvalue", "layer": layer, "tap": t, "index": i,
                                 "value": v})
                top = spec[: self.k]
                row = {"metric": f"{level}_log_volume", "layer": layer, "tap": t, "index": None,
                       "value": sum(top) / len(top)}
                if level == "token":
                    n_tok = int(self.ntok[t])
                    se = _stderr(float(self.tokvol[t]), float(self.tokvol_sq[t]), n_tok)
                    row.update(stderr=se, value_lo=row["value"] - Z95 * se, value_hi=row["value"] + Z95 * se)
                rows.append(row)
                rows.append({"metric": f"{level}_log_volume_chance", "layer": layer, "tap": t, "index": None,
                             "value": base + math.log(max(var[level], G.EPS))})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df


@register_analysis
class Fourier(_PerTap):
    """Fourier analysis of token maps per layer [Park et al. 2023; Park & Kim 2022]: patch tokens as (D, h, w)
    maps, 2-D DFT per channel, log amplitude averaged over channels and images; Δ log amplitude = log A(f)
    - log A(0) along the diagonal from the centre (only those coefficients are computed and kept). Rows: the
    whole curve (``freq`` in units of π) and ``high_freq_delta_log_amp`` at the highest frequency (closer to 0
    = more high-frequency content); the same for Gaussian white-noise tokens of the same shape as
    ``*_chance`` rows (no layer). ``high_freq_delta_log_amp`` is a mean over images and carries its standard
    error (``stderr``) and 95 % interval (``value_lo``, ``value_hi``). On a model with its MAE decoder
    (``decoder: true``) the rows carry ``block_label`` (`Analysis.tidy`), which the figures put on their block axis."""

    name = "fourier"
    description = "relative log amplitude of token maps vs spatial frequency, per layer"
    state_version = 3  # 1 kept whole (h, w) maps; 2 keeps their diagonal; 3 the high-frequency sums of squares
    _sums = ("amp", "high_sq")

    def __init__(self, vm: Any, taps: str | Sequence[str] = "block*.out"):
        super().__init__(vm, taps)
        self.amp: dict[str, torch.Tensor] = {}
        self.high_sq: dict[str, torch.Tensor] = {}  # sum over images of (Δ log amplitude at the highest freq.)²

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self.pass_grid(batch)
        self._on_device(feats[self.taps[0]].device)
        for t in self.taps:
            spatial = token_view(feats[t], "spatial", self.num_prefix_tokens, self.has_cls_token)
            per_image = G.diagonal_log_amplitude(spatial, self.grid_size)
            a = per_image.sum(0)
            sq = (per_image[:, -1] - per_image[:, 0]).square().sum()
            self.amp[t] = self.amp[t] + a if t in self.amp else a
            self.high_sq[t] = self.high_sq[t] + sq if t in self.high_sq else sq
        self.n_images += len(batch)

    def finalize(self) -> pd.DataFrame:
        self._on_device(torch.device("cpu"))  # as svd_volume's: on the host whatever device the sums were on
        rows = []
        for t in self.taps:
            layer = parse_tap(t)[0]
            freq, delta = G.profile_of_diagonal(self.amp[t] / self.n_images, self.grid_size)
            for f, d in zip(freq.tolist(), delta.tolist(), strict=True):
                rows.append({"metric": "delta_log_amp", "layer": layer, "tap": t, "freq": f, "value": d})
            high = float(delta[-1])
            # the delta of the mean diagonal is the mean of the images' deltas: its sum is n x high
            se = _stderr(high * self.n_images, float(self.high_sq[t]), self.n_images)
            rows.append({"metric": "high_freq_delta_log_amp", "layer": layer, "tap": t, "freq": float(freq[-1]),
                         "value": high, "stderr": se, "value_lo": high - Z95 * se, "value_hi": high + Z95 * se})
        if self.taps and self.n_images:
            g = torch.Generator().manual_seed(0)
            h, w = self.grid_size
            noise = torch.randn(min(self.n_images, 64), h * w, 64, generator=g)
            diag = G.diagonal_log_amplitude(noise, self.grid_size).mean(0)
            freq, delta = G.profile_of_diagonal(diag, self.grid_size)
            for f, v in zip(freq.tolist(), delta.tolist(), strict=True):
                rows.append({"metric": "delta_log_amp_chance", "layer": None, "tap": None, "freq": f, "value": v})
            rows.append({"metric": "high_freq_delta_log_amp_chance", "layer": None, "tap": None,
                         "freq": float(freq[-1]), "value": float(delta[-1])})
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df


@register_analysis
class TSNE(Analysis):
    """Token-level t-SNE [Park et al. 2023 "Token-level t-SNE visualization"]: the patch tokens of the first
    ``n_images`` images (by dataset index) at the chosen layers, embedded in 2-D with scikit-learn's t-SNE
    (fixed seed, ``max_iter`` iterations of which the first 250 exaggerate). Rows: one per token with ``x``,
    ``y``, ``image`` (dataset index) and ``token`` (patch index); value = the image's label (or -1). Tokens
    of one image that stay together = the model does not tell its tokens apart (contrastive models, per the
    source); mixed across images = tokens carry local content."""

    name = "tsne"
    description = "2-D t-SNE of the patch tokens of a few images at chosen layers"

    def __init__(self, vm: Any, layers: Any = (-1,), n_images: Count = 4, perplexity: Positive = 30.0, seed: int = 0,
                 max_iter: Iterations = 500):
        super().__init__(vm)
        self.layers = self.layers_param(list(layers) if not isinstance(layers, int) else layers)
        self.max_images, self.perplexity, self.seed = int(n_images), float(perplexity), int(seed)
        self.max_iter = max(250, int(max_iter))  # scikit-learn's minimum; cost is linear in it
        # the tokens of the images with the smallest ids, ascending, in fixed-size buffers on the features'
        # device (`vitscope.analyses.kept`; ids `NO_ID` hold no image): (n,) ids, (n, L, S, D) float16, (n,) labels
        self.kept_index = torch.zeros(0, dtype=torch.long)
        self.kept_tokens: torch.Tensor | None = None  # None before the first image (D unknown)
        self.kept_labels = torch.zeros(0, dtype=torch.long)

    def required_taps(self) -> list[str]:
        return [f"block{i}.out" for i in self.layers]

    def state_bytes(self, n_images: int) -> int:
        return 2 * min(n_images, self.max_images) * len(self.layers) * self.grid_size[0] * self.grid_size[1] \
            * self.embed_dim

    def superlinear(self, n_images: int) -> list[str]:
        tokens = min(n_images, self.max_images) * self.grid_size[0] * self.grid_size[1]
        return [f"t-SNE of {tokens} tokens ({tokens}^2 pairs, {self.max_iter} iterations) per layer "
                f"({len(self.layers)} layers)"]

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        tokens = torch.stack([token_view(feats[f"block{i}.out"], "spatial", self.num_prefix_tokens,
                                         self.has_cls_token) for i in self.layers], 1)  # (B, L, S, D)
        labels = batch.labels if batch.labels is not None else torch.full((len(batch),), -1,
                                                                         device=batch.index.device)
        # the ids and labels (on the host in a study) reach the device in one copy
        both = torch.stack([batch.index.long(), labels.long()]).to(tokens.device)
        take, index = smallest_distinct(both[0], self.max_images)  # the batch's images that can be kept
        self._keep(index, tokens[take].half(), both[1][take])
        self.n_images += len(batch)

    def _keep(self, index: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Keep the ``max_images`` smallest distinct ids among those kept and the new ones (order-independent)."""
        if self.kept_tokens is None:
            self.kept_tokens = torch.zeros(0, *tokens.shape[1:], dtype=torch.float16)
        self.kept_index, (self.kept_tokens, self.kept_labels) = keep_smallest(
            self.max_images, self.kept_index, [self.kept_tokens, self.kept_labels], index, [tokens, labels])

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, TSNE) and other.layers == self.layers
        if other.kept_tokens is not None:
            dev = self.kept_tokens.device if self.kept_tokens is not None else other.kept_tokens.device
            self._keep(other.kept_index.to(dev), other.kept_tokens.to(dev), other.kept_labels.to(dev))
        self.n_images += other.n_images

    @property
    def kept(self) -> dict[int, tuple[torch.Tensor, int]]:
        """The kept images on the CPU: image id -> ((L, S, D) float16 tokens, label), ascending by id."""
        if self.kept_tokens is None:
            return {}
        index, (tokens, labels) = valid_rows(self.kept_index, [self.kept_tokens, self.kept_labels])
        return {i: (x, lab) for i, x, lab in zip(index.tolist(), tokens, labels.tolist(), strict=True)}

    def state_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "n_images": self.n_images, "kept": self.kept}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.n_images = list(state["layers"]), int(state["n_images"])
        kept = dict(state["kept"])
        ids = sorted(kept)
        self.kept_index = torch.tensor(ids, dtype=torch.long)
        self.kept_tokens = torch.stack([kept[i][0] for i in ids]) if ids else None
        self.kept_labels = torch.tensor([int(kept[i][1]) for i in ids], dtype=torch.long)

    def finalize(self) -> pd.DataFrame:
        kept = self.kept
        size = sum(int(v[0][0].numel()) for v in kept.values())  # points x features of one layer
        with few_threads(size):  # a few hundred points: one thread is as fast, and cannot wait for another
            rows = self._embed(kept)
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df

    def _embed(self, kept: Mapping[int, tuple[torch.Tensor, int]]) -> list[dict[str, Any]]:
        from sklearn.manifold import TSNE as SkTSNE

        rows: list[dict[str, Any]] = []
        ids = sorted(kept)
        if not ids:
            return rows
        S = kept[ids[0]][0].shape[1]
        for j, layer in enumerate(self.layers):
            x = torch.cat([kept[i][0][j] for i in ids]).float().numpy()
            perplexity = min(self.perplexity, (len(x) - 1) / 3)
            emb = SkTSNE(n_components=2, perplexity=perplexity, init="pca", random_state=self.seed,
                         max_iter=self.max_iter).fit_transform(x)
            for r, (ex, ey) in enumerate(emb):
                img = ids[r // S]
                rows.append({"metric": "tsne", "layer": layer, "image": img, "token": r % S,
                             "x": float(ex), "y": float(ey), "value": float(kept[img][1])})
        return rows
