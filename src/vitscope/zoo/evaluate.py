"""Final accuracy of a zoo model for its card: weighted 20-NN and a linear probe on the full data.

Features are the CLS token and the mean of the patch tokens after the final norm (vitscope's
``final_norm`` tap, what the training monitor reads), of every train and test image of the zoo's data
(CIFAR-10: 50,000 / 10,000). k-NN: DINO's protocol (`vitscope.metrics.semantics.knn_classify`, k = 20,
T = 0.07); probe: multinomial logistic regression on standardised features, L-BFGS, 100 iterations
(`vitscope.metrics.semantics.linear_probe`). ``vitscope zoo evaluate DIR`` adds the numbers to DIR's card.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vitscope.data.transforms import normalize
from vitscope.metrics import semantics as S
from vitscope.zoo.train import CARD_FILE, WEIGHTS_FILE, write_card

if TYPE_CHECKING:
    from vitscope.zoo.arch import ZooArch

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


# The bar every zoo model must pass to be in the default study (issue 18): on the full CIFAR-10 test split,
# best block and view, against the untrained network (zoo-random) under the same protocol.
BAR = {"ssl_knn_over_random": 0.08, "ssl_probe_over_random": 0.10, "sup_knn": 0.60, "max_min_attn_dist": 0.50}


def passes_bar(objective: str, ev: dict[str, Any], random_ev: dict[str, Any], k: int = 20) -> list[str]:
    """Why ``ev`` (an `evaluate` result with per_block) fails the zoo's bar; empty when it passes."""
    why = []
    if objective == "supervised":
        if ev[f"knn{k}_cls"] < BAR["sup_knn"] and ev[f"best_knn{k}"] < BAR["sup_knn"]:
            why.append(f"20-NN {ev[f'best_knn{k}']:.3f} < {BAR['sup_knn']}")
    else:
        for m, margin in ((f"knn{k}", BAR["ssl_knn_over_random"]), ("probe", BAR["ssl_probe_over_random"])):
            gap = ev[f"best_{m}"] - random_ev[f"best_{m}"]
            if gap < margin:
                why.append(f"best-block {m} {ev[f'best_{m}']:.3f} is {gap:+.3f} over zoo-random's "
                           f"{random_ev[f'best_{m}']:.3f} (bar +{margin})")
    if ev["min_attn_dist"] > BAR["max_min_attn_dist"]:
        why.append(f"no block attends locally: smallest mean attention distance {ev['min_attn_dist']:.3f} > "
                   f"{BAR['max_min_attn_dist']} (uniform 0.591)")
    return why


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


def bar_failures(card: dict[str, Any]) -> list[str]:
    """Why a card's model fails the bar, as `tools/ship_zoo.py` recorded it under ``bar``; empty for a model that
    passes or a card without the record."""
    bar = card.get("bar") or {}
    return [] if bar.get("passes", True) else list(bar.get("why_not") or ["(no reason recorded)"])


def shipped_bar_failures(name: str) -> list[str]:
    """Why the shipped zoo model ``name`` fails the bar (its card's record); empty when it passes or is not a
    shipped zoo model."""
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
                synthetic_n: tuple[int, int] = (5000, 1000), per_block: bool = True) -> dict[str, Any]:
    """Evaluate ``run_dir/encoder.safetensors`` and write the result into ``run_dir/card.json`` under 'eval'."""
    run_dir = Path(run_dir)
    card = json.loads((run_dir / CARD_FILE).read_text())
    card["eval"] = evaluate(run_dir / WEIGHTS_FILE, data, synthetic_n=synthetic_n, per_block=per_block)
    write_card(run_dir, card)
    return card
