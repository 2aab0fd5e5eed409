"""Copy a finished zoo run into the package: weights, log, and the card with paths made relative.

    python tools/ship_zoo.py RUN_DIR OBJECTIVE [--checkpoints]     (after `vitscope zoo evaluate RUN_DIR`)

OBJECTIVE names the folder under zoo/weights (e.g. ``mocov3``, or ``mocov3-ft-cls`` for a fine-tuned model);
``--checkpoints`` also copies the run's per-epoch encoders (``checkpoints/encoder_epochNNN.safetensors``, float16).
"""
import json
import shutil
import sys
from pathlib import Path

args = [a for a in sys.argv[1:] if not a.startswith("--")]
run, obj = Path(args[0]), args[1]
dst = Path("src/vitscope/zoo/weights") / obj
dst.mkdir(parents=True, exist_ok=True)
for f in ("encoder.safetensors", "log.csv"):
    shutil.copyfile(run / f, dst / f)
if "--checkpoints" in sys.argv:
    (dst / "checkpoints").mkdir(exist_ok=True)
    for f in sorted((run / "checkpoints").glob("encoder_epoch*.safetensors")):
        shutil.copyfile(f, dst / "checkpoints" / f.name)
card = json.loads((run / "card.json").read_text())
card["weights"], card["log"] = "encoder.safetensors", "log.csv"
card["data"]["path"] = "../shared/data/cifar10" if card["data"].get("path") else None
(dst / "card.json").write_text(json.dumps(card, indent=2) + "\n")
print(dst, card.get("eval", {}).get("knn20_cls"))
