"""Does shipping a zoo encoder in float16 change what vitscope measures?

For each finished zoo run, rebuilds the float32 encoder from its training state (`train_state.pt`), writes it
next to the float16 export it shipped, and runs the default study's analyses on both (one study, generated
images). Prints, per analysis, the largest difference between the two models' rows relative to the spread
of that metric over layers and heads (0 = the analyses cannot tell the two apart), and the CKA between the
two models at each block (1 = identical representations).

    python tools/half_precision_check.py RUN_DIR [RUN_DIR ...] [--images 256]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd

from vitscope.models import save_checkpoint
from vitscope.models.load import read_vitscope_metadata
from vitscope.study import load_config, run_study
from vitscope.zoo.arch import ZooArch
from vitscope.zoo.objectives import build_objective
from vitscope.zoo.train import STATE_FILE, WEIGHTS_FILE, load_state

KEYS = ["metric", "layer", "head", "token_view", "tap", "tap_b", "layer_b", "index", "freq", "row", "col", "image"]


def float32_encoder(run: Path, dst: Path) -> Path:
    st = load_state(run / STATE_FILE)
    cfg = st["config"]
    spec = read_vitscope_metadata(run / WEIGHTS_FILE)
    head = spec.model_kwargs.get("num_classes", 0) or 10
    obj = build_objective(cfg["objective"], ZooArch(**cfg["arch"]), num_classes=head, seed=cfg["seed"],
                          **cfg["objective_kwargs"])
    obj.load_state_dict(st["objective"])
    return save_checkpoint(obj.export(), dst, replace(spec, name=spec.name + "-fp32"), half=False)


def compare(run: Path, images: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = float32_encoder(run, Path(tmp) / "fp32.safetensors")
        cfg = load_config(None, [f"output_dir={tmp}/run", f"cache_dir={tmp}/cache", "progress=false",
                                 f"dataset.n_images={images}"])
        cfg = replace(cfg, models=[replace(cfg.models[0], name=str(run / WEIGHTS_FILE), label="fp16"),
                                   replace(cfg.models[0], name=str(fp32), label="fp32")])
        out = run_study(cfg)
        print(f"{run}: float16 export vs float32 training state, {images} generated images")
        for f in sorted((out / "results").glob("*.parquet")):
            df = pd.read_parquet(f)
            df = df[pd.to_numeric(df["value"], errors="coerce").notna()]
            if "model_b" in df.columns:  # pairs: only each model against itself here
                df = df[df["model_b"].isna() | (df["model_b"] == df["model"])]
            keys = [k for k in KEYS if k in df.columns]
            a = df[df.model == "fp16"].set_index(keys)["value"].astype(float)
            b = df[df.model == "fp32"].set_index(keys)["value"].astype(float)
            a, b = a[~a.index.duplicated()], b[~b.index.duplicated()]
            both = a.index.intersection(b.index)
            if f.stem == "tsne" or not len(both):  # t-SNE coordinates are not comparable row by row
                continue
            diff = (a[both] - b[both]).abs()
            spread = b[both].groupby(level="metric").transform(lambda s: s.max() - s.min()).clip(lower=1e-12)
            rel = (diff / spread).groupby(level="metric").max()
            worst = rel.idxmax()
            print(f"  {f.stem:24s} max |fp16 - fp32| / spread {rel.max():.2e} ({worst}), max |diff| {diff.max():.2e}")
        cka = pd.read_parquet(out / "results" / "cka.parquet")
        same = cka[(cka.metric == "cka_minibatch") & (cka.model == "fp16") & (cka.model_b == "fp32")
                   & (cka.layer == cka.layer_b)]
        for view, g in same.groupby("token_view"):
            print(f"  CKA(fp16, fp32) at the same block, {view}: min {g.value.min():.6f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--images", type=int, default=256)
    args = ap.parse_args()
    for run in args.runs:
        compare(run, args.images)


if __name__ == "__main__":
    main()
