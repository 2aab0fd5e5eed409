"""STIR and CKA of a pretrained -> fine-tuned pair under both of the `stir` analysis's CKA estimators, from one
pass: vitscope's default (the unbiased minibatch CKA summed over every batch) and the public STIR code's (the
biased linear CKA of the last batch). The accumulator keeps the terms of both, so one set of inversions serves
both tables (a study computes the same numbers with ``analyses.stir.cka_estimator=...``).

    python tools/stir_cka_estimators.py --a zoo-random --b zoo-random-ft-cls --images 64 --batch 32 \\
        --layers 1 4 7 --iterations 10
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

import vitscope as vs
from vitscope.analyses.invariance import Stir
from vitscope.data.formats.shipped import Cifar10Test1k
from vitscope.study.run import _select_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="zoo-random")
    ap.add_argument("--b", default="zoo-random-ft-cls")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 4, 7])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    a, b = vs.load_model(args.a), vs.load_model(args.b)
    ds = Cifar10Test1k()
    an = Stir(a.info(), b.info(), layers=args.layers, iterations=args.iterations, corruptions=None)
    for batch in ds.batches(args.batch, a.preprocessing, indices=_select_ids(ds, args.images)):
        an.update(a, b, batch)
    tables = []
    for est in ("minibatch_unbiased", "last_batch_biased"):
        an.cka_estimator = est
        tables.append(an.finalize())
    df = pd.concat(tables, ignore_index=True)
    keep = df.metric.isin(["cka", "stir_b|a", "stir_a|b", "fidelity_a", "fidelity_b"])
    diag = (df.layer == df.layer_b) | df.layer_b.isna() | df.layer.isna()
    sel = df[keep & diag].assign(block=lambda d: d.layer.fillna(d.layer_b).astype(int))
    wide = sel.pivot_table(index=["metric", "block"], columns="cka_estimator", values="value")
    wide["last - unbiased"] = wide["last_batch_biased"] - wide["minibatch_unbiased"]
    pd.set_option("display.width", 160)
    print(f"{args.a} -> {args.b}: {args.images} CIFAR-10 images (the study's even spread), batches of {args.batch}, "
          f"{args.iterations} iterations")
    print(wide.round(3).to_string())
    d = df[df.metric.isin(["cka", "stir_b|a", "stir_a|b"])].pivot_table(
        index=["metric", "layer", "layer_b"], columns="cka_estimator", values="value")
    diff = d["last_batch_biased"] - d["minibatch_unbiased"]
    print(f"every layer pair: last_batch_biased - minibatch_unbiased from {diff.min():.3f} to {diff.max():.3f}")


if __name__ == "__main__":
    main()
