"""Keypoint correspondence by nearest patch token per layer, with no training (`correspondence`):
PCK@0.1 / 0.05 / 0.01, per category, with a random-token chance.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.dense._common import _Dense
from vitscope.errors import ConfigError, VitscopeError
from vitscope.host import host_copies
from vitscope.metrics import dense as D
from vitscope.metrics import intervals as I

#: the correspondence sums kept per category (a row each), the rest (skips) for all
_CATEGORY_SUMS = ("correct", "chance", "keypoints", "pairs", "correct_sq", "correct_kp", "keypoints_sq")

#: the reasons a correspondence item is not scored, in the order of its skip counts
_PAIR_SKIPS = ("source without its target", "target without its source",
               "pair without a keypoint visible in both images", "pair whose target object has an empty box")


def _batch_column(batch: Any) -> Any:
    """An untiled batch's annotation columns by the names `_plain_item` gives its items' annotations."""
    fields = {"keypoints": batch.keypoints, "bbox": batch.boxes, "label": batch.labels}

    def column(key: str) -> Any:
        return fields[key] if key in fields else batch.extra.get(key)
    return column


def _item_column(item: Mapping[str, Any]) -> Any:
    """One item's annotations (a tiled item's) as columns of length 1."""
    def column(key: str) -> Any:
        v = item.get(key)
        if v is None:
            return None
        return torch.as_tensor(v)[None] if key in ("keypoints", "bbox") else [v]
    return column


@register_analysis
class Correspondence(_Dense):
    """Keypoint correspondence per layer with no training (Walmer et al., CVPR 2023, §6.3 / E.1): for each
    image pair and each source keypoint visible in both images, the nearest neighbour (cosine) of the patch
    token holding the source keypoint among the target's patch tokens; the prediction is that token's centre.
    PCK@alpha = share of keypoints predicted within alpha * max(bbox h, w) of the target object (alpha = 0.1,
    0.05, 0.01), per layer, per category, over all keypoints and as the mean over categories. Chance
    (``pck@a_chance``): a uniformly random target token.

    Protocol: SPair-71k images reach the model whole (the dataset's ``crop: full``; short side ``size``,
    default the model's input size, aspect kept, sides rounded down to the patch size), so no keypoint is lost
    to a crop, and distances are measured in the file's pixels (token centres mapped back through the
    resize) against alpha * max(bbox h, w) of the box at its original size, as SPair-71k's PCK is defined.
    The input size is vitscope's choice (a ``size`` option), not a number taken from the source. With
    ``crop: center`` (the model's eval crop) keypoints outside the crop are not counted. The last block's
    output after the final norm is a layer (``layer`` = depth). The table's ``framing`` and ``input_size``
    columns say which protocol a run used.

    Uncertainty: the overall PCK carries a standard error clustered by image pair (the keypoints of one pair share
    its difficulty, so they are not independent trials) and the 95 % interval ``value_lo``, ``value_hi`` = value ±
    t · stderr with (pairs - 1) degrees of freedom (`vitscope.metrics.intervals.ratio_interval`, from per-pair
    sums; ``interval_units`` = pairs). The binomial error over keypoints it replaces covered 68-78 % of the time
    in simulations where pairs differ in difficulty (intra-pair correlation 0.2-0.33; benchmarks/calibration.py,
    docs/CALIBRATION.md).

    Variants of the source (Walmer et al. 2023, ``vit_analysis``), each off by default so that today's tables stay
    as they were; the table's ``variant`` column names the ones that ran:

    * ``matching: pixel`` (default ``token``): the authors' pixel-level nearest neighbour. Each image's token map is
      upsampled bilinearly to the model input's pixels (``F.interpolate``, ``align_corners=False``) and
      L2-normalised; the source feature is the upsampled map at the keypoint's pixel, the prediction the centre
      of the target pixel of highest cosine. Token matching compares whole tokens and predicts a token's centre,
      so its error has a floor of up to half a patch; pixel matching interpolates between tokens. Costs one
      (layers x pixels x channels) map per image, one layer at a time. Chance is then a uniformly random pixel.
    * ``random_baseline: true``: the paper's "random" row, Gaussian features of the tokens' shape (N(0, 1) per
      token and channel, seeded by each image's dataset index) matched as a layer is, once per pair: rows
      ``pck@a_random`` (``layer`` empty) and the best-layer row's ``random_features``.
    * The dataset options of SPair-71k (``letterbox: true``, ``pairs_per_category: 20``, ``pair_seed: 42``;
      `vitscope.data.formats.spair.SPair71k`) give the authors' input geometry and pair selection."""

    name = "correspondence"
    # 5: per-pair moment sums (correct_sq, correct_kp, keypoints_sq), stderr clustered by pair, t interval;
    # 4: sums per category in tensors on the features' device, the last item kept for a pair across batches;
    # 3: stderr over keypoints; 2: whole images, PCK in the file's pixels, final norm layer
    state_version = 5
    needs = frozenset({"pairs", "keypoints"})
    headline = "pck@0.1"
    description = "keypoint correspondence by nearest patch token per layer: PCK@0.1/0.05/0.01 per category"

    def __init__(self, vm: Any, layers: Any = None, alphas: Any = D.PCK_ALPHAS, final_norm: bool = True,
                 matching: Literal["token", "pixel"] = "token", random_baseline: bool = False):
        super().__init__(vm, layers, final_norm, random_baseline)
        if matching not in ("token", "pixel"):
            raise ConfigError(f"correspondence: matching must be 'token' or 'pixel', got {matching!r}")
        self.matching = str(matching)
        self.alphas = tuple(float(a) for a in alphas)
        self.cat_names: list[str] = []
        L, A = len(self.layers) + self.random_baseline, len(self.alphas)  # the random features: one more set
        # per category (row c: cat_names[c]): correct counts (L, A), chance sums (A,), keypoints, pairs, and over
        # its pairs the sums of correct² and correct x keypoints (L, A) and of keypoints² (the pair-level moments of
        # `vitscope.metrics.intervals.ratio_interval`); and the skip counts of _PAIR_SKIPS
        self.sums: dict[str, torch.Tensor] = {
            "correct": torch.zeros(0, L, A, dtype=torch.long), "chance": torch.zeros(0, A, dtype=torch.float64),
            "keypoints": torch.zeros(0, dtype=torch.long), "pairs": torch.zeros(0, dtype=torch.long),
            "correct_sq": torch.zeros(0, L, A, dtype=torch.long), "correct_kp": torch.zeros(0, L, A, dtype=torch.long),
            "keypoints_sq": torch.zeros(0, dtype=torch.long),
            "skips": torch.zeros(len(_PAIR_SKIPS), dtype=torch.long)}
        # the last item seen (a source waits there for its target in the next batch): its features at its
        # keypoints' tokens (L, K, D), keypoints (K, 3), pair () and whether it is a source ()
        self.last: dict[str, torch.Tensor] | None = None

    @property
    def cats(self) -> dict[str, dict[str, Any]]:
        """Per category: ``correct`` (L, A) and ``chance`` (A,) on the CPU, ``keypoints`` and ``pairs`` (ints)."""
        s = {k: v.cpu() for k, v in self.sums.items()}
        return {name: {"correct": s["correct"][c], "chance": s["chance"][c], "keypoints": int(s["keypoints"][c]),
                       "pairs": int(s["pairs"][c])} for c, name in enumerate(self.cat_names)}

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        """Every item of the batch is scored at once as the target of the item before it (the first item: of
        the last item of the previous batch), a 0/1 weight keeping only real pairs (a source followed by its
        target) with a keypoint visible in both and a non-empty box; the sums stay on the features' device.
        Nothing is read back (a labels-only dataset reads its labels, for the category names)."""
        if batch.extra.get("tiling") is None:
            grid = self.grid_of(batch)
            self._note(batch, grid)
            x = self._patch_features(feats, grid, batch.index)
            self._score(x, grid, self._annotations(len(batch), _batch_column(batch), x.device))
            self.n_images += len(batch)
            return
        for x, grid, it in self._items(feats, batch):  # a tiled item's grid is its own: one at a time
            self._score(x[None], grid, self._annotations(1, _item_column(it), x.device))
            self.n_images += 1

    def _annotations(self, n: int, column: Any, device: torch.device) -> dict[str, torch.Tensor]:
        """The n items' annotations as tensors on ``device``: ``pair``, ``role`` (n,), ``kp`` (n, K, 3) float64,
        ``size`` (n,) the PCK reference size, ``scale`` and ``shift`` (n, 2) (model-input pixels -> the pixels
        PCK is measured in: (xy - shift) / scale), ``cat`` (n,) rows of the category sums. ``column(key)`` is the
        n items' value of an annotation (a tensor or a list) or None."""
        pair, role, kp = column("pair"), column("role"), column("keypoints")
        if pair is None or role is None:
            raise VitscopeError("correspondence needs flattened pairs (extra['pair'], extra['role']: item 2p the "
                                "source, 2p + 1 the target); use a pairs dataset of the catalog")
        if kp is None:
            raise VitscopeError("correspondence needs keypoints (B, K, 3) in the batches")
        geo, src_ref, ref, box = column("geometry"), column("source_ref_size"), column("ref_size"), column("bbox")
        in_source = [src_ref is not None and geo is not None and geo[b] is not None for b in range(n)]
        if ref is not None:
            size = torch.as_tensor(ref, dtype=torch.float64)
        elif box is not None:
            bx = torch.as_tensor(box).double()
            size = torch.maximum(bx[:, 2] - bx[:, 0], bx[:, 3] - bx[:, 1])
        elif all(in_source):
            size = torch.zeros(n, dtype=torch.float64)
        else:
            raise VitscopeError("correspondence needs the target object's box (boxes) or extra['ref_size']")
        if any(in_source):  # scored in the file's pixels: PCK relative to the box at the original size
            size = torch.where(torch.tensor(in_source), torch.as_tensor(src_ref, dtype=torch.float64), size)
        maps = [(g.sx, g.sy, g.tx, g.ty) if s else (1.0, 1.0, 0.0, 0.0) for g, s in zip(geo or [None] * n, in_source,
                                                                                          strict=True)]
        maps = torch.tensor(maps, dtype=torch.float64).view(n, 4)
        cats = torch.tensor([self._category_row(c) for c in self._categories(n, column)], dtype=torch.long)
        out = {"pair": torch.as_tensor(pair).long(), "role": torch.as_tensor(role).long(),
               "kp": torch.as_tensor(kp).double(), "size": size, "scale": maps[:, :2], "shift": maps[:, 2:],
               "cat": cats}
        # to the device without a stream synchronisation (a pageable host source is staged at once)
        return {k: v.to(device, non_blocking=True) for k, v in out.items()}

    @staticmethod
    def _categories(n: int, column: Any) -> list[str]:
        """The n items' category names: ``category``, else the class label, else 'all'."""
        cats, labels = column("category"), column("label")
        if cats is None:
            cats = [None] * n
        if labels is not None and any(c is None for c in cats):
            labels = labels.tolist() if torch.is_tensor(labels) else list(labels)  # a labels-only dataset
        return [str(c) if c is not None else str(int(labels[b])) if labels is not None else "all"
                for b, c in enumerate(cats)]

    def _category_row(self, name: str) -> int:
        """The row of a category in the sums, a zero row appended for a new one."""
        if name not in self.cat_names:
            self.cat_names.append(name)
            for k in _CATEGORY_SUMS:
                v = self.sums[k]
                self.sums[k] = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
        return self.cat_names.index(name)

    def _previous(self, x: torch.Tensor, K: int) -> dict[str, torch.Tensor]:
        """The last item kept from the previous batch, its keypoints cut or padded (not visible) to K: an item
        that is no source (nothing kept) when there is none."""
        L, Dm = x.shape[1], x.shape[3]
        last = self.last
        if last is None:
            return {"x": x.new_zeros(L, K, Dm), "kp": torch.zeros(K, 3, dtype=torch.float64, device=x.device),
                    "pair": torch.full((), -1, dtype=torch.long, device=x.device),
                    "source": torch.zeros((), dtype=torch.bool, device=x.device)}
        last = {k: v.to(x.device) for k, v in last.items()}
        k = min(K, last["kp"].shape[0])
        xs, kp = x.new_zeros(L, K, Dm), torch.zeros(K, 3, dtype=torch.float64, device=x.device)
        xs[:, :k], kp[:k] = last["x"][:, :k], last["kp"][:k]
        return {**last, "x": xs, "kp": kp}

    def _score(self, x: torch.Tensor, grid: tuple[int, int], a: dict[str, torch.Tensor]) -> None:
        """Score items (B, L, S, D) as targets of the items before them and add to the sums (all tensor ops)."""
        B, L, S, Dm = x.shape
        kp = a["kp"]
        K = kp.shape[1]
        self.sums = {k: v.to(x.device) for k, v in self.sums.items()}
        last = self._previous(x, K)
        pred = None
        centres = self.centres(grid, x.device)
        if self.matching == "pixel":
            own, pred = self._pixel_pass(x, grid, kp, last["x"])
            centres = D.pixel_centres((grid[0] * self.patch_size, grid[1] * self.patch_size), x.device)
        else:
            tok = self._token_of(kp[..., :2].reshape(-1, 2), grid).view(B, K)
            own = torch.gather(x, 2, tok[:, None, :, None].expand(B, L, K, Dm))         # (B, L, K, D) sources
        is_src = a["role"] == 0
        prev_x = torch.cat([last["x"][None], own[:-1]])
        prev_kp = torch.cat([last["kp"][None], kp[:-1]])
        prev_pair = torch.cat([last["pair"][None], a["pair"][:-1]])
        prev_src = torch.cat([last["source"][None], is_src[:-1]])
        self.last = {"x": own[-1].clone(), "kp": kp[-1].clone(), "pair": a["pair"][-1].clone(),
                     "source": is_src[-1].clone()}  # copies: views would keep the whole batch's tensors alive
        paired = ~is_src & prev_src & (prev_pair == a["pair"])
        common = (prev_kp[..., 2] > 0) & (kp[..., 2] > 0)                                # (B, K)
        shown = common.any(1)
        boxed = a["size"] > 0
        scored = paired & shown & boxed
        self.sums["skips"] += torch.stack([is_src & prev_src, ~is_src & ~paired, paired & ~shown,
                                           paired & shown & ~boxed]).sum(1)
        correct, chance = D.pck_counts(prev_x, x, kp[..., :2], centres, a["size"], a["scale"], a["shift"],
                                       common & scored[:, None], self.alphas, pred=pred)
        cat = a["cat"]
        counted = (common & scored[:, None]).sum(1)  # (B,) keypoints scored per pair (0: not a scored pair)
        self.sums["correct"].index_add_(0, cat, correct)
        self.sums["chance"].index_add_(0, cat, chance)
        self.sums["keypoints"].index_add_(0, cat, counted)
        self.sums["pairs"].index_add_(0, cat, scored.long())
        self.sums["correct_sq"].index_add_(0, cat, correct.square())
        self.sums["correct_kp"].index_add_(0, cat, correct * counted[:, None, None])
        self.sums["keypoints_sq"].index_add_(0, cat, counted.square())

    def _pixel_pass(self, x: torch.Tensor, grid: tuple[int, int], kp: torch.Tensor, first: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixel-level matching (``matching: pixel``) of items (B, L, S, D), each the target of the item before it
        (the first: of ``first`` (L, K, D), the last item of the previous batch): returns the items' own features at
        their keypoints' pixels (B, L, K, D) and the predicted x, y (B, L, K, 2) in model-input pixels. One item and
        one layer's upsampled map (pixels x D) at a time."""
        B, L, _, _ = x.shape
        size = (grid[0] * self.patch_size, grid[1] * self.patch_size)
        centres = D.pixel_centres(size, x.device)
        pix = D.pixel_of(kp[..., :2], size)                                               # (B, K)
        own, pred = [], []
        prev = first
        for b in range(B):
            mine, guess = [], []
            for li in range(L):
                up = D.upsampled_tokens(x[b, li:li + 1], grid, size)[0]                   # (P, D)
                mine.append(up[pix[b]])
                guess.append(centres[D.pixel_matches(prev[li:li + 1], up[None])[0]])
            own.append(torch.stack(mine))
            pred.append(torch.stack(guess))
            prev = own[-1]
        return torch.stack(own).to(x.dtype), torch.stack(pred)

    def _variant_rows(self) -> list[str]:
        pixel = ["matching = pixel (bilinear upsampling, Walmer et al.)"] if self.matching == "pixel" else []
        return pixel + super()._variant_rows()

    def _token_of(self, xy: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        gh, gw = grid
        p = self.patch_size
        col = torch.clamp(torch.floor(xy[:, 0] / p), 0, gw - 1).long()
        row = torch.clamp(torch.floor(xy[:, 1] / p), 0, gh - 1).long()
        return row * gw + col

    def centres(self, grid: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        """(S, 2) x, y pixel centre of each token of a grid."""
        p = self.patch_size
        ys, xs = torch.meshgrid((torch.arange(grid[0], device=device) + 0.5) * p,
                                (torch.arange(grid[1], device=device) + 0.5) * p, indexing="ij")
        return torch.stack([xs.flatten(), ys.flatten()], 1).double()

    def merge(self, other: Analysis) -> None:
        assert isinstance(other, Correspondence) and other.layers == self.layers and other.alphas == self.alphas
        assert other.matching == self.matching and other.random_baseline == self.random_baseline
        dev = self.sums["skips"].device
        rows = torch.tensor([self._category_row(c) for c in other.cat_names], dtype=torch.long, device=dev)
        for k, v in other.sums.items():
            if k == "skips":
                self.sums[k] = self.sums[k] + v.to(dev)
            else:
                self.sums[k] = self.sums[k].index_add(0, rows, v.to(dev))
        self.skipped.update(other.skipped)
        self.n_images += other.n_images
        self._merge_protocol(other)

    def state_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "alphas": list(self.alphas), "cat_names": list(self.cat_names),
                "sums": host_copies(self.sums), "last": host_copies(self.last),
                "skipped": dict(self.skipped), "n_images": self.n_images, "protocol": self._protocol_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.alphas = list(state["layers"]), tuple(state["alphas"])
        self._load_protocol(state)
        self.cat_names = list(state["cat_names"])
        self.sums = host_copies(state["sums"])  # copies: the sums grow in place, the caller's state stays as it was
        self.last = host_copies(state["last"])
        self.skipped = Counter(state["skipped"])
        self.n_images = int(state["n_images"])

    def finalize(self) -> pd.DataFrame:
        if self.last is not None:
            self.sums["skips"][0] += self.last["source"].to(self.sums["skips"].device)  # a source without its target
            self.last = None
        skipped = self.skipped + Counter(dict(zip(_PAIR_SKIPS, self.sums["skips"].tolist(), strict=True)))
        rows: list[dict[str, Any]] = []
        every = self.cats
        cats = {k: v for k, v in sorted(every.items()) if v["keypoints"] > 0}
        if cats:
            correct = sum(v["correct"] for v in cats.values())
            n = sum(v["keypoints"] for v in cats.values())
            chance = sum(v["chance"] for v in cats.values())
            rows_of = [c for c, name in enumerate(self.cat_names) if name in cats]
            moments = {k: self.sums[k].cpu()[rows_of].sum(0).double().tolist()
                       for k in ("correct_sq", "correct_kp", "keypoints_sq")}
            pairs = sum(v["pairs"] for v in cats.values())
            for a, alpha in enumerate(self.alphas):
                m = f"pck@{alpha:g}"
                per_cat = {k: v["correct"][:, a].double() / v["keypoints"] for k, v in cats.items()}
                for li, set_ in enumerate([*self.layers, *(["random"] if self.random_baseline else [])]):
                    if set_ == "random":  # the Gaussian features: overall and mean over categories, no layer
                        _, se, lo, hi = I.ratio_interval(float(correct[li, a]), float(n), moments["correct_sq"][li][a],
                                                         moments["correct_kp"][li][a], moments["keypoints_sq"], pairs)
                        rows.append({"metric": m + "_random", "layer": None, "value": float(correct[li, a]) / n,
                                     "stderr": se, "value_lo": lo, "value_hi": hi, "interval_units": pairs})
                        rows.append({"metric": m + "_catmean_random", "layer": None,
                                     "value": float(np.mean([float(p[li]) for p in per_cat.values()]))})
                        continue
                    layer = set_
                    p = float(correct[li, a]) / n
                    _, se, lo, hi = I.ratio_interval(float(correct[li, a]), float(n), moments["correct_sq"][li][a],
                                                     moments["correct_kp"][li][a], moments["keypoints_sq"], pairs)
                    rows.append({"metric": m, "layer": layer, "value": p, "stderr": se, "value_lo": lo,
                                 "value_hi": hi, "interval_units": pairs})
                    rows.append({"metric": m + "_catmean", "layer": layer,
                                 "value": float(np.mean([float(p[li]) for p in per_cat.values()]))})
                    for k, p in per_cat.items():
                        rows.append({"metric": m, "layer": layer, "value": float(p[li]), "category": k})
                rows.append({"metric": m + "_chance", "layer": None, "value": float(chance[a]) / n})
                cat_chance = {k: float(v["chance"][a]) / v["keypoints"] for k, v in cats.items()}
                rows.append({"metric": m + "_catmean_chance", "layer": None,
                             "value": float(np.mean(list(cat_chance.values())))})
                rows += [{"metric": m + "_chance", "layer": None, "value": c, "category": k}
                         for k, c in cat_chance.items()]
        for r in rows:
            r["token_view"] = "spatial"
        rows += self._best_rows(rows, "pck@0.1")
        rows += [{"metric": "skipped", "reason": r, "value": float(n)} for r, n in sorted(skipped.items())]
        df = self._table(rows, "category")
        df["n_pairs"] = sum(v["pairs"] for v in every.values())
        df["n_keypoints"] = sum(v["keypoints"] for v in every.values())
        return self._protocol_columns(df)
