"""The invariance lens of Merlin et al., "What happens during finetuning of ViTs: an invariance based
investigation" (2023): STIR (Nanda et al., ICML 2022) between two models, and for a pretrained -> fine-tuned
pair learning, forgetting, cka divergence and the Invariance Flow matrix; over a fine-tuning run's checkpoints
the dynamics and their Pearson correlation with accuracy on corrupted data (their Sec. 4.4).

  stir   a pair analysis (model A, model B; A = the pretrained model when B is ``finetuned_from`` A). Per
         batch: A and B are inverted at every requested tap (`vitscope.invariance.invert`; A's inversions are
         kept in the study cache and serve every B compared with A, e.g. every checkpoint of a fine-tuning
         run), each inversion is measured by both models at every tap, and the unbiased HSIC_1 terms of each
         (inverted tap, measured tap) are summed over all batches (`StirSums`): exact minibatch CKA, merge and
         resume by addition. ``cka_estimator: last_batch_biased`` reports the public STIR code's CKA instead
         (the biased linear CKA of the last batch alone; its published numbers use it): see docs/INVARIANCE.md.

Rows (model = A, model_b = B; ``layer`` is A's block, ``layer_b`` B's):
  stir_b|a         STIR(B[layer_b] | A[layer])  (A inverted at ``layer``), with ``spread`` over repeats
  stir_a|b         STIR(A[layer] | B[layer_b])  (B inverted at ``layer_b``)
  cka              CKA(A[layer], B[layer_b]) on the clean images
  forgetting       1 - STIR(B[i] | A[i]);  learning  1 - STIR(A[i] | B[i]);  cka_divergence  1 - CKA(A[i], B[i])
  forgetting_vs_self / learning_vs_self   the same with the first term of Merlin et al.'s eqs. 2-3 measured,
                   STIR(A[i] | A[i]) - STIR(B[i] | A[i]) and STIR(B[i] | B[i]) - STIR(A[i] | B[i]), on the same
                   inversions: the share of 1 - STIR that is due to imperfect inversions cancels
  invariance_flow  STIR(B[layer_b] | A[layer]) - STIR(B[layer] | A[layer])  (pt layer, ft layer)
  flow_compression / flow_expansion / flow_compressed_layers / flow_expanded_layers / flow_mean_shift
  fidelity_a / fidelity_b   CKA of a model's own layer on X and on its inversion X' (measured self-STIR; STIR
                   of a layer with itself is 1 by definition), inversion_error_a / _b the mean relative error
  accuracy         B's top-1 accuracy on the clean images and on each corruption (column ``corruption``), when
                   B has a classifier head for the dataset's labels (``head_classes``: its label space, e.g.
                   cifar100 for a 100-way head)
  learning_forgetting_r   Pearson r of learning and forgetting across the layers (Merlin et al. App. C.1; column
                   ``p``: its p-value)
  cka_divergence_layers   cka divergence averaged over ``cka_layers`` (the paper's layers 1-8 baseline; column
                   ``layers``)
Over a fine-tuning run's checkpoints (the cross-model stage, `dynamics`): ``dynamics:<series>`` per epoch,
``pearson_r`` / ``pearson_p`` of each series with the corrupted accuracy, ``hypothesis`` (App. E.1: r of every
aggregate hypothesis with the target; columns p, p_bonferroni, family, quantity, aggregate, layer_set, layers,
hypotheses, paper) and ``pearson_up_to_epoch`` (Fig. 14: r of the paper's hypothesis with the target over the
epochs up to ``epoch``; column p). The target (column ``target``) is ``robustness_accuracy`` -- the mean head
accuracy over every corruption and severity of the ``corruptions`` analysis's table, when ``robustness_data``
names the dataset that analysis ran on (e.g. CIFAR-10-C / CIFAR-100-C in the ``corrupted`` format) -- else
``corrupted_accuracy``, B's accuracy on the corruptions generated on the STIR images.
Every row carries the settings it was computed with (iterations, step_size, repeats, images, cka_estimator).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from vitscope import invariance as INV
from vitscope.bounds import Count, Iterations, Positive
from vitscope.capture.taps import parse_tap
from vitscope.capture.views import VIEWS
from vitscope.data import perturb as P
from vitscope.errors import VitscopeError
from vitscope.metrics import intervals as I
from vitscope.metrics import invariance as M

if TYPE_CHECKING:
    from vitscope.analyses.base import DataSizes
    from vitscope.data.base import Batch
    from vitscope.models.adapter import ModelInfo, ViTModel

from vitscope.analyses.base import Forwards, PairAnalysis, register_analysis

# corruptions of the dynamics: the robustness lens's (`vitscope.data.perturb`), with CIFAR-10-C's constants
# (made for 32-px images); default Gaussian noise, Gaussian blur and contrast at severities 3 and 5
DEFAULT_CORRUPTIONS = ("gaussian_noise", "gaussian_blur", "contrast")
CORRUPTION_TABLE = "cifar"


def _parse_corruptions(spec: Any) -> list[tuple[str, int]]:
    if spec in (None, "none", False):
        return []
    if spec == "default":
        spec = DEFAULT_CORRUPTIONS
    out = []
    for item in spec:
        kind, _, sev = str(item).partition(":")
        sevs = [int(v) for v in sev.split(",")] if sev else [3, 5]
        for s in sevs:
            if s == 0:
                raise VitscopeError(f"stir: corruption {item!r}: severity 0 is the clean image; severities are 1..5")
            P.check_corruption(kind, s)
            P.check_backend([kind], "native", CORRUPTION_TABLE)
            out.append((kind, s))
    return out


# ---------------------------------------------------------------------------------------------------------------


def _mean_spread(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample standard deviation over axis 0 (the repeats), NaN-aware; the spread of one repeat is 0."""
    with np.errstate(all="ignore"):
        fin = np.isfinite(arr)
        cnt = fin.sum(0)
        mean = np.where(cnt > 0, np.nansum(np.where(fin, arr, 0), 0) / np.maximum(cnt, 1), np.nan)
        if arr.shape[0] > 1:
            sd = np.nanstd(np.where(fin, arr, np.nan), 0, ddof=1)
        else:
            sd = np.where(cnt > 0, 0.0, np.nan)
    return mean, sd


