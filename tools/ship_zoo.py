"""Copy a finished zoo run into the package: weights, log, and the card with paths made relative.

    python tools/ship_zoo.py RUN_DIR OBJECTIVE      (after `vitscope zoo evaluate RUN_DIR`)
"""
import json
import shutil
import sys
from pathlib import Path

run, obj = Path(sys.argv[1]), sys.argv[2]
dst = Path("src/vitscope/zoo/weights") / obj
dst.mkdir(parents=True, exist_ok=True)
for f in ("encoder.safetensors", "log.csv"):
    shutil.copyfile(run / f, dst / f)
card = json.loads((run / "card.json").read_text())
card["weights"], card["log"] = "encoder.safetensors", "log.csv"
card["data"]["path"] = "../shared/data/cifar10" if card["data"].get("path") else None
(dst / "card.json").write_text(json.dumps(card, indent=2) + "\n")
print(dst, card.get("eval", {}).get("knn20_cls"))
