"""Final accuracy of a zoo model for its card: weighted 20-NN and a linear probe on the full data.

Features are the CLS token and the mean of the patch tokens after the final norm (vitscope's
``final_norm`` tap, what the training monitor reads), of every train and test image of the zoo's data
(CIFAR-10: 50,000 / 10,000). k-NN: DINO's protocol (`vitscope.metrics.semantics.knn_classify`, k = 20,
T = 0.07); probe: multinomial logistic regression on standardised features, L-BFGS, 100 iterations
(`vitscope.metrics.semantics.linear_probe`). ``vitscope zoo evaluate DIR`` adds the numbers to DIR's card.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vitscope.data.transforms import normalize
from vitscope.errors import VitscopeError
from vitscope.metrics import semantics as S
from vitscope.metrics.intervals import Z95
from vitscope.zoo.train import (
    CARD_FILE,
    DECODER_FILE,
    LOG_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    load_state,
    save_parts,
    write_card,
)

if TYPE_CHECKING:
    from vitscope.zoo.arch import ZooArch
    from vitscope.zoo.base import Objective

SUBSET = (500, 200)  # train, test images of the quick check (class-balanced, first files of each class)


@torch.no_grad()
def pooled_features(vm: Any, images: torch.Tensor, batch_size: int = 500) -> dict[str, torch.Tensor]:
    """CLS and GAP (patch tokens) of the ``final_norm`` tap for uint8 images (N, 3, H, W) at the model's size."""
    from vitscope.capture import Capture

    out: dict[str, list[torch.Tensor]] = {"cls": [], "gap": []}
    npt = vm.num_prefix_tokens
    with Capture(vm, ["final_norm"]) as cap:
        for i in range(0, len(images), batch_size):
            x = normalize(images[i:i + batch_size].float() / 255, vm.preprocessing)
            t = cap(x)["final_norm"]
            out["cls"].append(t[:, 0].float())
            out["gap"].append(t[:, npt:].float().mean(1))
    return {k: torch.cat(v) for k, v in out.items()}


@torch.no_grad()
def block_features(vm: Any, images: torch.Tensor, batch_size: int = 500) -> dict[str, list[torch.Tensor]]:
    """CLS and GAP of every block's output (``block{i}.out`` taps, before the final norm)."""
    from vitscope.capture import Capture

    depth = len(vm.model.blocks)
    taps = [f"block{i}.out" for i in range(depth)]
    out: dict[str, list[list[torch.Tensor]]] = {"cls": [[] for _ in taps], "gap": [[] for _ in taps]}
    npt = vm.num_prefix_tokens
    with Capture(vm, taps) as cap:
        for j in range(0, len(images), batch_size):
            got = cap(normalize(images[j:j + batch_size].float() / 255, vm.preprocessing))
            for i, t in enumerate(taps):
                out["cls"][i].append(got[t][:, 0].float())
                out["gap"][i].append(got[t][:, npt:].float().mean(1))
    return {v: [torch.cat(x) for x in out[v]] for v in out}


@torch.no_grad()
def attention_distances(vm: Any, images: torch.Tensor, batch_size: int = 100) -> list[float]:
    """Mean attention distance of every block on the unit square (`vitscope.metrics.attention`), averaged
    over heads and images; uniform attention on the zoo's 8x8 grid gives 0.591."""
    from vitscope.capture import Capture
    from vitscope.metrics.attention import attention_distance

    depth = len(vm.model.blocks)
    taps = [f"block{i}.attn" for i in range(depth)]
    sums = [0.0] * depth
    grid = tuple(vm.model.patch_embed.grid_size)
    with Capture(vm, taps) as cap:
        for j in range(0, len(images), batch_size):
            got = cap(normalize(images[j:j + batch_size].float() / 255, vm.preprocessing))
            for i, t in enumerate(taps):
                sums[i] += float(attention_distance(got[t].float(), grid, vm.num_prefix_tokens).mean(1).sum())
    return [x / len(images) for x in sums]