def _repeat_interval(arr: np.ndarray) -> dict[str, np.ndarray]:
    """Over axis 0 (the repeats): ``stderr`` = spread / √R and the 95 % interval ``value_lo``, ``value_hi`` = mean ±
    t(R - 1) · stderr (`vitscope.metrics.intervals.mean_interval`; NaN with one repeat)."""
    out = I.mean_interval(arr)
    return {k: out[k] for k in ("stderr", "value_lo", "value_hi")}


def _at(cols: dict[str, np.ndarray], *idx: int) -> dict[str, float]:
    return {k: float(v[idx]) for k, v in cols.items()}


def _block(tap: str) -> int | None:
    return parse_tap(tap)[0]


@register_analysis
class Stir(PairAnalysis):
    """STIR (Nanda et al., ICML 2022) both ways between a pretrained model A and a model B fine-tuned from it,
    per layer pair, and Merlin et al.'s learning, forgetting, cka divergence and Invariance Flow; over a
    fine-tuning run's checkpoints, the dynamics and their Pearson correlation with corrupted accuracy.
    The inversion follows the public STIR code (step, start, loss, best iterate; docs/INVARIANCE.md). Its CKA
    does not by default: ``cka_estimator: minibatch_unbiased`` (default) sums the unbiased HSIC_1 terms over
    every batch, so every image counts and the value does not depend on the batch size; ``last_batch_biased``
    is the public code's estimator (its default ``linear_CKA``: the biased linear CKA of each batch, the last
    batch's value kept), which the published STIR numbers of Nanda et al. and Merlin et al. use (500 images in
    batches of 250: the second 250); docs/INVARIANCE.md compares the two on a zoo pair. The
    ``cka`` / ``cka_divergence`` rows use the same estimator; every row names it (column ``cka_estimator``).

    Over ``repeats`` (inversions from other start noise), the STIR grids, learning, forgetting (and their
    ``_vs_self`` forms) and the Invariance Flow carry ``spread`` (the standard deviation over the repeats),
    ``stderr`` = spread / √repeats and the 95 % interval ``value_lo``, ``value_hi`` = mean ± t(repeats - 1) ·
    stderr (Student's t: 4.30 at 3 repeats; `vitscope.metrics.intervals.mean_interval`; NaN with one repeat). It is
    the uncertainty of the inversions' randomness on these images, not of the choice of images
    (benchmarks/calibration.py, docs/CALIBRATION.md). The flow summaries (maxima and counts of the mean flow)
    carry their spread only."""

    name = "stir"
    description = ("STIR both ways between two models per layer pair; learning, forgetting, cka divergence and "
                   "the Invariance Flow of a pretrained -> fine-tuned pair (Merlin et al.)")
    needs = frozenset()
    state_version = 6  # 6: repeat intervals (stderr, value_lo, value_hi);
    # 2: forgetting_vs_self / learning_vs_self rows; same model = same encoder; 3: the
    # corruptions are the robustness lens's (CIFAR-10-C table); 4: derived metrics carry their spread; 5: the
    # last batch's biased CKA terms kept beside the sums (cka_estimator), column cka_estimator
    STATE_KEYS = ("ba", "ab", "aa", "bb")
    #: images every batch needs (the unbiased HSIC_1 of a batch): a study refuses a selection leaving fewer
    #: before any model loads (`vitscope.study.run.check_batch_sizes`)
    min_batch = 4

    @classmethod
    def views(cls, params: Any) -> list[str]:
        """Only the clean images; called by the planner at configuration, so an unknown ``cka_estimator`` is one
        sentence before any model loads."""
        M.check_cka_estimator(params.get("cka_estimator", M.CKA_ESTIMATORS[0]))
        return ["clean"]

    def __init__(self, info_a: ModelInfo, info_b: ModelInfo, *, layers: Any = None, tap: str = "out",
                 iterations: Iterations = INV.DEFAULT_ITERATIONS, step_size: Positive = INV.DEFAULT_STEP,
                 repeats: Count = 1,
                 view: str = "all", match_view: str = "all", init: str = "noise", seed: int = 0,
                 max_rows: Count | None = None, corruptions: Any = "default",
                 cka_estimator: str = "minibatch_unbiased", head_classes: str | None = None,
                 robustness_data: str | None = None, cka_layers: Sequence[int] | None = None, **params: Any):
        params.pop("pairs", None)  # which pairs: the planner's business
        if params:
            raise VitscopeError(f"stir: unknown parameter(s) {', '.join(sorted(params))}; it takes layers, tap, "
                                "iterations, step_size, repeats, view, match_view, init, seed, max_rows, corruptions, "
                                "cka_estimator, head_classes, robustness_data, cka_layers")
        self.cka_estimator = M.check_cka_estimator(cka_estimator)
        from vitscope.analyses.robustness import check_head_classes

        check_head_classes("stir", head_classes)
        self.head_classes = head_classes
        self.robustness_data = None if robustness_data in (None, "", "none") else str(robustness_data)
        super().__init__(info_a, info_b)
        if info_a.depth != info_b.depth:
            raise VitscopeError(f"stir: {info_a.name} has {info_a.depth} blocks and {info_b.name} {info_b.depth}; "
                                "the per-layer comparison needs the same depth")
        depth = info_a.depth
        if layers is None or layers == "all":
            layers = list(range(depth))
        layers = [layers] if isinstance(layers, int) else list(layers)
        for i in layers:
            if not -depth <= int(i) < depth:
                raise VitscopeError(f"stir: layer {i} is out of range for a {depth}-block model")
        self.layers = sorted({int(i) % depth for i in layers})
        from vitscope.capture.taps import BLOCK_TAPS

        if tap not in BLOCK_TAPS:
            from vitscope.errors import UnknownTapError, close_matches

            hint = close_matches(str(tap), BLOCK_TAPS, n=3)
            raise UnknownTapError(f"stir: tap {tap!r} is not a per-block tap" + (f"; did you mean {', '.join(hint)}?"
                                  if hint else "") + f" Choose one of {', '.join(BLOCK_TAPS)}.")
        self.taps = [f"block{i}.{tap}" for i in self.layers]
        self.cka_layers = _cka_layers(cka_layers, depth)
        if view not in VIEWS or match_view not in VIEWS:
            raise VitscopeError(f"stir: unknown token view {view!r} / {match_view!r}; choose from {', '.join(VIEWS)}")
        if int(repeats) < 1 or int(iterations) < 0:
            raise VitscopeError("stir: repeats must be >= 1 and iterations >= 0")
        self.tap, self.view, self.match_view, self.init = tap, view, match_view, init
        self.iterations, self.step_size = int(iterations), float(step_size)
        self.repeats, self.seed = int(repeats), int(seed)
        self.max_rows = max_rows
        self.corruptions = _parse_corruptions(corruptions)
        n = len(self.taps)
        self.sums = {k: INV.StirSums(self.repeats, n, n) for k in self.STATE_KEYS}
        self.cka = torch.zeros(n, n, 3, dtype=torch.float64)
        self.cka_last = torch.zeros(n, n, 3, dtype=torch.float64)  # biased terms of the last batch
        self.cka_last_key = -1  # its highest image id
        self.correct = torch.zeros(1 + len(self.corruptions), dtype=torch.long)
        self.n_images = 0
        self.same_model: bool | None = None
        self.has_head: bool | None = None
        self.cache_hits = 0

    # -- the store of A's inversions ---------------------------------------------------------------------------
    def _inv_key(self) -> str:
        return (f"stir-inv-{self.tap}-{'_'.join(map(str, self.layers))}-it{self.iterations}-s{self.step_size:g}-"
                f"{self.init}-{self.match_view}-seed{self.seed}")

    def _store_dir(self) -> Path:
        d = Path(self.store(self._inv_key()))
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _invert(self, vm: ViTModel, x: torch.Tensor, ids: torch.Tensor, r: int, cached: bool) -> INV.Inversion:
        """Inversions at every tap, as float16 pixels (so a fresh and a cached inversion measure the same)."""
        from safetensors.torch import load_file, save_file

        d = self._store_dir() if cached else None
        f = None
        if d is not None:
            f = d / f"r{r}-{int(ids[0])}-{int(ids[-1])}-{len(ids)}-{_ids_digest(ids)}.safetensors"
            if f.exists():
                t = load_file(str(f))
                self.cache_hits += 1
                return self._from_pixels(vm, t["pixels"], t["rel_error"])
        inv = INV.invert(vm, x, self.taps, iterations=self.iterations, step_size=self.step_size, init=self.init,
                         seed=self.seed, repeat=r, ids=ids, view=self.match_view, max_rows=self.max_rows)
        err = torch.where(inv.diverged, torch.full_like(inv.rel_error, math.inf), inv.rel_error)
        pix = inv.pixels.to(torch.float16)
        if f is not None:
            tmp = f.with_suffix(f".tmp{os.getpid()}")
            save_file({"pixels": pix.contiguous(), "rel_error": err.float().contiguous()}, str(tmp))
            os.replace(tmp, f)
        return self._from_pixels(vm, pix, err)

    @staticmethod
    def _from_pixels(vm: ViTModel, pix: torch.Tensor, err: torch.Tensor) -> INV.Inversion:
        pre = vm.preprocessing
        mean = torch.tensor(pre.mean).view(1, 1, 3, 1, 1)
        std = torch.tensor(pre.std).view(1, 1, 3, 1, 1)
        p = pix.float()
        return INV.Inversion(images=(p - mean) / std, pixels=p, rel_error=err.float(),
                             diverged=~torch.isfinite(err), taps=[])

    # -- cost ------------------------------------------------------------------------------------------------
    def own_forwards(self, vm_a: ViTModel, vm_b: ViTModel, data: DataSizes) -> list[Forwards]:
        """Per batch of B images, with L taps: each model reads the batch (one forward each); per repeat, A is
        inverted (a forward of its targets, then per chunk of rows, `vitscope.invariance.inversion_chunks`,
        ``iterations`` steps with gradients and a last forward without; the rows of a tap leave after its block),
        its inversions are measured by both models (one forward of L x B images each), and B is inverted and
        measured the same way; where B's classifier head covers the dataset's classes, one forward of the clean
        and the corrupted images gives its accuracy. A's inversions are kept in the study cache (``once``): every
        B compared with A reads them back. B's are counted even where B has A's encoder (and reuses A's
        inversions), which only its weights tell."""
        n_taps, deep = len(self.taps), max(self.layers) + 1  # a pass that reads the taps stops after the deepest
        n_out = getattr(getattr(vm_b.model, "head", None), "out_features", None)
        accuracy = data.classes is not None and bool(n_out) and int(data.classes) <= int(n_out)
        sums: dict[tuple[str, bool, str], list[int]] = {}

        def add(model: str, calls: int, images: int, blocks: int | None, gradients: bool = False,
                once: str = "") -> None:
            row = sums.setdefault((model, gradients, once), [0, 0, 0])
            row[0] += calls
            row[1] += images
            row[2] += images * (vm_a if model == "a" else vm_b).depth if blocks is None else blocks

        once = self._inv_key()
        for b in data.batches:
            for side in ("a", "b"):
                add(side, 1, b, b * deep)  # the clean features
            chunks = INV.inversion_chunks(n_taps, b, self.max_rows)
            for _ in range(self.repeats):
                for side, kept in (("a", once), ("b", "")):
                    add(side, 1, b, b * deep, once=kept)  # the inversion's targets
                    for chunk in chunks:
                        rows = sum(n for _, _, n in chunk)
                        blocks = sum(n * (self.layers[g] + 1) for g, _, n in chunk)
                        if self.iterations:
                            add(side, self.iterations, self.iterations * rows, self.iterations * blocks,
                                gradients=True, once=kept)
                        add(side, 1, rows, blocks, once=kept)  # the error of the last iterate
                    for measured in ("a", "b"):
                        add(measured, 1, n_taps * b, n_taps * b * deep)
            if accuracy:
                add("b", 1, b * (1 + len(self.corruptions)), None)
        return [Forwards(c, i, gradients=g, blocks=k, model=m, once=o) for (m, g, o), (c, i, k) in sums.items()]

    # -- accumulation ------------------------------------------------------------------------------------------
    def _measure_all(self, vm: ViTModel, inv: INV.Inversion) -> list[list[torch.Tensor]]:
        n_l, b = inv.images.shape[:2]
        feats = INV.measure(vm, inv.images.flatten(0, 1), self.taps, self.view)
        return [[f[j * b:(j + 1) * b] for f in feats] for j in range(n_l)]

    def update(self, vm_a: ViTModel, vm_b: ViTModel, batch: Batch) -> None:
        if self.same_model is None:
            INV.check_pair(vm_a, vm_b)
            self.same_model = INV.same_weights(vm_a, vm_b, self.taps)
        x, ids = batch.images, batch.index.cpu().long()
        if len(x) < self.min_batch:
            raise VitscopeError(f"stir: a batch of {len(x)} images; the unbiased CKA needs at least {self.min_batch} "
                                "per batch")
        fa = INV.measure(vm_a, x, self.taps, self.view)
        fb = INV.measure(vm_b, x, self.taps, self.view)
        key = int(ids.max())
        newest = key > self.cka_last_key
        n = len(self.taps)
        # the features live on the models' device, the sums on the host: every pair's terms in one copy
        unbiased, biased = INV.terms_on_host([(fa[i], fb[j]) for i in range(n) for j in range(n)])
        self.cka += unbiased.view(n, n, 3)
        if newest:
            self.cka_last.copy_(biased.view(n, n, 3))
        if newest:
            self.cka_last_key = key
        with torch.enable_grad():
            for r in range(self.repeats):
                inv_a = self._invert(vm_a, x, ids, r, cached=True)
                keep_a = ~inv_a.diverged
                for j, (mb, ma) in enumerate(zip(self._measure_all(vm_b, inv_a), self._measure_all(vm_a, inv_a),
                                                 strict=True)):
                    self.sums["ba"].add(r, j, fb, mb, keep_a[j], inv_a.rel_error[j], key)
                    self.sums["aa"].add(r, j, fa, ma, keep_a[j], inv_a.rel_error[j], key)
                if self.same_model:
                    inv_b = inv_a
                else:
                    inv_b = self._invert(vm_b, x, ids, r, cached=False)
                keep_b = ~inv_b.diverged
                for j, (ma, mb) in enumerate(zip(self._measure_all(vm_a, inv_b), self._measure_all(vm_b, inv_b),
                                                 strict=True)):
                    self.sums["ab"].add(r, j, fa, ma, keep_b[j], inv_b.rel_error[j], key)
                    self.sums["bb"].add(r, j, fb, mb, keep_b[j], inv_b.rel_error[j], key)
        self._accuracy(vm_b, batch)
        self.n_images += len(x)

    def _accuracy(self, vm: ViTModel, batch: Batch) -> None:
        if batch.labels is None:
            return
        if self.has_head is None:
            n_out = getattr(getattr(vm.model, "head", None), "out_features", None)
            if self.head_classes is not None:
                from vitscope.analyses.robustness._common import HEAD_SIZES, check_head_size

                check_head_size("stir", vm, self.head_classes)
                n_out = HEAD_SIZES.get(self.head_classes) if n_out else None  # 'none': the head is not used
            self.has_head = bool(n_out) and int(batch.labels.max()) < int(n_out)
        if not self.has_head:
            return
        pre = vm.preprocessing
        dev = batch.images.device  # the model's, in a study (the corruptions are made there too)
        mean = torch.tensor(pre.mean, device=dev).view(1, 3, 1, 1)
        std = torch.tensor(pre.std, device=dev).view(1, 3, 1, 1)
        u = (batch.images.float() * std + mean).clamp(0, 1)
        xs = [batch.images] + [(P.corrupt_batch(u, batch.index.cpu(), self.seed, k, s, "native", CORRUPTION_TABLE)
                                - mean) / std for k, s in self.corruptions]
        with torch.inference_mode():
            logits = vm.model(torch.cat(xs).to(next(vm.model.parameters()).device)).float().cpu()
        pred = logits.argmax(-1).view(len(xs), -1)
        self.correct += (pred == batch.labels.cpu().view(1, -1)).sum(1)

    def merge(self, other: Stir) -> None:
        for k in self.STATE_KEYS:
            self.sums[k].merge(other.sums[k])
        self.cka += other.cka
        if other.cka_last_key > self.cka_last_key:
            self.cka_last, self.cka_last_key = other.cka_last.clone(), other.cka_last_key
        self.correct += other.correct
        self.n_images += other.n_images
        self.cache_hits += other.cache_hits
        for flag in ("same_model", "has_head"):
            if getattr(self, flag) is None:
                setattr(self, flag, getattr(other, flag))

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{k}.{n}": v for k in self.STATE_KEYS for n, v in self.sums[k].state_dict().items()}
        out.update(cka=self.cka.clone(), cka_last=self.cka_last.clone(), cka_last_key=self.cka_last_key,
                   correct=self.correct.clone(), n_images=self.n_images,
                   flags=json.dumps({"same_model": self.same_model, "has_head": self.has_head}))
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self.STATE_KEYS:
            self.sums[k].load_state_dict({n: state[f"{k}.{n}"] for n in INV.StirSums.KEYS})
        self.cka = torch.as_tensor(state["cka"]).clone()
        self.cka_last = torch.as_tensor(state["cka_last"]).clone()
        self.cka_last_key = int(state["cka_last_key"])
        self.correct = torch.as_tensor(state["correct"]).clone()
        self.n_images = int(state["n_images"])
        flags = json.loads(state["flags"])
        self.same_model, self.has_head = flags["same_model"], flags["has_head"]

    # -- results -----------------------------------------------------------------------------------------------
    def _grid(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """STIR over the repeats: (mean, spread) of the (J inverted, I measured) grid."""
        return _mean_spread(self.sums[key].values(self.cka_estimator).numpy())

    def _per_repeat(self, key: str) -> np.ndarray:
        """(R, J inverted, I measured) STIR per repeat; with a model compared with itself, the diagonal is 1."""
        arr = self.sums[key].values(self.cka_estimator).numpy().copy()
        if self.same_model:
            idx = np.arange(arr.shape[1])
            arr[:, idx, idx] = 1.0
        return arr

    def finalize(self) -> pd.DataFrame:
        import warnings

        base = {"token_view": self.view, "iterations": self.iterations, "step_size": self.step_size,
                "repeats": self.repeats, "images": self.n_images, "cka_estimator": self.cka_estimator}
        rows: list[dict[str, Any]] = []
        L = self.layers
        # per repeat (a model compared with itself: its diagonal 1 by definition), then mean and spread
        r_ba, r_ab = self._per_repeat("ba"), self._per_repeat("ab")  # [r, j inverted, i measured]
        (s_ba, sd_ba), (s_ab, sd_ab) = _mean_spread(r_ba), _mean_spread(r_ab)
        ci_ba, ci_ab = _repeat_interval(r_ba), _repeat_interval(r_ab)
        for j, lj in enumerate(L):
            for i, li in enumerate(L):
                rows.append({"metric": "stir_b|a", "layer": lj, "layer_b": li, "value": s_ba[j, i],
                             "spread": sd_ba[j, i], **_at(ci_ba, j, i)})
                rows.append({"metric": "stir_a|b", "layer": li, "layer_b": lj, "value": s_ab[j, i],
                             "spread": sd_ab[j, i], **_at(ci_ab, j, i)})
        cka = M.stir_from_sums(self.cka if self.cka_estimator == "minibatch_unbiased" else self.cka_last).numpy()
        for i, li in enumerate(L):
            for j, lj in enumerate(L):
                rows.append({"metric": "cka", "layer": li, "layer_b": lj, "value": cka[i, j]})
        # pretrained (A) -> fine-tuned (B); each metric per repeat, then its mean and spread over the repeats
        d_ba, d_ab = np.diagonal(r_ba, axis1=1, axis2=2), np.diagonal(r_ab, axis1=1, axis2=2)  # (R, L)
        # eqs. 2-3 with their first term measured (the within-model STIR of the same inversions, < 1 when the
        # inversions are imperfect) instead of its ideal value 1: the inversion-quality floor cancels
        if self.same_model:
            f_a, f_b = d_ba, d_ab
        else:
            f_a = np.diagonal(self._per_repeat("aa"), axis1=1, axis2=2)
            f_b = np.diagonal(self._per_repeat("bb"), axis1=1, axis2=2)
        per_layer = {"forgetting": M.forgetting(d_ba), "learning": M.learning(d_ab),
                     "forgetting_vs_self": f_a - d_ba, "learning_vs_self": f_b - d_ab}
        div = M.cka_divergence(np.diag(cka))  # no inversion in it: exact, no spread
        for i, li in enumerate(L):
            for name, per_r in per_layer.items():
                m, sd = _mean_spread(per_r[:, i])
                rows.append({"metric": name, "layer": li, "layer_b": li, "value": float(m), "spread": float(sd),
                             **_at(_repeat_interval(per_r[:, i]))})
            rows.append({"metric": "cka_divergence", "layer": li, "layer_b": li, "value": float(div[i]),
                         "spread": 0.0})
        rows += self._layer_summaries(per_layer, div)
        if np.isfinite(s_ba).all():
            flow = M.flow_matrix(s_ba)  # linear in STIR: the flow of the mean = the mean of the repeats' flows
            flows = np.stack([M.flow_matrix(r) for r in r_ba])
            flow_sd, flow_ci = _mean_spread(flows)[1], _repeat_interval(flows)
            for i, li in enumerate(L):
                for j, lj in enumerate(L):
                    rows.append({"metric": "invariance_flow", "layer": li, "layer_b": lj, "value": flow[i, j],
                                 "spread": flow_sd[i, j], **_at(flow_ci, i, j)})
            per_r = [M.flow_summary(f) for f in flows] if np.isfinite(flows).all() else []
            for k, v in M.flow_summary(flow).items():  # maxima and counts of the mean flow: a spread, no interval
                sd = _mean_spread(np.array([p[k] for p in per_r], dtype=float))[1] if per_r else 0.0
                rows.append({"metric": f"flow_{k}", "value": v, "spread": float(sd)})
        for side, key in (("a", "aa"), ("b", "bb")):
            fid, _ = self._grid(key)
            s = self.sums[key]
            for j, lj in enumerate(L):
                n = int(s.images[:, j].sum())
                lay = {"layer": lj} if side == "a" else {"layer_b": lj}
                rows.append({"metric": f"fidelity_{side}", **lay, "value": fid[j, j]})
                rows.append({"metric": f"inversion_error_{side}", **lay,
                             "value": float(s.err_sum[:, j].sum() / n) if n else math.nan})
                if int(s.diverged[:, j].sum()):
                    rows.append({"metric": f"diverged_{side}", **lay, "value": float(s.diverged[:, j].sum())})
        if self.has_head and self.n_images:
            names = ["clean"] + [f"{k}:{s}" for k, s in self.corruptions]
            for name, c in zip(names, self.correct.tolist(), strict=True):
                rows.append({"metric": "accuracy", "corruption": name, "value": c / self.n_images})
        df = pd.DataFrame([{**base, **r} for r in rows])
        bad = ~np.isfinite(df["value"].astype(float))
        if bad.any():
            lost = sorted(set(df.loc[bad, "metric"]))
            warnings.warn(f"stir {self.model_a} -> {self.model_b}: {int(bad.sum())} values could not be computed "
                          f"(every inversion diverged, or constant features) and are left out: {', '.join(lost)}",
                          RuntimeWarning, stacklevel=2)
            df = df[~bad]
        if "spread" in df.columns:
            df["spread"] = df["spread"].astype(float).fillna(0.0) if len(df) else df["spread"]
        return self.tidy(df.to_dict("records"))

    def _layer_summaries(self, per_layer: dict[str, np.ndarray], div: np.ndarray) -> list[dict[str, Any]]:
        """Rows over the layers of this pair: learning vs forgetting's Pearson r across layers (Merlin et al. App.
        C.1, on the means over the repeats) and cka divergence averaged over ``cka_layers``."""
        rows: list[dict[str, Any]] = []
        lrn = _mean_spread(per_layer["learning"])[0]
        fgt = _mean_spread(per_layer["forgetting"])[0]
        r, p = M.pearson(lrn, fgt)
        if math.isfinite(r):
            rows.append({"metric": "learning_forgetting_r", "value": r, "p": p, "spread": 0.0})
        pos = [i for i, li in enumerate(self.layers) if li in self.cka_layers]
        if pos:
            rows.append({"metric": "cka_divergence_layers", "value": float(np.mean(div[pos])), "spread": 0.0,
                         "layers": _span(self.layers[i] for i in pos)})
        return rows

    @classmethod
    def key_numbers(cls, df: pd.DataFrame) -> pd.DataFrame:
        """Per pair: mean learning / forgetting / cka divergence over layers, flow compression / expansion,
        accuracy, the settings; per fine-tuning run: Pearson r (p) of each dynamics series."""
        rows = []
        d = df[df["model_b"].notna() & ~df.metric.astype(str).str.startswith(("dynamics:", "pearson", "hypothesis"))]
        for (a, b), g in d.groupby(["model", "model_b"], sort=False):
            row: dict[str, Any] = {"pair": f"{a} -> {b}"}
            for m in ("learning", "forgetting", "cka_divergence"):
                row[m] = g[g.metric == m]["value"].astype(float).mean()
            for m in ("flow_compression", "flow_expansion"):
                v = g[g.metric == m]["value"]
                row[m.replace("flow_", "")] = float(v.iloc[0]) if len(v) else math.nan
            acc = g[g.metric == "accuracy"]
            if len(acc):
                row["accuracy"] = float(acc[acc.corruption == "clean"]["value"].mean())
                row["corrupted acc."] = float(acc[acc.corruption != "clean"]["value"].mean())
            r0 = g.iloc[0]
            row["settings"] = (f"{int(r0.get('images'))} img, {int(r0.get('iterations'))} it, "
                               f"{int(r0.get('repeats'))} rep, "
                               + (f"{r0.get('cka_estimator')} CKA, " if "cka_estimator" in g.columns else "")
                               + f"{len(g[g.metric == 'forgetting'])} layers")
            rows.append(row)
        pr = df[df.metric == "pearson_r"]
        for _, r in pr.iterrows():
            p = df[(df.metric == "pearson_p") & (df.model_b == r.model_b) & (df.series == r.series)]["value"]
            rows.append({"pair": f"{r.model} -> {r.model_b} (epochs)", "series": r.series, "pearson r": r.value,
                         "p": float(p.iloc[0]) if len(p) else math.nan})
        hyp = df[df.metric == "hypothesis"]
        for _, r in hyp[hyp["paper"].astype(bool)].iterrows() if "paper" in hyp.columns else []:
            rows.append({"pair": f"{r.model} -> {r.model_b} (epochs)", "pearson r": r.value, "p": r.p,
                         "series": f"paper: {r['aggregate']}({r['quantity']}) layers {r['layers']}",
                         "Bonferroni p": r.p_bonferroni})
        return pd.DataFrame(rows).head(60)

    # -- dynamics over a fine-tuning run's checkpoints ------------------------------------------------------------
    #: other analyses whose finished per-model tables the cross-model stage hands to `cross` (``inputs``)
    cross_reads = ("corruptions",)

    @classmethod
    def cross(cls, analyses: list, inputs: dict[str, list[tuple[Any, pd.DataFrame]]] | None = None
              ) -> pd.DataFrame | None:
        """The dynamics of every fine-tuning run (two or more checkpoints); ``inputs``: the ``corruptions``
        analysis's (analysis, table) per model, read when ``robustness_data`` names its dataset."""
        runs: dict[tuple[str, str], list] = {}
        for a in analyses:
            if getattr(a, "epoch", None) is None:
                continue
            runs.setdefault((a.model_a, a.model_b.split("@")[0]), []).append(a)
        target = robustness_target(analyses, inputs)
        out = [dynamics(sorted(v, key=lambda a: a.epoch), *k, target=target) for k, v in runs.items() if len(v) >= 2]
        out = [d for d in out if d is not None and len(d)]
        return pd.concat(out, ignore_index=True) if out else None


def _cka_layers(spec: Any, depth: int) -> list[int]:
    """The 0-based blocks ``cka_layers`` names (None: the first 8, Merlin et al.'s layers 1-8, or all of a shallower
    model); one sentence for a block out of range."""
    if spec is None:
        return list(range(min(8, depth)))
    spec = [spec] if isinstance(spec, int) else list(spec)
    bad = [i for i in spec if not -depth <= int(i) < depth]
    if bad or not spec:
        raise VitscopeError(f"stir: cka_layers {spec} must name blocks 0..{depth - 1} of a {depth}-block model")
    return sorted({int(i) % depth for i in spec})


def _span(blocks: Any) -> str:
    """0-based blocks as the paper's 1-based layers: '1-8' for a contiguous run, else '1,3,5'."""
    b = [int(x) + 1 for x in blocks]
    if len(b) > 1 and b == list(range(b[0], b[-1] + 1)):
        return f"{b[0]}-{b[-1]}"
    return ",".join(map(str, b))


def robustness_target(analyses: Sequence[Stir], inputs: dict[str, list[tuple[Any, pd.DataFrame]]] | None
                      ) -> dict[str, float] | None:
    """Per model label, the mean head accuracy over every (corruption, severity) of the ``corruptions`` analysis
    run on the dataset ``robustness_data`` names (the mean accuracy on the corrupted test sets, as Merlin et al.
    Sec. 4.4 average CIFAR-10-C / CIFAR-100-C); None when no stir names one. A dataset the corruptions analysis
    did not run on, or a model without head rows there, is a ResultWarning (its epochs then have no target)."""
    import warnings

    from vitscope.errors import ResultWarning

    wanted = {a.robustness_data for a in analyses if getattr(a, "robustness_data", None)}
    if not wanted:
        return None
    name = sorted(wanted)[0]
    got = [(x, f) for x, f in (inputs or {}).get("corruptions", []) if (getattr(x, "datasets", None) or {})
           .get("data") == name and f is not None and len(f)]
    if not got:
        warnings.warn(f"stir: robustness_data {name!r} is not the dataset of a corruptions analysis in this "
                      "study; add `corruptions: {dataset: " + name + ", head_classes: ...}` to its analyses",
                      ResultWarning, stacklevel=2)
        return {}
    out: dict[str, float] = {}
    for _, f in got:
        if not {"readout", "severity"} <= set(f.columns):
            continue
        d = f[(f.metric == "accuracy") & (f.readout == "head") & (pd.to_numeric(f.severity, errors="coerce") > 0)]
        for model, g in d.groupby("model", sort=False):
            out[str(model)] = float(g["value"].astype(float).mean())
    return out


def _per_layer(df: pd.DataFrame, metric: str) -> np.ndarray:
    """A metric's per-layer values of one pair's table, in layer order."""
    d = df[df.metric == metric].sort_values("layer")
    return d["value"].to_numpy(dtype=float)


def _layer_matrix(frames: list[pd.DataFrame], metric: str) -> np.ndarray | None:
    """(epochs, layers) of a per-layer metric; None when an epoch lacks a layer (values left out as non-finite)."""
    rows = [_per_layer(df, metric) for df in frames]
    if not rows or len({len(r) for r in rows}) != 1 or not len(rows[0]):
        return None
    return np.stack(rows)


def dynamics(runs: Sequence[Stir], model_a: str, model_b: str, target: dict[str, float] | None = None
             ) -> pd.DataFrame | None:
    """Per-epoch aggregates of one fine-tuning run (one finished `Stir` per checkpoint) and the Pearson
    correlation of each with the mean accuracy over the corruptions (Merlin et al. Sec. 4.4: std of forgetting
    across layers 2..L, their best aggregate, among others); the hypothesis search of their App. E.1 and the
    correlation up to each epoch of their Fig. 14. ``target``: the robustness accuracy per checkpoint's model
    label (`robustness_target`); None: B's accuracy on the corruptions generated on the STIR images."""
    frames = [(a.epoch, a.finalize()) for a in runs]
    series: dict[str, list[float]] = {}
    acc: list[float] = []
    epochs = []
    cka_layers = runs[0].cka_layers
    for ep, df in frames:
        epochs.append(ep)
        for metric in ("forgetting", "learning", "cka_divergence"):
            v = _per_layer(df, metric)
            series.setdefault(f"{metric}_mean", []).append(float(np.mean(v)) if len(v) else math.nan)
            series.setdefault(f"{metric}_std", []).append(float(np.std(v)) if len(v) else math.nan)
            deep = v[1:]  # layers 2..L in the paper's 1-based numbering
            series.setdefault(f"{metric}_std_from_layer2", []).append(float(np.std(deep)) if len(deep) else math.nan)
        c = df[df.metric == "cka_divergence_layers"]["value"]
        series.setdefault("cka_divergence_mean_cka_layers", []).append(float(c.iloc[0]) if len(c) else math.nan)
        a = df[(df.metric == "accuracy") & (df.get("corruption", pd.Series(dtype=str)) != "clean")]
        acc.append(float(a["value"].mean()) if len(a) else math.nan)
        c = df[(df.metric == "accuracy") & (df.get("corruption", pd.Series(dtype=str)) == "clean")]
        series.setdefault("clean_accuracy", []).append(float(c["value"].mean()) if len(c) else math.nan)
    rows = []
    common = {"model": model_a, "model_b": model_b, "analysis": "stir"}
    for ep, v in zip(epochs, acc, strict=True):
        rows.append({**common, "metric": "dynamics:corrupted_accuracy", "epoch": ep, "value": v})
    for name, vals in series.items():
        for ep, v in zip(epochs, vals, strict=True):
            rows.append({**common, "metric": f"dynamics:{name}", "epoch": ep, "value": v})
        r, p = M.pearson(vals, acc)  # clean accuracy too: the baseline any series that grows with training meets
        if math.isfinite(r):
            rows.append({**common, "metric": "pearson_r", "series": name, "target": "corrupted_accuracy",
                         "value": r, "epochs": len(epochs)})
            rows.append({**common, "metric": "pearson_p", "series": name, "target": "corrupted_accuracy",
                         "value": p, "epochs": len(epochs)})
    goal, goal_name = acc, "corrupted_accuracy"
    if target is not None:
        goal, goal_name = [target.get(a.model_b, math.nan) for a in runs], "robustness_accuracy"
        for ep, v in zip(epochs, goal, strict=True):
            rows.append({**common, "metric": "dynamics:robustness_accuracy", "epoch": ep, "value": v})
    rows += _hypotheses(runs, [df for _, df in frames], epochs, goal, goal_name, common, cka_layers)
    return pd.DataFrame(rows)


def _hypotheses(runs: Sequence[Stir], frames: list[pd.DataFrame], epochs: list, goal: list[float], goal_name: str,
                common: dict[str, Any], cka_layers: list[int]) -> list[dict[str, Any]]:
    """Rows of Merlin et al.'s App. E.1 search (``hypothesis``) and Fig. 14 (``pearson_up_to_epoch``: the paper's
    hypothesis, std of forgetting over layers 2..L, against the target over the first n epochs)."""
    lrn, fgt = _layer_matrix(frames, "learning"), _layer_matrix(frames, "forgetting")
    div = _layer_matrix(frames, "cka_divergence")
    if lrn is None or fgt is None or lrn.shape != fgt.shape or lrn.shape[1] < 2:
        return []
    if div is not None and div.shape != lrn.shape:
        div = None
    blocks = runs[0].layers
    rows = []
    extra = {"target": goal_name, "epochs": len(epochs)}
    for h in M.hypothesis_search(lrn, fgt, div, goal, blocks=blocks):
        if not math.isfinite(h["r"]):  # a constant series (the std of one layer): no r, still counted (hypotheses)
            continue
        rows.append({**common, **extra, "metric": "hypothesis", "value": h.pop("r"),
                     "series": f"{h['aggregate']}:{h['quantity']}:{h['layer_set']}", **h})
    paper = M.aggregate(fgt, range(1, fgt.shape[1]), "std")
    for ep, (r, p) in zip(epochs, M.pearson_up_to(paper, goal), strict=True):
        if math.isfinite(r):
            rows.append({**common, **extra, "metric": "pearson_up_to_epoch", "epoch": ep, "value": r, "p": p,
                         "series": f"std:forgetting:layers {_span(blocks[1:])}"})
    return rows


def _ids_digest(ids: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha1(ids.numpy().astype(np.int64).tobytes()).hexdigest()[:10]
