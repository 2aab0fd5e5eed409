"""Cost of the `similarity` analysis beyond the `cka` analysis alone, both on the same features.

Two ViT-S/16 models (pretrained=False: only their shapes matter here), 13 taps (``embed`` and the 12 block
outputs: a 13 x 13 grid within each model and across the pair), the 'gap' token view for both analyses,
N images at 224 px. The forward passes are the same for both analyses and are left out: each analysis is fed
the same synthetic (B, 197, 384) features per tap (Gaussian, a decaying spectrum over channels and a shared
mean, so the SVDs see a realistic spread), and the seconds of its updates, finalize (within-model grids) and
cross stage (the pair, with nulls and intervals) are timed. Then the similarity measures one at a time on the
same subset (prepare + compare over the three grids, no nulls), the nulls and the jackknife alone, and the
floor (mean CCA alone: a cross product and one decomposition per pair), to say which
part dominates.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/similarity.py [--images 2048] [--null-pairs last]
"""

from __future__ import annotations

import argparse
import time
import types

import torch

import vitscope as vs
from vitscope.analyses import get_analysis
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
    p.add_argument("--groups", type=int, default=20)
    p.add_argument("--null-pairs", default="last")
    args = p.parse_args()
    torch.set_num_threads(1)
    vms = [vs.load_model("vit_small_patch16_224", pretrained=False, seed=i) for i in range(2)]
    for i, vm in enumerate(vms):
        vm.name = f"vit_s_{i}"
    cka = [get_analysis("cka")(vm, taps=TAPS, views=["gap"]) for vm in vms]
    sim = [get_analysis("similarity")(vm, taps=TAPS, view="gap", n_subset=args.subset,
                                      n_permutations=args.permutations, n_groups=args.groups,
                                      null_pairs=args.null_pairs) for vm in vms]
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
    print(f"{args.images} images, 2 x ViT-S/16 (synthetic features), 13 x 13 taps, gap view, one thread "
          f"(loaded machine: 2 cores shared)")
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
    print(f"  similarity cross stage: the 13 x 13 grid alone {bare:.2f} s; {args.permutations} permutations of the "
          f"'{args.null_pairs}' pairs {nulls - bare:.2f} s; the jackknife over {args.groups} groups "
          f"{jack - bare:.2f} s")
    ratio = times["similarity"]["total"] / times["cka"]["total"]
    print(f"  similarity / cka: {ratio:.2f}x; beyond cka: {times['similarity']['total'] - times['cka']['total']:.1f} s")

    # the floor: per pair of the three grids, its cross product and one decomposition (mean CCA alone)
    x = [[a.feats[t] for t in TAPS] for a in sim]

    def floor():
        prep = [[M.prepare(f, ["mean_cca"]) for f in fs] for fs in x]
        for pa, pb, tri in ((prep[0], prep[0], True), (prep[1], prep[1], True), (prep[0], prep[1], False)):
            M.compare_grid(pa, pb, [(i, j) for i in range(13) for j in range(i if tri else 0, 13)], ["mean_cca"])
    _, fl = timed(floor)
    print(f"  floor (mean CCA alone over the three grids: one SVD per tap, one cross product and one "
          f"decomposition per pair): {fl:.2f} s = {fl / times['cka']['total']:.1f}x cka")

    # per measure: prepare every tap of both models once, compare over the three grids (no nulls)
    print("  per measure (prepare + 3 grids of 13 x 13, no nulls):")
    per = {}
    for m in M.MEASURES:
        def run(m=m):
            prep = [[M.prepare(f, [m], rsa_images=200) for f in fs] for fs in x]
            for pa, pb in ((prep[0], prep[0]), (prep[1], prep[1]), (prep[0], prep[1])):
                for i in range(13):
                    for j in range(13):
                        M.compare(pa[i], pb[j], [m])
        _, per[m] = timed(run)
        print(f"    {m:14s} {per[m]:7.2f} s")
    print(f"  dominant measure: {max(per, key=per.get)}")


if __name__ == "__main__":
    main()