def evaluate(model: str | Path, data: str | Path | None = None, k: int = 20,
             synthetic_n: tuple[int, int] = (5000, 1000), per_block: bool = True,
             attn_images: int = 1000) -> dict[str, Any]:
    """k-NN and linear-probe top-1 of ``model`` (a zoo weights file or registry name) on the full data
    (``data`` and ``synthetic_n`` as for `vitscope.zoo.data.load_data`).

    per_block: also the 20-NN and probe of every block's CLS and GAP (block outputs) with the best of
        them ("best block and view", what the zoo's bar judges, `passes_bar`), and the mean attention
        distance of every block on the first ``attn_images`` test images."""
    import vitscope as vs
    from vitscope.zoo.data import load_data

    t0 = time.perf_counter()
    vm = vs.load_model(str(model))
    ds = load_data(data, size=vm.preprocessing.input_size, synthetic_n=synthetic_n)
    tr, te = pooled_features(vm, ds.train.images), pooled_features(vm, ds.test.images)
    ytr, yte = ds.train.labels, ds.test.labels
    c = len(ds.train.classes)
    out: dict[str, Any] = {"data": ds.description["name"], "n_train": len(ytr), "n_test": len(yte), "k": k,
                           "features": "final_norm: CLS and mean of patch tokens"}
    for view in ("cls", "gap"):
        out[f"knn{k}_{view}"] = S.knn_classify(tr[view], ytr, te[view], yte, ks=(k,), num_classes=c)[k][0]
        out[f"probe_{view}"] = S.linear_probe(tr[view], ytr, te[view], yte, num_classes=c)[0]
    # a small fixed subset (the first 50 train / 20 test images of each class), for a quick check of the card
    a, b = ds.train.balanced_subset(SUBSET[0]), ds.test.balanced_subset(SUBSET[1])
    out["subset"] = {"n_train": len(a), "n_test": len(b), f"knn{k}_cls": S.knn_classify(
        tr["cls"][a], ytr[a], te["cls"][b], yte[b], ks=(k,), num_classes=c)[k][0]}
    if per_block:
        btr, bte = block_features(vm, ds.train.images), block_features(vm, ds.test.images)
        blocks: dict[str, Any] = {}
        for view in ("cls", "gap"):
            blocks[f"knn{k}_{view}"] = [S.knn_classify(a, ytr, b, yte, ks=(k,), num_classes=c)[k][0]
                                        for a, b in zip(btr[view], bte[view], strict=True)]
            blocks[f"probe_{view}"] = [S.linear_probe(a, ytr, b, yte, num_classes=c)[0]
                                       for a, b in zip(btr[view], bte[view], strict=True)]
        blocks["attn_dist"] = attention_distances(vm, ds.test.images[:attn_images])
        out["blocks"] = blocks
        for m in (f"knn{k}", "probe"):
            best = max((v, f"{view}{i}") for view in ("cls", "gap") for i, v in enumerate(blocks[f"{m}_{view}"]))
            out[f"best_{m}"], out[f"best_{m}_at"] = best
        out["min_attn_dist"] = min(blocks["attn_dist"])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# -- masked image modelling: the objective's own loss on held-out images ------------------------------------
RECON_DRAWS = 5  # mask draws over the test images


def load_objective(run_dir: str | Path) -> Objective:
    """A trained masked-modelling objective rebuilt from a zoo run directory: its card (objective, architecture,
    hyper-parameters), its encoder (``encoder.safetensors``, as shipped) and its decoder (``decoder.safetensors``:
    MAE's decoder, SimMIM's mask token and prediction head; written from ``train_state.pt`` for a run trained
    before training wrote it), in eval mode."""
    from safetensors.torch import load_file

    import vitscope as vs

    run_dir = Path(run_dir)
    obj = _objective(json.loads((run_dir / CARD_FILE).read_text()))
    if not (run_dir / DECODER_FILE).is_file():
        if not (run_dir / STATE_FILE).is_file():
            raise CardError(f"{run_dir} has no {DECODER_FILE} (the decoder its reconstruction loss needs) and no "
                            f"{STATE_FILE} to take it from: train the model again with `vitscope zoo train`")
        obj.load_state_dict(load_state(run_dir / STATE_FILE)["objective"])  # a run from before training wrote it
        save_parts(obj, run_dir)
    obj.encoder.load_state_dict(vs.load_model(str(run_dir / WEIGHTS_FILE)).model.float().state_dict())
    obj.parts().load_state_dict(load_file(str(run_dir / DECODER_FILE)))
    return obj.eval()


