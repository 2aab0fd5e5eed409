"""High-norm artifact tokens (`HighNormTokens`): part of the mechanistic lens (`vitscope.analyses.mechanistic`;
math in `vitscope.metrics.mechanistic`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, DataSizes, Forwards, register_analysis
from vitscope.analyses.mechanistic._common import _Means, _Mechanistic
from vitscope.analyses.splits import TestEvery
from vitscope.bounds import Count, Positive
from vitscope.errors import VitscopeError
from vitscope.host import host_copy, on_device, on_host, to_host
from vitscope.metrics import attention as A
from vitscope.metrics import mechanistic as M
from vitscope.metrics.semantics import binomial_interval

NORM_BINS = torch.logspace(-3, 6, 901, dtype=torch.float64)
"""Edges of the norm histogram: 900 bins of 0.01 decade (2.3 % wide) from 1e-3 to 1e6, bin ``floor(100 (log10
norm + 3))``; norms outside land in the first or last bin (the exact minimum and maximum are kept beside)."""
QUANTILES = (0.01, 0.25, 0.5, 0.75, 0.99)
NORM_RULES = ("mad", "bimodal")


def _quantiles(hist: torch.Tensor, qs: Sequence[float]) -> list[float]:
    """Quantiles of the values a histogram on `NORM_BINS` counted: the geometric centre of the bin that holds
    the q-th value (2.3 % resolution); NaN when it counted nothing."""
    n = float(hist.sum())
    if n == 0:
        return [float("nan")] * len(qs)
    cum = hist.double().cumsum(0)
    centres = (NORM_BINS[:-1] * NORM_BINS[1:]).sqrt()
    return [float(centres[int(torch.searchsorted(cum, q * n).clamp_max(len(centres) - 1))]) for q in qs]


def _random_token(ids: torch.Tensor, layer: int, n_tokens: int) -> torch.Tensor:
    """A patch token per image, fixed by (image id, block) alone: the same in every shard and resumed run."""
    return (ids.long() * 2654435761 + (layer + 1) * 40503) % n_tokens


@register_analysis
class HighNormTokens(_Mechanistic):
    """High-norm artifact tokens (Darcet et al. 2024) per block, from the residual stream after the block
    (``block{i}.out``) and the next block's attention (which reads it).

    Rule (``rule``), which patch tokens are outliers at a block:

    * ``mad`` (default): those whose norm exceeds ``median + k * 1.4826 * MAD`` of their own image's patch-token
      norms at that block (`vitscope.metrics.mechanistic.robust_outliers`; the MAD scaled to a normal standard
      deviation, ``k`` = 6 by default);
    * ``bimodal``: the register paper's reading of the norm histogram (artifacts are a second mode, about 2 %
      of the tokens, of much larger norm), made a rule: those above one threshold per block, read off the
      pooled log10 norms of every patch token of the first ``threshold_images`` images of the selection by a
      two-Gaussian mixture (`vitscope.metrics.mechanistic.bimodal_threshold`): where the upper component's
      weighted density overtakes the lower one's, if the two are separated (Ashman's D > 2) and the upper one
      holds at most a fifth of the tokens (artifacts are a minority; a larger upper mode is ordinary tokens,
      e.g. object vs flat background), else no threshold and no outliers at that block. The norms come from a
      statistics pass before the pass (`Analysis.prepare`: a forward of those images up to the last block
      read, once per run, the same images on every rank, saved in the state so a resumed run reuses it).

    ``mad`` is the default: it needs no statistics pass (the analysis stays cheap beside the pass it shares in
    the default study), decides each image alone, and finds a raised token in any image; but it also flags the
    far tail of a single-mode distribution, so it reports some outliers in models without artifacts, where
    ``bimodal`` reports none (measured: the zoo's ``zoo-sup`` on 256 generated shapes, ``mad`` 0.04 to 0.5 per
    image at every block, in 4 to 16 % of the images; ``bimodal`` found no outlier mode at any block). Table:

    * ``norm_quantile``: per (layer, ``quantile``), the distribution of patch-token norms over every token of
      every image (a 0.01-decade histogram; ``quantile`` 0 and 1 are the exact minimum and maximum); with
      registers (the prefix tokens other than the CLS token: tokens 1 .. p-1 of a model with a CLS token, every
      prefix token of one without), the register tokens' norms too (``token_view`` = ``register``);
    * ``outliers_per_image``: mean count per image (``stderr``, interval); ``images_with_outliers``: share of
      images with at least one (Wilson interval);
    * ``outlier_position``: per (layer, ``row``, ``col``), how many images have an outlier at that patch;
    * ``patch_variance``: mean pixel variance (of the model's normalised input) of the patch under the token,
      ``tokens`` = ``outliers`` or ``all`` (artifacts sit in redundant, low-variance background patches);
      ``foreground_share``: share of tokens on the foreground mask (masks: same rule as ``saliency_iou``),
      outliers vs all (means over tokens; the stderr treats tokens as independent);
    * ``cls_attention_absorbed``: per image with outliers, the head-averaged CLS attention mass the next block
      puts on them (``tokens`` = ``outliers``), beside the mass uniform attention would give that many tokens
      (``uniform``); with registers, the mass on the registers (``registers``); not at the last block;
    * ``knn_accuracy``: with labels and ``knn``, weighted 20-NN accuracy (DINO's rule) of the mean outlier token
      of each image that has one, against one random patch token of the same images (``tokens`` =
      ``outliers`` / ``random_patch``; Wilson intervals; at most ``max_images`` images kept, float16; test split
      as the semantics analysis's);
    * ``norm_threshold`` (``rule`` = ``bimodal``): per layer, the threshold (a norm; NaN where the distribution
      has one mode), with its ``separation`` (Ashman's D) and ``upper_share`` (the upper component's weight).

    Every row carries ``rule`` (the rule in words).
    """

    name = "high_norm_tokens"
    state_version = 3  # 3: every register of a model without a CLS token (token 0 was left out); 2: the rule and
    # the bimodal thresholds in the state
    in_default_study = True  # cheap beside the pass (benchmarks/mechanistic.py)
    description = "high-norm artifact tokens per block: norm quantiles, outliers, where they sit, attention, k-NN"
    _MEANS = ("count", "var_out", "var_all", "fg_out", "fg_all", "absorbed", "uniform", "registers")
    _TENSORS = ("hist", "reg_hist", "lo_hi", "positions", "with_outliers")
    _ON_DEVICE = ("thresholds",)

    def __init__(self, vm: Any, layers: Any = None, k: Positive = 6.0, knn: bool = True, knn_k: Count = 20,
                 max_images: Count = 1000, test_every: TestEvery = 5, rule: Literal["mad", "bimodal"] = "mad",
                 threshold_images: Count = 200):
        from vitscope.analyses.splits import check_test_every
        from vitscope.errors import check_choice

        super().__init__(vm)
        if not float(k) > 0:
            raise VitscopeError(f"{self.name}: k must be positive, got {k}")
        self.rule = check_choice(rule, NORM_RULES, self.name, "rule", "mad or bimodal")
        Count.__metadata__[0].check(threshold_images, f"{self.name}: threshold_images")
        self.threshold_images = int(threshold_images)
        self.layers = self.layers_param(layers)
        self.k, self.knn, self.knn_k = float(k), bool(knn), int(knn_k)
        self.max_images, self.test_every = int(max_images), check_test_every(test_every, self.name)
        L = len(self.layers)
        for name in self._MEANS:
            setattr(self, name, _Means(L))
        self.hist = torch.zeros(L, len(NORM_BINS) - 1, dtype=torch.float64)
        self.reg_hist = torch.zeros_like(self.hist)
        self.lo_hi = torch.zeros(L, 4, dtype=torch.float64)  # min, -max of patches; min, -max of registers
        self.lo_hi[:] = float("inf")
        self.positions = torch.zeros(L, *self.grid_size, dtype=torch.float64)
        self.with_outliers = torch.zeros(L, dtype=torch.float64)
        self.n_masked = 0
        self.ids = torch.zeros(0, dtype=torch.long)
        self.labels = torch.zeros(0, dtype=torch.long)
        self.has_out = torch.zeros(0, L, dtype=torch.bool)
        self.out_feats = torch.zeros(0, L, 0, dtype=torch.float16)
        self.rand_feats = torch.zeros(0, L, 0, dtype=torch.float16)
        # rule bimodal: per layer log10 threshold (inf: one mode), Ashman's D, upper weight; images they came from
        self.thresholds = torch.zeros(3, 0, dtype=torch.float64)
        self.threshold_n = 0

    def _settings(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "k": self.k, "knn": self.knn, "knn_k": self.knn_k,
                "max_images": self.max_images, "test_every": self.test_every, "rule": self.rule,
                "threshold_images": self.threshold_images}

    def prepare(self, vm: Any, first_images: Any) -> None:
        """Rule ``bimodal``: the statistics pass, unless the state already holds its thresholds (a resume)."""
        if self.rule != "bimodal" or self.threshold_n:
            return
        from vitscope.capture.engine import Capture

        taps, p = [f"block{i}.out" for i in self.layers], self.num_prefix_tokens
        logs: list[list[torch.Tensor]] = [[] for _ in taps]
        n = 0
        with Capture(vm, taps) as cap:
            for b in first_images(self.threshold_images):
                feats = cap(b.images)
                for j, t in enumerate(taps):
                    logs[j].append(torch.log10(torch.linalg.vector_norm(feats[t][:, p:].float(), dim=-1)).cpu())
                n += len(b.images)
        if not n:
            raise VitscopeError(f"{self.name}: rule 'bimodal' found no image to read the norm distribution from")
        fits = [M.bimodal_threshold(torch.cat([v.flatten() for v in lv])) for lv in logs]
        self.thresholds = torch.tensor(fits, dtype=torch.float64).T.contiguous()  # (3, L)
        self.threshold_n = n

    def own_forwards(self, vm: Any, data: DataSizes) -> list[Forwards]:
        """Rule ``bimodal``: the statistics pass over the first ``threshold_images`` images, up to the last block
        it reads."""
        if self.rule != "bimodal":
            return []
        first = data.first(self.threshold_images)
        return [Forwards(len(first), sum(first), blocks=sum(first) * (max(self.layers, default=-1) + 1))]

    def _rule_text(self) -> str:
        if self.rule == "bimodal":
            return (f"norm above the block's bimodal threshold (2-Gaussian mixture on log10 norms of "
                    f"{self.threshold_n} images, Ashman's D > {M.MIN_SEPARATION:g}, upper mode <= "
                    f"{M.MAX_UPPER_SHARE:g} of the tokens)")
        return f"norm > median + {self.k:g}*1.4826*MAD of the image's patch tokens"

    def required_taps(self) -> list[str]:
        nxt = [f"block{i + 1}.attn" for i in self.layers if i + 1 < self.depth] if self.has_cls_token else []
        return [f"block{i}.out" for i in self.layers] + nxt

    def on_grid(self, grid: tuple[int, int]) -> None:
        self.positions = torch.zeros(len(self.layers), *grid, dtype=torch.float64)

    @staticmethod
    def _hist(norms: torch.Tensor) -> torch.Tensor:
        """``(L, ...)`` norms -> ``(L, bins)`` float64 counts on `NORM_BINS`, on the norms' device: one
        ``index_add_`` for every block (its output has a fixed size, unlike ``bincount``'s, so the host never
        waits for it; counts of ones in float64 are exact)."""
        nb, dev = len(NORM_BINS) - 1, norms.device
        idx = ((torch.log10(norms.flatten(1)) + 3) * 100).floor_().nan_to_num_(0).clamp_(0, nb - 1).long()
        idx = (idx + nb * torch.arange(len(norms), device=dev)[:, None]).reshape(-1)
        counts = torch.zeros(len(norms) * nb, dtype=torch.float64, device=dev)
        return counts.index_add_(0, idx, torch.ones(len(idx), dtype=torch.float64, device=dev)).reshape(len(norms), nb)

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        g, p = self.pass_grid(batch), self.num_prefix_tokens
        B, S, L, ps = len(batch), g[0] * g[1], len(self.layers), self.patch_size
        # (L, B, S) patch norms (float32 norms of float32 tokens, then float64) and outlier flags, every block
        xs = [feats[f"block{i}.out"] for i in self.layers]
        norms = torch.stack([torch.linalg.vector_norm(t[:, p:], dim=-1) for t in xs]).double()
        dev = norms.device
        self._to_device(dev)
        if self.rule == "bimodal":
            if not self.threshold_n:
                raise VitscopeError(f"{self.name}: rule 'bimodal' needs its thresholds from the statistics pass: "
                                    "call prepare(vm, first_images) before the first batch (a study does)")
            out = torch.log10(norms) > self.thresholds[0][:, None, None]
        else:
            out = M.robust_outliers(norms, self.k)
        self.hist += self._hist(norms)
        lo_hi = [norms.amin((1, 2)), -norms.amax((1, 2))]
        r0 = self._first_register()
        if p > r0:
            rn = torch.stack([torch.linalg.vector_norm(t[:, r0:p], dim=-1) for t in xs]).double()
            self.reg_hist += self._hist(rn)
            lo_hi += [rn.amin((1, 2)), -rn.amax((1, 2))]
        else:
            lo_hi += [torch.full_like(lo_hi[0], float("inf"))] * 2
        self.lo_hi = torch.minimum(self.lo_hi, torch.stack(lo_hi, 1))
        outf = out.double()  # (L, B, S) 0 / 1
        n_out = outf.sum(-1)  # (L, B)
        self.count.add(n_out.T)
        self.with_outliers += (n_out > 0).sum(1).double()
        self.positions += outf.sum(1).reshape(L, *g)  # images with an outlier at each patch
        # pixel variance of each patch of the model's input, (B, S), in grid order
        img = on_device(batch.images, dev).float()[..., :g[0] * ps, :g[1] * ps].reshape(B, -1, g[0], ps, g[1], ps)
        var = img.var(dim=(1, 3, 5), unbiased=False).reshape(B, S).double()
        ok_out = out.permute(1, 2, 0).reshape(B * S, L)
        self.var_out.add(var.reshape(-1, 1).expand(-1, L), ok_out)
        self.var_all.add(var.reshape(-1, 1).expand(-1, L))
        if batch.masks is not None:
            fg = on_device(A._masks_to_grid(batch.masks, g, B), dev).double().reshape(-1, 1).expand(-1, L)
            self.fg_out.add(fg, ok_out)
            self.fg_all.add(fg)
            self.n_masked += B
        if self.has_cls_token:
            self._add_cls_attention(feats, outf, n_out)
        if self.knn and batch.labels is not None:
            self._keep_tokens(xs, out, n_out, batch, S)
        self.n_images += B

    def _first_register(self) -> int:
        """The first register's position: 1 after a CLS token, 0 in a model without one (its prefix tokens are
        all registers)."""
        return 1 if self.has_cls_token else 0

    def _add_cls_attention(self, feats: Mapping[str, torch.Tensor], outf: torch.Tensor, n_out: torch.Tensor) -> None:
        """Per image and block, the CLS attention mass the next block puts on the outliers, what uniform attention
        would give that many tokens (NaN for an image without outliers) and the mass on the registers; NaN at a
        block without a next one. ``outf``: (L, B, S) 0 / 1 outlier flags, ``n_out``: (L, B) their counts."""
        p, (L, B) = self.num_prefix_tokens, n_out.shape
        cls = {j: feats[f"block{i + 1}.attn"][:, :, 0].mean(1).double()  # (B, T), head-averaged CLS row
               for j, i in enumerate(self.layers) if i + 1 < self.depth}
        if not cls:
            return
        nan = torch.full((B,), float("nan"), dtype=torch.float64, device=n_out.device)

        def per_block(value: Any) -> torch.Tensor:
            return torch.stack([value(j) if j in cls else nan for j in range(L)], 1)  # (B, L)

        some = n_out > 0
        self.absorbed.add(per_block(lambda j: torch.where(some[j], (cls[j][:, p:] * outf[j]).sum(-1), nan)))
        self.uniform.add(per_block(lambda j: torch.where(some[j], n_out[j] / cls[j].shape[-1], nan)))
        self.registers.add(per_block(lambda j: cls[j][:, 1:p].sum(-1) if p > 1 else nan))

    def _keep_tokens(self, xs: list[torch.Tensor], out: torch.Tensor, n_out: torch.Tensor, batch: Any, S: int
                     ) -> None:
        """For the k-NN: per image and block the mean outlier token and a random patch token, with whether it
        has outliers, brought to the host in the batch's one copy (`to_host`) and kept (`_keep`)."""
        p, B = self.num_prefix_tokens, len(batch)
        ids = on_host(batch.index).long()
        dev_ids = on_device(ids, out.device)
        mean_out, rand = [], []
        for j, i in enumerate(self.layers):
            tok = xs[j][:, p:]
            w = out[j].to(tok.dtype)
            mean_out.append(torch.bmm(w[:, None], tok)[:, 0] / w.sum(-1, keepdim=True).clamp_min(1))
            rand.append(tok[torch.arange(B, device=tok.device), _random_token(dev_ids, i, S)])
        has, mean_out_h, rand_h = to_host((n_out > 0).T, torch.stack(mean_out, 1).half(), torch.stack(rand, 1).half())
        self._keep(ids, on_host(batch.labels).long(), has, mean_out_h, rand_h)

    def _keep(self, ids: torch.Tensor, labels: torch.Tensor, has: torch.Tensor, out: torch.Tensor,
              rand: torch.Tensor) -> None:
        """Keep the ``max_images`` smallest ids among those kept and the new ones, in id order."""
        if not len(self.ids):
            self.out_feats = torch.zeros(0, *out.shape[1:], dtype=torch.float16)
            self.rand_feats = torch.zeros(0, *rand.shape[1:], dtype=torch.float16)
        ids, order = torch.sort(torch.cat([self.ids, ids]), stable=True)
        sel = order[: self.max_images]
        self.labels = torch.cat([self.labels, labels])[sel]
        self.has_out = torch.cat([self.has_out, has])[sel]
        self.out_feats = torch.cat([self.out_feats, out])[sel]
        self.rand_feats = torch.cat([self.rand_feats, rand])[sel]
        self.ids = ids[: self.max_images]

    _KEPT = ("ids", "labels", "has_out", "out_feats", "rand_feats")

    def merge(self, other: Analysis) -> None:
        o = cast(HighNormTokens, other)
        self._check_mergeable(o)
        self._check_grid_merge(o)
        if self.threshold_n and o.threshold_n and not (
                self.threshold_n == o.threshold_n and torch.allclose(on_host(self.thresholds), on_host(o.thresholds),
                                                                     rtol=1e-4)):
            raise VitscopeError(f"{self.name}: cannot merge parts that used different bimodal thresholds (other "
                                "images in their statistics passes)")
        if o.threshold_n and not self.threshold_n:
            self.thresholds, self.threshold_n = o.thresholds.clone(), o.threshold_n
        for k in self._MEANS:
            getattr(self, k).merge(getattr(o, k))
        self._add_tensors(o, ("hist", "reg_hist", "positions", "with_outliers"))
        self.lo_hi = torch.minimum(self.lo_hi, on_device(o.lo_hi, self.lo_hi.device))
        if len(o.ids):
            self._keep(o.ids, o.labels, o.has_out, o.out_feats, o.rand_feats)
        self.n_images += o.n_images
        self.n_masked += o.n_masked

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **{k: getattr(self, k).clone() for k in self._KEPT},
                "thresholds": host_copy(self.thresholds), "threshold_n": self.threshold_n}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        for k in self._KEPT:
            setattr(self, k, state[k].clone())
        self.thresholds, self.threshold_n = state["thresholds"].clone(), int(state["threshold_n"])

    def finalize(self) -> pd.DataFrame:
        self._to_device(torch.device("cpu"))  # the table reads entry by entry: one copy, not one per entry
        rows: list[dict[str, Any]] = []
        views = [("spatial", self.hist, 0)] + ([("register", self.reg_hist, 2)]
                                               if self.num_prefix_tokens > self._first_register() else [])
        h, w = self.grid_size
        for j, i in enumerate(self.layers):
            for view, hist, col in views:
                if not hist[j].sum():
                    continue
                lo, hi = float(self.lo_hi[j, col]), -float(self.lo_hi[j, col + 1])
                qs = [min(max(v, lo), hi) for v in _quantiles(hist[j], QUANTILES)]  # a bin's centre: inside
                rows += [{"metric": "norm_quantile", "layer": i, "token_view": view, "quantile": q, "value": v}
                         for q, v in zip((0.0, *QUANTILES, 1.0), (lo, *qs, hi), strict=True)]
            rows.append({"metric": "outliers_per_image", "layer": i, **self.count.row(j)})
            rows.append(self._share(i, float(self.with_outliers[j]), self.n_images))
            rows += [{"metric": "outlier_position", "layer": i, "row": r, "col": c,
                      "value": float(self.positions[j, r, c])} for r in range(h) for c in range(w)]
            for metric, tokens, means in (("patch_variance", "outliers", self.var_out),
                                          ("patch_variance", "all", self.var_all),
                                          ("foreground_share", "outliers", self.fg_out),
                                          ("foreground_share", "all", self.fg_all),
                                          ("cls_attention_absorbed", "outliers", self.absorbed),
                                          ("cls_attention_absorbed", "uniform", self.uniform),
                                          ("cls_attention_absorbed", "registers", self.registers)):
                if means.count[j] > 0:
                    rows.append({"metric": metric, "layer": i, "tokens": tokens, **means.row(j)})
        if self.rule == "bimodal" and self.threshold_n:
            for j, i in enumerate(self.layers):
                thr, sep, upper = (float(v) for v in self.thresholds[:, j])
                rows.append({"metric": "norm_threshold", "layer": i, "value": 10 ** thr if thr < float("inf")
                             else float("nan"), "separation": sep, "upper_share": upper, "n": self.threshold_n})
        rows += self._knn_rows()
        df = self.tidy(rows)
        df["n_images"], df["n_masked"], df["k"] = self.n_images, self.n_masked, self.k
        df["rule"] = self._rule_text()
        return df

    def _share(self, layer: int, hits: float, n: int) -> dict[str, Any]:
        p = hits / n if n else float("nan")
        lo, hi, se = binomial_interval(p, n)
        return {"metric": "images_with_outliers", "layer": layer, "value": p, "stderr": se, "value_lo": lo,
                "value_hi": hi, "n": n}

    def _knn_rows(self) -> list[dict[str, Any]]:
        from vitscope.analyses.splits import stratified_test
        from vitscope.metrics.semantics import knn_classify

        rows: list[dict[str, Any]] = []
        if not self.knn or not len(self.ids):
            return rows
        for j, i in enumerate(self.layers):
            sel = self.has_out[:, j]
            ids, y = self.ids[sel], self.labels[sel]
            test = stratified_test(ids, y, self.test_every)
            if not test.any() or test.all() or len(torch.unique(y[~test])) < 2:
                continue
            for tokens, feats in (("outliers", self.out_feats), ("random_patch", self.rand_feats)):
                x = feats[sel, j].float()
                acc = knn_classify(x[~test], y[~test], x[test], y[test], ks=(self.knn_k,))[self.knn_k][0]
                n = int(test.sum())
                lo, hi, se = binomial_interval(acc, n)
                rows.append({"metric": "knn_accuracy", "layer": i, "tokens": tokens, "value": acc, "stderr": se,
                             "value_lo": lo, "value_hi": hi, "n": n})
        return rows
