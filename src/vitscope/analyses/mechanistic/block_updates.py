"""How blocks move tokens (`BlockUpdates`): part of the mechanistic lens (`vitscope.analyses.mechanistic`; math in
`vitscope.metrics.block_updates`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import pandas as pd
import torch

from vitscope.analyses.attention import stderr_from_sums
from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.mechanistic._common import _Means, _Mechanistic
from vitscope.bounds import NonNegative
from vitscope.host import on_device, on_host, to_host
from vitscope.metrics import block_updates as U
from vitscope.metrics.intervals import t_quantile

#: the token views of the table, in the state's order
TOKEN_VIEWS = ("spatial", "cls")
#: every per-image statistic, in the state's last axis's order
STATS = (*U.TOKEN_STATS, *U.UNISON_STATS)
#: how many blocks the token picture draws by default (evenly spaced, first and last among them)
PICTURE_BLOCKS = 4


def default_picture_layers(depth: int, n: int = PICTURE_BLOCKS) -> list[int]:
    """``n`` blocks evenly spaced from the first to the last (fewer in a shallower model)."""
    return sorted({int(round(v)) for v in np.linspace(0, depth - 1, min(n, depth))})


def t_row(sums: float, sumsq: float, n: int) -> dict[str, float]:
    """``value`` (the mean over ``n`` images), ``stderr`` and the 95 % Student t interval (``n - 1`` degrees of
    freedom, `vitscope.metrics.intervals.t_quantile`: few images get a wider interval than ± 1.96 stderr) from a
    sum and a sum of squares; NaN where they are undefined."""
    v = sums / n if n else float("nan")
    se = float(stderr_from_sums(torch.tensor(sums, dtype=torch.float64), torch.tensor(sumsq, dtype=torch.float64), n))
    half = float(t_quantile(n - 1)) * se if n >= 2 else float("nan")
    return {"value": v, "stderr": se, "value_lo": v - half, "value_hi": v + half, "n": n}


@register_analysis
class BlockUpdates(_Mechanistic):
    """How each block moves the tokens (Park et al. 2023: a contrastive ViT's attention moves all tokens "in unison",
    ``z -> z + c``, a masked-modelling ViT's moves each token its own way; MAE's displacement does not shrink with
    depth; Wang, Fig. 13). From the taps of the pass: the block's input (the previous block's ``out``, ``embed``
    for block 0), ``attn_out`` (the attention update, after layer scale), ``resid_mid``, ``mlp_out`` and ``out``.

    Per block of ``layers`` and token view (``token_view``: ``spatial``, the patch tokens, a per-image mean over
    them; ``cls``, the CLS token, where the model has one; registers are in neither), a mean over images with its
    ``stderr`` and 95 % Student t interval (``value_lo``, ``value_hi``, ``n`` images):

    * ``attn_update``: ||attn_out|| / ||x_in||, the attention update relative to the stream it is added to;
    * ``mlp_update``: ||mlp_out|| / ||resid_mid||, the MLP update relative to its stream;
    * ``attn_share``, ``mlp_share``: each branch's share of the block's change, ||attn_out|| / (||attn_out|| +
      ||mlp_out||) and its complement;
    * ``displacement``: ||out - x_in|| / ||x_in||, how far the block moves a token relative to its norm;
    * ``unison_cosine`` (spatial): mean cosine between the displacements (out - x_in) of two different patch tokens
      of the image; ``unison_share`` (spatial): the share of the displacements' second moment their mean explains
      (1: every token moved by the same vector).

    The token picture (``metric`` = ``token_position``, spatial and CLS rows): for the ``keep_images`` images of
    smallest dataset id (the same in every shard and resume) and each block of ``picture_layers`` (default: four
    evenly spaced, first and last among them), the image's tokens before and after the block in the plane of the
    two principal axes of the block input's patch tokens (PCA fitted on the input, applied unchanged to the output,
    so arrows before -> after share one frame): ``x_before``, ``y_before``, ``x_after``, ``y_after`` per token
    (``image``: its id; ``token``: its index among the view's tokens), ``value`` the arrow's length in the plane,
    ``pca_variance`` the share of the input's variance the plane holds. ``keep_images`` = 0 draws none.

    State: float64 sums per (block, view, statistic), plus the kept images' tokens at the picture's blocks
    (``keep_images`` x blocks x 2 x tokens x width float32): constant in the number of images."""

    name = "block_updates"
    in_default_study = True  # norms of taps the pass computes anyway: cheap beside it
    state_version = 1
    description = "each block's attention and MLP updates relative to the stream, displacement, tokens moving in unison"
    _MEANS = ("stats",)

    def __init__(self, vm: Any, layers: Any = None, picture_layers: Any = None, keep_images: NonNegative = 1):
        super().__init__(vm)
        NonNegative.__metadata__[0].check(keep_images, f"{self.name}: keep_images")
        self.layers = self.layers_param(layers)
        self.picture_layers = sorted(set(self.layers_param(picture_layers) if picture_layers is not None
                                         else default_picture_layers(self.depth)))
        self.keep_images = int(keep_images)
        self.stats = _Means(len(self.layers), len(TOKEN_VIEWS), len(STATS))
        self.n_masked = 0  # unused here (the shared state layout)
        self.kept_ids: list[int] = []  # the kept images' dataset ids, ascending (a tensor in the state)
        self.kept: list[list[torch.Tensor]] = []  # per kept image, in id order, per picture block: (2: in / out, T, D)

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "picture_layers": list(self.picture_layers),
                "keep_images": self.keep_images}

    def _input_taps(self, i: int) -> list[str]:
        """The taps the residual stream entering block ``i`` is read from: the previous block's output (``embed``
        for block 0); for the first block of an MAE decoder (``decoder: true``), whose input is the encoder's
        output normed and embedded at the decoder's width, its ``resid_mid`` less its ``attn_out``."""
        if i == self.decoder_from:
            return [f"block{i}.resid_mid", f"block{i}.attn_out"]
        return ["embed" if i == 0 else f"block{i - 1}.out"]

    def _stream_in(self, feats: Mapping[str, torch.Tensor], i: int) -> torch.Tensor:
        """The residual stream entering block ``i`` (`_input_taps`)."""
        taps = self._input_taps(i)
        return feats[taps[0]] if len(taps) == 1 else feats[taps[0]] - feats[taps[1]]

    def required_taps(self) -> list[str]:
        taps: list[str] = []
        for i in self.layers:
            taps += [*self._input_taps(i), *(f"block{i}.{t}" for t in ("attn_out", "resid_mid", "mlp_out", "out"))]
        if self.keep_images:
            for i in self.picture_layers:
                taps += [*self._input_taps(i), f"block{i}.out"]
        return list(dict.fromkeys(taps))

    def state_bytes(self, n_images: int) -> int:
        """The sums, plus the kept images' tokens at the picture's blocks (float32)."""
        tokens = self.grid_size[0] * self.grid_size[1] + self.num_prefix_tokens
        kept = min(self.keep_images, n_images) * len(self.picture_layers) * 2 * tokens * (self.embed_dim or 768) * 4
        return (1 << 18) + kept

    def _image_values(self, feats: Mapping[str, torch.Tensor], i: int) -> torch.Tensor:
        """``(B, views, stats)`` per-image values at block ``i`` (NaN where a view lacks a statistic)."""
        x_in, out = self._stream_in(feats, i), feats[f"block{i}.out"]
        a, mid, m = (feats[f"block{i}.{t}"] for t in ("attn_out", "resid_mid", "mlp_out"))
        p = self.num_prefix_tokens
        tok = U.token_update_stats(x_in, a, mid, m, out)  # (B, T, 5)
        B = tok.shape[0]
        nan = torch.full((B, len(U.UNISON_STATS)), float("nan"), dtype=torch.float64, device=tok.device)
        spatial = torch.cat([tok[:, p:].mean(1), U.unison(out[:, p:].float() - x_in[:, p:].float())], -1)
        cls = torch.cat([tok[:, 0], nan], -1) if self.has_cls_token else torch.full_like(spatial, float("nan"))
        return torch.stack([spatial, cls], 1)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        B = len(batch)
        if self.layers:
            vals = torch.stack([self._image_values(feats, i) for i in self.layers], 1)  # (B, L, views, stats)
            self.stats.add(vals)
        self._keep_pictures(feats, batch)
        self.n_images += B

    def _keep_pictures(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        """Keep the tokens (in and out of each picture block) of the batch's images among the ``keep_images``
        smallest ids seen so far. The ids are the batch's host metadata (read without waiting for the device);
        the tokens are copied to the host in one transfer, only in a batch that holds such an image."""
        if not self.keep_images or not self.picture_layers:
            return
        ids = on_host(batch.index).long().reshape(-1).tolist()
        ranked = set(sorted(self.kept_ids + ids)[: self.keep_images])
        new = [j for j, i in enumerate(ids) if i in ranked and i not in self.kept_ids]
        if not new:
            return
        first = feats[f"block{self.picture_layers[0]}.out"]
        sel = on_device(torch.tensor(new, dtype=torch.long), first.device)
        # per picture block (n, 2: in / out, T, D): an MAE decoder's blocks are narrower than the encoder's
        blocks = [torch.stack([self._stream_in(feats, i)[sel], feats[f"block{i}.out"][sel]], 1).float()
                  for i in self.picture_layers]
        host = [cast(torch.Tensor, h) for h in to_host(*blocks)]
        self._keep([ids[j] for j in new], [[h[k] for h in host] for k in range(len(new))])

    def _keep(self, ids: list[int], tokens: list[list[torch.Tensor]]) -> None:
        """Keep the ``keep_images`` smallest ids among those kept and the new ones, in id order."""
        pool = sorted(zip([*self.kept_ids, *ids], [*self.kept, *tokens], strict=True),
                      key=lambda pair: pair[0])[: self.keep_images]
        self.kept_ids = [i for i, _ in pool]
        self.kept = [t for _, t in pool]

    def merge(self, other: Analysis) -> None:
        super().merge(other)
        o = cast(BlockUpdates, other)
        fresh = [k for k, i in enumerate(o.kept_ids) if i not in self.kept_ids]
        if fresh:
            self._keep([o.kept_ids[k] for k in fresh], [o.kept[k] for k in fresh])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "kept_ids": torch.tensor(self.kept_ids, dtype=torch.long),
                "kept": [[t.clone() for t in blocks] for blocks in self.kept]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.kept_ids = [int(i) for i in state["kept_ids"].tolist()]
        self.kept = [[t.clone() for t in blocks] for blocks in state["kept"]]

    def finalize(self) -> pd.DataFrame:
        self._to_device(torch.device("cpu"))  # the table reads entry by entry: one copy, not one per entry
        rows = self._stat_rows() + self._picture_rows()
        df = self.tidy(rows)
        df["n_images"] = self.n_images
        return df

    def _stat_rows(self) -> list[dict[str, Any]]:
        s = self.stats
        rows: list[dict[str, Any]] = []
        for j, i in enumerate(self.layers):
            for v, view in enumerate(TOKEN_VIEWS):
                for k, metric in enumerate(STATS):
                    n = int(s.count[j, v, k])
                    if n:
                        rows.append({"metric": metric, "layer": i, "token_view": view,
                                     **t_row(float(s.sum[j, v, k]), float(s.sumsq[j, v, k]), n)})
        return rows

    def _picture_rows(self) -> list[dict[str, Any]]:
        """The token picture: per kept image and picture block, every CLS and patch token before and after."""
        p, rows = self.num_prefix_tokens, []
        for image, tokens in zip(self.kept_ids, self.kept, strict=True):
            for b, i in enumerate(self.picture_layers):
                x_in, x_out = tokens[b][0].double().numpy(), tokens[b][1].double().numpy()
                patch = np.arange(len(x_in)) >= p
                before, after, share = U.project_pair(x_in, x_out, fit_rows=patch)
                views = [("spatial", np.flatnonzero(patch))] + ([("cls", np.array([0]))] if self.has_cls_token else [])
                for view, idx in views:
                    for t, r in enumerate(idx):
                        (x0, y0), (x1, y1) = before[r], after[r]
                        rows.append({"metric": "token_position", "layer": i, "token_view": view,
                                     "value": float(np.hypot(x1 - x0, y1 - y0)), "image": int(image), "token": t,
                                     "x_before": float(x0), "y_before": float(y0), "x_after": float(x1),
                                     "y_after": float(y1), "pca_variance": share})
        return rows