def trivial_loss(objective: str, x: torch.Tensor, mask: torch.Tensor, patch: int, norm_pix: bool = True
                 ) -> torch.Tensor:
    """Per image, the training loss of a predictor that knows nothing but the visible pixels, on normalised images
    ``x`` (B, 3, H, W) with ``mask`` (B, N) True = hidden:
      * MAE with normalised-pixel targets: the per-patch mean of the target, i.e. 0; MSE over the masked
        patches (without ``norm_pix``: the image's visible pixels' mean per channel, as for SimMIM);
      * SimMIM: every masked pixel filled with the mean of the image's visible pixels per channel; L1 over the
        masked pixels."""
    from vitscope.zoo.arch import patchify

    t = patchify(x, patch)  # (B, N, p*p*3), channel last inside a patch
    m = mask.to(t.dtype)
    if objective == "mae" and norm_pix:
        mean, var = t.mean(-1, keepdim=True), t.var(-1, keepdim=True)
        err = (((t - mean) / (var + 1e-6) ** 0.5) ** 2).mean(-1)
    else:
        pix = t.reshape(*t.shape[:2], -1, 3)  # (B, N, p*p, 3)
        seen = (1 - m)[:, :, None, None]
        fill = (pix * seen).sum((1, 2)) / (seen.sum((1, 2)) * pix.shape[2]).clamp_min(1)  # (B, 3)
        diff = pix - fill[:, None, None, :]
        err = (diff ** 2 if objective == "mae" else diff.abs()).mean((2, 3))
    return (err * m).sum(1) / m.sum(1)


