"""Cost of the `similarity` analysis beyond the `cka` analysis alone, both on the same features.

Two ViT-S/16 models (pretrained=False: only their shapes matter here), 13 taps (``embed`` and the 12 block
outputs), the 'gap' token view for both analyses; similarity with its defaults (``--grid matched``: each tap of A
with B's at the same depth; ``cross``: the 13 x 13 grid across the pair; ``full``: and within each model),
N images at 224 px. The forward passes are the same for both analyses and are left out: each analysis is fed
the same synthetic (B, 197, 384) features per tap (Gaussian, a decaying spectrum over channels and a shared
mean, so the SVDs see a realistic spread), and the seconds of its updates, finalize (within-model grids) and
cross stage (the pair, with nulls and intervals) are timed. Then the similarity measures one at a time on the
same subset (prepare, the pairs, the nulls and the jackknife), the nulls and the jackknife alone, and the
floor (mean CCA alone: a cross product and one decomposition per pair and replicate), to say which part
dominates.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/similarity.py [--images 2048] [--null-pairs last] [--grid full]
"""

from __future__ import annotations

import argparse
import time
import types

import numpy as np
import torch

import vitscope as vs
from vitscope.analyses import get_analysis
from vitscope.analyses.similarity import WITHOUT_NULL
from vitscope.metrics import similarity as M

TAPS = ["embed"] + [f"block{i}.out" for i in range(12)]


def features(b: int, start: int, model: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * model + start)
    scale = (torch.arange(384) + 1.0) ** -0.5
    shared = torch.randn(b, 1, 384, generator=g)
    return {t: (torch.randn(b, 197, 384, generator=g) + shared * (i + 1) / 13) * scale + 0.5
            for i, t in enumerate(TAPS)}


class Fed(types.SimpleNamespace):
    """A batch of features fed by hand: its image ids and positions."""

    def __len__(self) -> int:
        return len(self.index)


