"""What the study engine costs: the planner against the engine before it, and a view pass against a clean one.

1. Planner overhead. The same one-dataset study (2 tiny-to-small ViTs, the clean analyses, cold cache) run by
   this checkout and by a git revision from before the planner (default b1b52f4, checked out into a temporary
   worktree), alternating, ``--repeats`` times each, in subprocesses. Prints the median wall time of each and
   their ratio (goal: 1.00, i.e. within the run-to-run spread, which it also prints).
2. A view pass. One model, a dataset, and an analysis fed the clean pass and ``--views`` noise views (a view
   registered here: white Gaussian noise, drawn per image). Prints the forward seconds of each pass and the
   perturbation's seconds and share of its view pass, from the manifest's pass timings.

    python benchmarks/engine.py [--before b1b52f4] [--repeats 3] [--images 256] [--views 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUDY = """
models:
  - {{name: vit_small_patch16_224, label: vit-s, pretrained: false, kwargs: {{img_size: {size}}}}}
  - {{name: vit_tiny_patch16_224, label: vit-ti, pretrained: false, kwargs: {{img_size: {size}}}}}
dataset: {{name: synthetic-shapes, n_images: {images}}}
analyses:
  attention_distance: {{}}
  cka: {{}}
  svd_volume: {{}}
batch_size: 32
progress: false
"""

VIEW_RUN = r'''
import json, sys, torch
from vitscope.analyses.base import ANALYSES, register_analysis
from vitscope.analyses.geometry import SVDVolume
from vitscope.data.views import image_generator, register_view
from vitscope.study import load_config, run_study

@register_view("bench_noise")
def noise(x01, index, seed, *, std=0.1, tag=0):
    key = f"bench_noise:std={std},tag={tag}"
    return x01 + std * torch.stack([torch.randn(x01.shape[1:], generator=image_generator(seed, key, int(i)))
                                    for i in index])

class Viewed(SVDVolume):
    name = "bench_viewed"
    @classmethod
    def views(cls, params):
        return ["clean"] + [f"bench_noise:std=0.1,tag={k}" for k in range(int(sys.argv[3]))]
    def __init__(self, vm, **kw):
        super().__init__(vm, **kw)

register_analysis(Viewed)
cfg = load_config(sys.argv[1], [f"output_dir={sys.argv[2]}"])
out = run_study(cfg)
print(json.dumps(json.loads((out / "manifest.json").read_text())["models"]))
'''


def _study(src: Path, cfg: Path, out: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vitscope", "-q", "run", str(cfg), f"output_dir={out}",
                    f"cache_dir={out}-cache"], check=True, env=env, cwd=out.parent)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="b1b52f4", help="a git revision from before the planner")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--views", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = tmp / "study.yaml"
        cfg.write_text(STUDY.format(images=args.images, size=args.size))
        before = tmp / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.before],
                       check=True)
        try:
            times: dict[str, list[float]] = {"before": [], "now": []}
            for r in range(args.repeats):
                for which, src in (("before", before / "src"), ("now", ROOT / "src")):
                    times[which].append(_study(src, cfg, tmp / f"{which}-{r}"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
        b, n = statistics.median(times["before"]), statistics.median(times["now"])
        spread = max(max(v) / min(v) for v in times.values())
        print(f"one-dataset study, 2 models x 3 analyses, {args.images} images at {args.size} px, cold cache, "
              f"{args.repeats} alternating runs each")
        print(f"  before the planner ({args.before}): median {b:.2f} s  {sorted(round(x, 2) for x in times['before'])}")
        print(f"  this checkout:                 median {n:.2f} s  {sorted(round(x, 2) for x in times['now'])}")
        print(f"  ratio now / before: {n / b:.3f} (run-to-run spread within one version: up to {spread:.3f}x)")

        vcfg = tmp / "views.yaml"
        text = STUDY.format(images=args.images, size=args.size)
        text = text.split("  - {name: vit_tiny")[0] + text[text.index("dataset:"):text.index("analyses:")]
        vcfg.write_text(text + "analyses:\n  bench_viewed: {}\nbatch_size: 32\nprogress: false\n")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        res = subprocess.run([sys.executable, "-c", VIEW_RUN, str(vcfg), str(tmp / "views"), str(args.views)],
                             check=True, capture_output=True, text=True, env=env)
        models = json.loads(res.stdout.strip().splitlines()[-1])
        for label, m in models.items():
            parts = m["timings"]["pass_parts"]
            fwd = parts.get("forward", 0.0)
            pert = sum(v for k, v in parts.items() if k.startswith("view "))
            n_pass = 1 + args.views
            print(f"{label}: {n_pass} passes (clean + {args.views} views) over {args.images} images")
            print(f"  forward, all passes: {fwd:.2f} s ({fwd / n_pass:.2f} s a pass); perturbation: {pert:.2f} s "
                  f"= {100 * pert / (pert + fwd * args.views / n_pass):.1f}% of the view passes' forward + "
                  "perturbation")


if __name__ == "__main__":
    main()
