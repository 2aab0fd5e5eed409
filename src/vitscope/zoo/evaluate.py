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
from typing import Any

import torch

from vitscope.data.transforms import normalize
from vitscope.metrics import semantics as S
from vitscope.zoo.train import CARD_FILE, WEIGHTS_FILE, write_card

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


def evaluate(model: str | Path, data: str | Path | None = None, k: int = 20,
             synthetic_n: tuple[int, int] = (5000, 1000)) -> dict[str, Any]:
    """k-NN and linear-probe top-1 of ``model`` (a zoo weights file or registry name) on the full data
    (``data`` and ``synthetic_n`` as for `vitscope.zoo.data.load_data`)."""
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
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def add_to_card(run_dir: str | Path, data: str | Path | None = None,
                synthetic_n: tuple[int, int] = (5000, 1000)) -> dict[str, Any]:
    """Evaluate ``run_dir/encoder.safetensors`` and write the result into ``run_dir/card.json`` under 'eval'."""
    run_dir = Path(run_dir)
    card = json.loads((run_dir / CARD_FILE).read_text())
    card["eval"] = evaluate(run_dir / WEIGHTS_FILE, data, synthetic_n=synthetic_n)
    write_card(run_dir, card)
    return card
