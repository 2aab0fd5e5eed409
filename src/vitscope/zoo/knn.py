"""The training monitor: weighted k-NN accuracy on CLS (and GAP) features, DINO's protocol.

Caron et al. 2021 (``dino/eval_knn.py``): L2-normalised features, cosine similarity to every train
feature, the k nearest vote with weights exp(sim / 0.07), the class with the largest vote wins. Run on a
fixed class-balanced subset (the first n/C images of each class of each split, the same for every
objective and seed), so it costs a few seconds per evaluation. The network's forward and the vote run on the
device of the network's parameters (the images are prepared on the CPU and moved there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vitscope.zoo.arch import encode
from vitscope.zoo.data import Augment, DataSource


@torch.no_grad()
def knn_accuracy(train_f: torch.Tensor, train_y: torch.Tensor, test_f: torch.Tensor, test_y: torch.Tensor,
                 k: int = 20, temperature: float = 0.07, num_classes: int | None = None,
                 chunk: int = 1024) -> float:
    """Fraction of test features whose weighted k-NN vote among the train features is their label (computed on
    the device of ``train_f``)."""
    c = int(num_classes if num_classes is not None else int(max(train_y.max(), test_y.max())) + 1)
    dev = train_f.device
    train_f = F.normalize(train_f.float(), dim=1)
    test_f = F.normalize(test_f.to(dev).float(), dim=1)
    train_y, test_y = train_y.to(dev), test_y.to(dev)
    k = min(k, train_f.shape[0])
    correct = 0
    for i in range(0, test_f.shape[0], chunk):
        sim = test_f[i:i + chunk] @ train_f.t()
        top, idx = sim.topk(k, dim=1)
        votes = torch.zeros(sim.shape[0], c, device=dev).scatter_add_(1, train_y[idx], (top / temperature).exp())
        correct += int((votes.argmax(1) == test_y[i:i + chunk]).sum())
    return correct / test_f.shape[0]


class KNNMonitor:
    """k-NN accuracy of a network's CLS and GAP (mean of patch tokens) features, train subset vs test subset."""

    def __init__(self, data: DataSource, augment: Augment, n_train: int = 5000, n_test: int = 2000, k: int = 20,
                 temperature: float = 0.07, batch_size: int = 256):
        self.train_idx = data.train.balanced_subset(n_train)
        self.test_idx = data.test.balanced_subset(n_test)
        self.data, self.augment = data, augment
        self.k, self.temperature, self.batch_size = k, temperature, batch_size
        self.num_classes = len(data.train.classes)

    def _inputs(self, net: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """Normalised images (prepared on the CPU) on the device of ``net``."""
        x = self.augment.plain(images)
        p = next(net.parameters(), None)
        return x if p is None or p.device == x.device else x.to(p.device)

    @torch.no_grad()
    def features(self, net: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cls, gap = [], []
        npt = int(getattr(net, "num_prefix_tokens", 1))
        for i in range(0, images.shape[0], self.batch_size):
            t = encode(net, self._inputs(net, images[i:i + self.batch_size]))
            cls.append(t[:, 0])
            gap.append(t[:, npt:].mean(1))
        return torch.cat(cls), torch.cat(gap)

    @torch.no_grad()
    def block_features(self, net: nn.Module, images: torch.Tensor, attn_images: int = 0
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """CLS and GAP features of every block's output (before the final norm), and the mean attention
        distance per block (unit square, averaged over heads and the first ``attn_images`` images)."""
        from vitscope.metrics.attention import attention_distance

        blocks = list(net.blocks)
        outs: list[list[torch.Tensor]] = [[] for _ in blocks]
        dist: list[list[torch.Tensor]] = [[] for _ in blocks]
        npt = int(getattr(net, "num_prefix_tokens", 1))
        grid = tuple(net.patch_embed.grid_size)
        want_attn = [0]

        def out_hook(i: int):
            return lambda _m, _inp, out: outs[i].append(out)

        def attn_hook(i: int):
            def hook(m: nn.Module, inp: tuple[torch.Tensor, ...]) -> None:
                if want_attn[0] <= 0:
                    return
                x = inp[0][:want_attn[0]]
                b, n, c = x.shape
                qkv = m.qkv(x).reshape(b, n, 3, m.num_heads, c // m.num_heads).permute(2, 0, 3, 1, 4)
                q, k = m.q_norm(qkv[0]), m.k_norm(qkv[1])
                a = (q * m.scale @ k.transpose(-2, -1)).softmax(-1)
                dist[i].append(attention_distance(a.float(), grid, npt).mean(1))
            return hook

        handles = [b.register_forward_hook(out_hook(i)) for i, b in enumerate(blocks)]
        handles += [b.attn.register_forward_pre_hook(attn_hook(i)) for i, b in enumerate(blocks)]
        try:
            for i in range(0, images.shape[0], self.batch_size):
                want_attn[0] = max(0, min(attn_images - i, self.batch_size))
                encode(net, self._inputs(net, images[i:i + self.batch_size]))
        finally:
            for h in handles:
                h.remove()
        cls = [torch.cat([o[:, 0] for o in blk]) for blk in outs]
        gap = [torch.cat([o[:, npt:].mean(1) for o in blk]) for blk in outs]
        return cls, gap, [float(torch.cat(d).mean()) if d else float("nan") for d in dist]

    @torch.no_grad()
    def __call__(self, net: nn.Module, per_block: bool = False) -> dict[str, float]:
        """k-NN of the final CLS and GAP; with ``per_block`` also the best block's (CLS or GAP, the block
        outputs before the final norm) and the smallest per-block mean attention distance (256 test images;
        uniform attention on the 8x8 grid gives 0.591)."""
        was_training = net.training
        net.eval()
        try:
            tr_c, tr_g = self.features(net, self.data.train.images[self.train_idx])
            te_c, te_g = self.features(net, self.data.test.images[self.test_idx])
            if per_block:
                btr_c, btr_g, _ = self.block_features(net, self.data.train.images[self.train_idx])
                bte_c, bte_g, dist = self.block_features(net, self.data.test.images[self.test_idx], 256)
        finally:
            net.train(was_training)
        ytr, yte = self.data.train.labels[self.train_idx], self.data.test.labels[self.test_idx]
        args = {"k": self.k, "temperature": self.temperature, "num_classes": self.num_classes}
        row = {"knn_cls": knn_accuracy(tr_c, ytr, te_c, yte, **args),
               "knn_gap": knn_accuracy(tr_g, ytr, te_g, yte, **args)}
        if per_block:
            accs = [(knn_accuracy(a, ytr, b, yte, **args), f"{view}{i}")
                    for view, trs, tes in (("cls", btr_c, bte_c), ("gap", btr_g, bte_g))
                    for i, (a, b) in enumerate(zip(trs, tes, strict=True))]
            best = max(accs)
            row.update({"knn_best": best[0], "knn_best_at": best[1],
                        "attn_dist_min": min(dist), "attn_dist_min_block": int(min(range(len(dist)),
                                                                                 key=dist.__getitem__))})
        return row