def feed(analyses: list, n: int, batch: int, model: int) -> float:
    spent = 0.0
    for s in range(0, n, batch):
        b = min(batch, n - s)
        feats = features(b, s, model)
        bt = Fed(index=torch.arange(s, s + b), extra={"position": torch.arange(s, s + b)})
        for a in analyses:
            t0 = time.perf_counter()
            a.update(feats, bt)
            spent += time.perf_counter() - t0
    return spent


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--subset", type=int, default=2000)
    p.add_argument("--permutations", type=int, default=99)
    p.add_argument("--groups", type=int, default=10)
    p.add_argument("--null-pairs", default="last")
    p.add_argument("--no-split", action="store_true", help="stop after the totals and the cross stage's split")
    p.add_argument("--grid", default="matched", choices=["matched", "cross", "full"],
                   help="the layer pairs the measures are computed for (the analysis's default: matched)")
    args = p.parse_args()
    torch.set_num_threads(1)
    vms = [vs.load_model("vit_small_patch16_224", pretrained=False, seed=i) for i in range(2)]
    for i, vm in enumerate(vms):
        vm.name = f"vit_s_{i}"
    cka = [get_analysis("cka")(vm, taps=TAPS, views=["gap"]) for vm in vms]
    sim = [get_analysis("similarity")(vm, taps=TAPS, view="gap", n_subset=args.subset,
                                      n_permutations=args.permutations, n_groups=args.groups,
                                      null_pairs=args.null_pairs, grid=args.grid) for vm in vms]
    upd = {"cka": 0.0, "similarity": 0.0}
    for i in range(2):
        upd["cka"] += feed([cka[i]], args.images, args.batch, i)
        upd["similarity"] += feed([sim[i]], args.images, args.batch, i)
    times = {}
    for name, pair in (("cka", cka), ("similarity", sim)):
        _, fin = timed(lambda pair=pair: [a.finalize() for a in pair])
        table, cross = timed(lambda pair=pair: type(pair[0]).cross(pair))
        times[name] = {"updates": upd[name], "finalize": fin, "cross": cross, "rows": len(table)}
        times[name]["total"] = upd[name] + fin + cross
    print(f"{args.images} images, 2 x ViT-S/16 (synthetic features), 13 taps, gap view, one thread; similarity's "
          f"grid '{args.grid}' ({len(sim[0]._grid_pairs(sim[1]))} pairs across the models"
          f"{', and 91 within each' if args.grid == 'full' else ''})")
    for name, t in times.items():
        print(f"  {name:10s} updates {t['updates']:7.2f} s  finalize {t['finalize']:7.2f} s  "
              f"cross {t['cross']:7.2f} s  total {t['total']:7.2f} s  ({t['rows']} cross rows)")
    for a in sim:
        a.null_pairs = "none"
    _, bare = timed(lambda: type(sim[0]).cross(sim))
    for a in sim:
        a.null_pairs, a.n_groups = args.null_pairs, 0
    _, nulls = timed(lambda: type(sim[0]).cross(sim))
    for a in sim:
        a.n_groups, a.n_permutations = args.groups, 0
    _, jack = timed(lambda: type(sim[0]).cross(sim))
    print(f"  similarity cross stage: its pairs alone {bare:.2f} s; {args.permutations} permutations of the "
          f"'{args.null_pairs}' pairs {nulls - bare:.2f} s; the jackknife over {args.groups} groups "
          f"{jack - bare:.2f} s")
    ratio = times["similarity"]["total"] / times["cka"]["total"]
    print(f"  similarity / cka: {ratio:.2f}x; beyond cka: {times['similarity']['total'] - times['cka']['total']:.1f} s")

    if args.no_split:
        return
    # the floor: mean CCA alone (one SVD per tap, a cross product and one decomposition per pair) over the grid's
    # pairs, with the tested pair's permutations and jackknife: what any measure of the CCA family costs at least
    x = [[a.feats[t] for t in TAPS] for a in sim]
    within = [(i, j) for i in range(13) for j in range(i, 13)] if args.grid == "full" else []
    across, tested = sim[0]._grid_pairs(sim[1]), sim[0]._tested_pairs(sim[1])

    alphas = sim[0].alphas

    def floor(measures=("mean_cca",), rev=()):
        prep = [[M.prepare(f, measures, rsa_images=200) for f in fs] for fs in x]
        for pa, pb, pairs in ((prep[0], prep[0], within), (prep[1], prep[1], within), (prep[0], prep[1], across)):
            if pairs:
                M.compare_grid(pa, pb, pairs, measures, reverse=rev, alphas=alphas)
        n = len(sim[0].ids)
        for i, j in tested:
            if args.permutations and not set(measures) <= set(WITHOUT_NULL):
                g, m = np.random.default_rng(0), min(200, n)  # as the analysis: the RDM's images among themselves
                shuffled = [prep[1][j].single().permuted(np.concatenate([g.permutation(m), m + g.permutation(n - m)]))
                            for _ in range(args.permutations)]
                M.compare_grid([prep[0][i].single()], shuffled, [(0, p) for p in range(len(shuffled))], measures,
                               reverse=rev, alphas=alphas)
        if args.groups and tested:
            M.jackknife_replicates(x[0], x[1], tested, args.groups, measures, rsa_images=200, reverse=rev,
                                   alphas=alphas)
    _, fl = timed(floor)
    print(f"  floor (mean CCA alone, the same pairs, permutations and jackknife): {fl:.2f} s = "
          f"{fl / times['cka']['total']:.1f}x cka")

    # per measure: the same work for each measure alone
    print("  per measure (prepare, the pairs, the permutations (none for ridge R²) and the jackknife; "
          f"alphas {', '.join(f'{a:g}' for a in alphas)}):")
    per = {}
    for m in M.MEASURES:
        _, per[m] = timed(lambda m=m: floor((m,), [m] if m in M.ASYMMETRIC else []))
        print(f"    {m:14s} {per[m]:7.2f} s")
    print(f"  dominant measure: {max(per, key=per.get)}")


if __name__ == "__main__":
    main()