def model_loss(obj: Objective, x: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Per image, the trained objective's own loss on ``x`` under ``mask`` (MAE also takes the kept indices)."""
    from vitscope.zoo.arch import encode, patchify

    m = mask.float()
    if obj.name == "mae":
        pred = obj.decoder(encode(obj.encoder, x, keep=keep), keep, obj.arch.num_patches)
        err = ((pred - obj.target(x)) ** 2).mean(-1)
    else:
        tokens = encode(obj.encoder, x, mask=mask, mask_token=obj.mim.mask_token)
        err = (obj.mim.head(tokens[:, 1:]) - patchify(x, obj.arch.patch_size)).abs().mean(-1)
    return (err * m).sum(1) / m.sum(1)


@torch.no_grad()
def held_out_loss(obj: Objective, images: torch.Tensor, draws: int = RECON_DRAWS, batch_size: int = 500
                  ) -> dict[str, Any]:
    """A masked-modelling objective's loss on uint8 ``images`` (N, 3, H, W) with the training's masking (``draws``
    draws, seeded 0, 1, ...) against the trivial predictor's (`trivial_loss`) under the same masks: their ratio
    per draw, its mean, the spread over draws and a 95 % interval (the draws' spread and the images' sampling
    error, delta method)."""
    from vitscope.zoo.base import random_keep

    obj.eval()
    n = obj.arch.num_patches
    ratios, model_means, trivial_means = [], [], []
    per_image = torch.zeros(len(images), 2, dtype=torch.float64)
    for d in range(draws):
        g = torch.Generator().manual_seed(d)
        mod, tri = [], []
        for i in range(0, len(images), batch_size):
            x = normalize(images[i:i + batch_size].float() / 255, obj.preprocessing)
            if obj.name == "mae":
                keep, mask = random_keep(len(x), n, obj.mask_ratio, g)
            else:
                keep, mask = None, obj.mim.mask(len(x), g)
            mod.append(model_loss(obj, x, mask, keep).double())
            tri.append(trivial_loss(obj.name, x, mask, obj.patch_size, getattr(obj, "norm_pix_loss", True)).double())
        a, b = torch.cat(mod), torch.cat(tri)
        per_image += torch.stack([a, b], 1) / draws
        model_means.append(float(a.mean()))
        trivial_means.append(float(b.mean()))
        ratios.append(model_means[-1] / trivial_means[-1])
    r = sum(ratios) / draws
    sd = float(torch.tensor(ratios).std()) if draws > 1 else 0.0
    a, b = per_image[:, 0], per_image[:, 1]
    se_img = float((a - r * b).std() / b.mean() / math.sqrt(len(a)))  # delta method for a ratio of means
    half = Z95 * math.sqrt(sd ** 2 / draws + se_img ** 2)
    return {"loss": "normalised-pixel MSE on the masked patches" if obj.name == "mae" else "L1 on the masked pixels",
            "trivial": "the per-patch mean (0 for normalised targets)" if obj.name == "mae" else
            "the mean of the visible pixels per channel",
            "n_images": len(images), "draws": draws, "model": round(sum(model_means) / draws, 5),
            "trivial_loss": round(sum(trivial_means) / draws, 5), "ratio": round(r, 5),
            "ratio_per_draw": [round(x, 5) for x in ratios], "ratio_sd": round(sd, 5),
            "ratio_lo": round(r - half, 5), "ratio_hi": round(r + half, 5)}


def train_loss_curve(run_dir: str | Path) -> list[float]:
    """The training loss per epoch from a run's ``log.csv`` (empty without one)."""
    import pandas as pd

    path = Path(run_dir) / LOG_FILE
    log = pd.read_csv(path) if path.is_file() else pd.DataFrame()
    return [round(float(v), 5) for v in log["loss"].dropna()] if "loss" in log.columns else []


def reconstruction(run_dir: str | Path, data: Any = None, draws: int = RECON_DRAWS,
                   batch_size: int = 500, synthetic_n: tuple[int, int] = (5000, 1000)) -> dict[str, Any]:
    """The masked-modelling bar's evidence for a run directory with its trained decoder: `held_out_loss` of its
    trained objective on every test image, and the training loss per epoch from the run's log."""
    from vitscope.zoo.data import DataSource, load_data

    obj = load_objective(run_dir)
    ds = data if isinstance(data, DataSource) else load_data(data, size=obj.img_size, synthetic_n=synthetic_n)
    out = held_out_loss(obj, ds.test.images, draws, batch_size)
    return {**out, "decoder": "trained with the encoder", "train_loss": train_loss_curve(run_dir)}


REFIT_STEPS = 400  # 51,200 image-views at batch 128: a fifth of the zoo's training budget


def refit_decoder(run_dir: str | Path, encoder: str | Path, steps: int = REFIT_STEPS, data: Any = None,
                  draws: int = RECON_DRAWS, seed: int = 0, synthetic_n: tuple[int, int] = (5000, 1000)
                  ) -> dict[str, Any]:
    """A fresh decoder (MAE's decoder; SimMIM's mask token and head) fitted for ``steps`` training steps on the
    frozen ``encoder`` (a weights file or a model name: the run's own encoder, or the untrained network), with the
    run's objective, masking, loss, data pipeline and optimiser, then its `held_out_loss`. The same budget on the
    trained and on the untrained encoder separates what the encoder learned from what a decoder alone recovers.
    ``data``: as for `vitscope.zoo.data.load_data`, or a loaded `DataSource`."""
    import vitscope as vs
    from vitscope.zoo.data import Augment, DataSource, ViewStream, load_data
    from vitscope.zoo.train import TrainConfig, make_optimizer, train_step

    card = json.loads((Path(run_dir) / CARD_FILE).read_text())
    obj = _objective(card, seed)
    obj.encoder.load_state_dict(vs.load_model(str(encoder)).model.float().state_dict())
    obj.encoder.requires_grad_(False)
    ds = data if isinstance(data, DataSource) else load_data(data, size=obj.img_size, synthetic_n=synthetic_n,
                                                             seed=seed)
    pre = obj.preprocessing
    stream = ViewStream(ds.train, obj.views, card["budget"]["batch_size"], seed,
                        Augment(obj.views, obj.img_size, pre.mean, pre.std, obj.patch_size))
    opt, sched = make_optimizer(obj, TrainConfig(card["objective"], "unused"), steps)
    obj.train()
    obj.encoder.eval()  # frozen: no dropout either way, and no statistics to update
    for step in range(steps):
        train_step(obj, opt, sched, stream.batch(step), step, steps, 3.0)
    out = held_out_loss(obj, ds.test.images, draws)
    out.update({"encoder": str(encoder), "steps": steps, "image_views": steps * card["budget"]["batch_size"]})
    return out


def mim_evidence(run_dir: str | Path, data: str | Path | None = None, synthetic_n: tuple[int, int] = (5000, 1000),
                 steps: int = REFIT_STEPS) -> dict[str, Any]:
    """What a masked-modelling card holds besides its accuracies:
      * ``reconstruction``, the bar's evidence: the held-out loss ratio with the decoder trained with the encoder
        (`reconstruction`) where the run has it (``decoder.safetensors`` or ``train_state.pt``), else with a
        decoder re-fitted on the frozen encoder (`refit_decoder`), which the record says; and the training loss;
      * ``reconstruction_refit``, a finding: a decoder re-fitted for the same ``steps`` on this encoder and on the
        untrained network of the same seed (zoo-random at seed 0): how much of the reconstruction the encoder's
        training accounts for."""
    import tempfile

    from vitscope.zoo.data import load_data

    run_dir = Path(run_dir)
    card = json.loads((run_dir / CARD_FILE).read_text())
    ds = load_data(data, size=card["zoo_arch"]["img_size"], synthetic_n=synthetic_n, seed=int(card.get("seed", 0)))
    own = refit_decoder(run_dir, run_dir / WEIGHTS_FILE, steps, ds)
    with tempfile.TemporaryDirectory() as tmp:
        untrained = "zoo-random" if int(card.get("seed", 0)) == 0 and card["zoo_arch"] == _zoo_random_arch() else \
            write_untrained(tmp, int(card.get("seed", 0)), _arch(card))
        other = refit_decoder(run_dir, untrained, steps, ds)
    keys = ("ratio", "ratio_lo", "ratio_hi", "ratio_sd", "model", "trivial_loss")
    base = "zoo-random" if untrained == "zoo-random" else f"untrained, seed {card.get('seed')}"
    refit = {"steps": steps, "image_views": own["image_views"], "encoder": {k: own[k] for k in keys},
             "untrained": {**{k: other[k] for k in keys}, "network": base}}
    if (run_dir / DECODER_FILE).is_file() or (run_dir / STATE_FILE).is_file():
        rec = reconstruction(run_dir, ds)
    else:
        rec = {k: v for k, v in own.items() if k not in ("encoder", "steps", "image_views")}
        rec.update({"decoder": f"re-fitted on the frozen encoder ({steps} steps, {own['image_views']:,} image-views)",
                    "train_loss": train_loss_curve(run_dir)})
    return {"reconstruction": rec, "reconstruction_refit": refit}


def _arch(card: dict[str, Any]) -> ZooArch:
    from vitscope.zoo.arch import ZooArch

    return ZooArch(**card["zoo_arch"])


def _objective(card: dict[str, Any], seed: int = 0) -> Objective:
    """The card's objective (architecture, hyper-parameters) freshly built at ``seed``."""
    from vitscope.zoo.objectives import build_objective

    return build_objective(card["objective"], _arch(card), seed=seed, **card.get("hparams", {}))


def _zoo_random_arch() -> dict[str, Any]:
    card = shipped_card("zoo-random")
    return card["zoo_arch"] if card else {}


# -- the bar --------------------------------------------------------------------------------------------
# A zoo model is in the default study only if it learned its objective: each objective family is judged on its own
# evidence, always against the untrained network of the same initialisation (zoo-random); the accuracy margins of
# every model are reported as findings with their uncertainty (`margins`), not as conditions (docs/ZOO.md, "The bar").

FAMILY = {"supervised": "supervised", "dino": "contrastive", "mocov3": "contrastive", "hybrid": "contrastive",
          "mae": "masked", "simmim": "masked"}
BAR = {"supervised_knn_over_random": 0.15, "contrastive_knn_over_random": 0.08, "masked_loss_ratio": 0.8}
# Spread of the untrained network's numbers over four seeds (docs/ZOO.md, "The untrained network over seeds":
# `tools/zoo_untrained.py --seed 0..3`, the bar's protocol): a model and its reference are one seed draw each.
SEED_SD = {"knn20": 0.012, "probe": 0.010, "attn_dist": 0.009}
N_EVAL = 10_000  # CIFAR-10 test images: the binomial error of an accuracy


class CardError(VitscopeError):
    """A zoo card lacks a number its bar needs."""


@dataclass(frozen=True)
class Verdict:
    """The bar's verdict on one model: its family, the number judged with its 95 % interval, the threshold, and
    one sentence saying why it passes or fails."""

    family: str
    passes: bool
    criterion: str
    value: float
    lo: float
    hi: float
    threshold: float
    reason: str

    def record(self) -> dict[str, Any]:
        """What `tools/ship_zoo.py` writes into a card under ``bar``."""
        return {"family": self.family, "passes": self.passes, "criterion": self.criterion,
                "value": round(self.value, 4), "interval": [round(self.lo, 4), round(self.hi, 4)],
                "threshold": self.threshold, "reason": self.reason, "why_not": [] if self.passes else [self.reason]}


def _need(card: dict[str, Any], *path: str) -> Any:
    """``card[path[0]][path[1]]...``, or one sentence naming the missing field and the command that fills it."""
    node: Any = card
    for i, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            field = ".".join(path[:i + 1])
            raise CardError(f"the card of {card.get('name', 'this zoo model')} has no {field}: run `vitscope zoo "
                            "evaluate RUN_DIR` on its run directory to fill it")
        node = node[key]
    return node


def margin(card: dict[str, Any], random_card: dict[str, Any], metric: str = "knn20") -> tuple[float, float, float]:
    """(margin, low, high): the model's best-block ``metric`` ('knn20' or 'probe') over zoo-random's, with a 95 %
    interval from the seed spread (`SEED_SD`, one draw for each network) and the binomial error of each accuracy
    on `N_EVAL` images."""
    a, b = float(_need(card, "eval", f"best_{metric}")), float(_need(random_card, "eval", f"best_{metric}"))
    se = math.sqrt(2 * SEED_SD[metric] ** 2 + (a * (1 - a) + b * (1 - b)) / N_EVAL)
    return a - b, a - b - Z95 * se, a - b + Z95 * se


def _accuracy_bar(card: dict[str, Any], random_card: dict[str, Any], family: str, threshold: float) -> Verdict:
    m, lo, hi = margin(card, random_card, "knn20")
    passes = m >= threshold
    near = " (the threshold lies inside its interval)" if lo < threshold < hi else ""
    reason = (f"best-block 20-NN {card['eval']['best_knn20']:.3f} is {m:+.3f} [{lo:+.3f}, {hi:+.3f}] over zoo-random's "
              f"{random_card['eval']['best_knn20']:.3f}: {'at least' if passes else 'below'} the {family} bar "
              f"+{threshold:g}{near}")
    return Verdict(family, passes, "best-block 20-NN over zoo-random", m, lo, hi, threshold, reason)


def bar_supervised(card: dict[str, Any], random_card: dict[str, Any]) -> Verdict:
    """Supervised: the objective is the classes themselves, so its features must separate them far better than the
    untrained network's: best-block 20-NN at least zoo-random + 0.15 (seed 003's supervised ViTs lead every
    self-supervised one on k-NN; Walmer et al. 2023, Sec. 4)."""
    return _accuracy_bar(card, random_card, "supervised", BAR["supervised_knn_over_random"])


def bar_contrastive(card: dict[str, Any], random_card: dict[str, Any]) -> Verdict:
    """Contrastive and self-distillation objectives (DINO, MoCo v3) and the hybrid: their objective is invariance of
    the global token across views of an image, which is what k-NN on that token measures (DINO's own evaluation,
    Caron et al. 2021, Sec. 4.1): best-block 20-NN at least zoo-random + 0.08."""
    return _accuracy_bar(card, random_card, "contrastive", BAR["contrastive_knn_over_random"])


def bar_masked(card: dict[str, Any], random_card: dict[str, Any] | None = None) -> Verdict:
    """Masked image modelling (MAE, SimMIM): features are weak for k-NN and linear probes at any scale (He et al.
    2022, Sec. 4.3: linear probing is where MAE is weakest, fine-tuning where it is strongest), so a MIM model is
    judged on its own objective: on held-out images, with the training's masking and loss, the reconstruction loss
    is at most 0.8x that of a trivial predictor (`reconstruction`), and the training loss fell."""
    rec = _need(card, "eval", "reconstruction")
    ratio, lo, hi = float(rec["ratio"]), float(rec["ratio_lo"]), float(rec["ratio_hi"])
    curve = [float(x) for x in _need(card, "eval", "reconstruction", "train_loss")]
    threshold = BAR["masked_loss_ratio"]
    falls = len(curve) >= 2 and curve[-1] < curve[0]
    passes = ratio <= threshold and falls
    how = " (decoder re-fitted on the frozen encoder)" if str(rec.get("decoder", "")).startswith("re-fitted") else ""
    what = (f"held-out {rec['loss']}{how} is {ratio:.3f} [{lo:.3f}, {hi:.3f}] x the trivial predictor's "
            f"({rec['trivial']})")
    if not falls:
        why = f"its training loss did not fall ({curve[0]:.4g} -> {curve[-1]:.4g})" if curve else "no training loss"
        reason = f"{what}, but {why}"
    else:
        reason = (f"{what}: {'at most' if ratio <= threshold else 'above'} the masked-modelling bar {threshold:g}x; "
                  f"training loss {curve[0]:.4g} -> {curve[-1]:.4g}")
    return Verdict("masked", passes, "reconstruction loss / trivial predictor's", ratio, lo, hi, threshold, reason)


BARS: dict[str, Any] = {"supervised": bar_supervised, "contrastive": bar_contrastive, "masked": bar_masked}


def judge(card: dict[str, Any], random_card: dict[str, Any]) -> Verdict | None:
    """The bar's verdict on a zoo card (None for a model the bar does not judge: zoo-random, fine-tuned models).
    Raises `CardError` (one sentence) when the card lacks a number its family needs."""
    family = FAMILY.get(card.get("objective", ""))
    return None if family is None else BARS[family](card, random_card)


def margins(card: dict[str, Any], random_card: dict[str, Any]) -> dict[str, Any]:
    """The findings every card reports beside its verdict: the best-block 20-NN and probe margins over zoo-random
    with their 95 % intervals (`margin`), per block the change of mean attention distance from zoo-random
    (unit square; interval from its seed spread, `SEED_SD`), and for masked modelling the held-out loss ratio
    with a decoder re-fitted for the same budget on this encoder and on the untrained network."""
    out: dict[str, Any] = {}
    for metric in ("knn20", "probe"):
        m, lo, hi = margin(card, random_card, metric)
        out[metric] = {"margin": round(m, 4), "interval": [round(lo, 4), round(hi, 4)]}
    a = _need(card, "eval", "blocks", "attn_dist")
    b = _need(random_card, "eval", "blocks", "attn_dist")
    half = Z95 * math.sqrt(2) * SEED_SD["attn_dist"]
    out["attn_dist_change"] = {"per_block": [round(x - y, 4) for x, y in zip(a, b, strict=True)],
                               "half_width": round(half, 4)}
    refit = card["eval"].get("reconstruction_refit")
    if refit:  # masked modelling: the same decoder budget on this encoder and on the untrained network
        out["reconstruction_refit"] = {k: [refit[k]["ratio"], refit[k]["ratio_lo"], refit[k]["ratio_hi"]]
                                       for k in ("encoder", "untrained")} | {"steps": refit["steps"]}
    return out


def shipped_card(name: str) -> dict[str, Any] | None:
    """The card of the shipped zoo model ``name`` (beside its weights in the package), or None: not a zoo entry
    with a file, not trained yet, or an unreadable card."""
    from vitscope.models.load import package_file
    from vitscope.models.registry import REGISTRY

    spec = REGISTRY.get(name)
    if spec is None or not name.startswith("zoo-") or spec.weights.kind != "file":
        return None
    try:
        return json.loads((package_file(spec.weights.location).parent / CARD_FILE).read_text())
    except (OSError, ValueError):
        return None


def random_card() -> dict[str, Any]:
    """zoo-random's shipped card: the reference every bar and margin is measured against."""
    card = shipped_card("zoo-random")
    if card is None:
        raise CardError("zoo-random's card is missing from the package: run `python tools/ship_zoo.py --random`")
    return card


def bar_failures(card: dict[str, Any]) -> list[str]:
    """Why a card's model is kept out by the bar (`judge`, from the card's numbers against zoo-random's), as one
    clause: "it fails the zoo's bar: ..." or "the zoo's bar cannot judge it: ..." (a missing number); empty for a
    model that passes or that the bar does not judge."""
    try:
        v = judge(card, random_card())
    except CardError as e:
        return [f"the zoo's bar cannot judge it: {e}"]
    return [] if v is None or v.passes else [f"it fails the zoo's bar: {v.reason}"]


def shipped_bar_failures(name: str) -> list[str]:
    """Why the shipped zoo model ``name`` fails the bar; empty when it passes or is not a shipped zoo model."""
    card = shipped_card(name)
    return bar_failures(card) if card is not None else []


def write_untrained(out: str | Path, seed: int = 0, arch: ZooArch | None = None) -> Path:
    """zoo-random: the zoo's encoder as initialised at ``seed`` (``arch``, default `ZOO_ARCH`: mimetic attention,
    sin-cos positions), untrained, written like a trained zoo model (float16 ``encoder.safetensors`` +
    ``card.json``). With the default it is the encoder every self-supervised objective starts from at that seed
    (`build_objective` builds it first)."""
    from dataclasses import asdict

    from vitscope.models import save_checkpoint
    from vitscope.models.registry import ModelSpec, WeightSource
    from vitscope.zoo.arch import TIMM_ARCH, ZOO_ARCH, build_encoder, zoo_preprocessing

    arch = ZOO_ARCH if arch is None else arch
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vit = build_encoder(arch, 0)
    spec = ModelSpec(f"zoo-random-s{seed}", TIMM_ARCH, "none", "random init", WeightSource("none"),
                     zoo_preprocessing(arch.img_size), arch.kwargs(0),
                     notes=f"vitscope controlled zoo: the architecture as initialised at seed {seed}, untrained")
    save_checkpoint(vit, out / WEIGHTS_FILE, spec, half=True)
    card = {"name": spec.name, "objective": "none", "family": "none", "supervision": "random init", "seed": seed,
            "arch": {"timm": TIMM_ARCH, **{k: v for k, v in spec.model_kwargs.items()
                                           if k != "pretrained_cfg_overlay"}},
            "zoo_arch": asdict(arch), "image_views": 0, "weights": WEIGHTS_FILE}
    write_card(out, card)
    return out / WEIGHTS_FILE


def add_to_card(run_dir: str | Path, data: str | Path | None = None,
                synthetic_n: tuple[int, int] = (5000, 1000), per_block: bool = True,
                reconstruction_only: bool = False) -> dict[str, Any]:
    """Evaluate ``run_dir/encoder.safetensors`` and write the result into ``run_dir/card.json`` under 'eval'; a
    masked-modelling run also gets its reconstruction evidence (`mim_evidence`: what its bar judges, and the
    re-fitted decoders' comparison with the untrained network).
    reconstruction_only: keep the card's other numbers and add (or redo) only that."""
    run_dir = Path(run_dir)
    card = json.loads((run_dir / CARD_FILE).read_text())
    if not reconstruction_only:
        card["eval"] = evaluate(run_dir / WEIGHTS_FILE, data, synthetic_n=synthetic_n, per_block=per_block)
    if FAMILY.get(card.get("objective", "")) == "masked":
        card.setdefault("eval", {}).update(mim_evidence(run_dir, data, synthetic_n=synthetic_n))
    elif reconstruction_only:
        raise VitscopeError(f"{run_dir}: a {card.get('objective')} model has no reconstruction loss to evaluate "
                            "(only mae and simmim do)")
    write_card(run_dir, card)
    return card
