"""Copy a finished zoo run into the package: weights, log, and the card with paths made relative.

    python tools/ship_zoo.py RUN_DIR OBJECTIVE [--checkpoints]    (after `vitscope zoo evaluate RUN_DIR`)
    python tools/ship_zoo.py --random               (once: zoo-random, the zoo's initialisation untrained (seed 0),
                                                     its card and per-block evaluation, the bar's reference)

A run is shipped only if it passes the zoo's bar (issue 18; `vitscope.zoo.evaluate.passes_bar`): best-block
20-NN and probe over zoo-random's, zoo-sup's 20-NN, and a block with local attention. A run that fails is not
copied; the reasons are printed (``--force`` ships it anyway, for a model kept out of the default study).
OBJECTIVE names the folder under zoo/weights (e.g. ``mocov3``, or ``mocov3-ft-cls`` for a fine-tuned model);
``--checkpoints`` also copies the run's per-epoch encoders (``checkpoints/encoder_epochNNN.safetensors``, float16).
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

WEIGHTS = Path("src/vitscope/zoo/weights")
RANDOM = WEIGHTS / "random"  # zoo-random: the bar's reference is the evaluation in its card


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", nargs="?")
    ap.add_argument("objective", nargs="?")
    ap.add_argument("--force", action="store_true", help="ship even if the run fails the bar")
    ap.add_argument("--checkpoints", action="store_true", help="also copy the run's per-epoch encoders")
    ap.add_argument("--finetuned", action="store_true",
                    help="a fine-tuned model (a pair's B for the invariance lens): not judged by the bar, no "
                         "evaluation needed")
    ap.add_argument("--random", action="store_true",
                    help=f"write zoo-random (the zoo's initialisation at seed 0, untrained) to {RANDOM} and evaluate "
                         "it into its card")
    args = ap.parse_args()
    from vitscope.zoo.evaluate import add_to_card, passes_bar, write_untrained

    if args.random:
        write_untrained(RANDOM)
        add_to_card(RANDOM)
        print(RANDOM / "card.json")
        return 0
    if not args.run or not args.objective:
        ap.error("RUN_DIR and OBJECTIVE are required")
    run, obj = Path(args.run), args.objective
    card = json.loads((run / "card.json").read_text())
    ev = card.get("eval")
    if args.finetuned:
        why = []
    elif not ev or "best_knn20" not in ev:
        print(f"{run}: no per-block evaluation in its card; run `vitscope zoo evaluate {run}` first", file=sys.stderr)
        return 2
    elif "best_knn20" not in (random_ev := _card_eval(RANDOM)):
        print(f"no evaluation of zoo-random in {RANDOM}: run `python tools/ship_zoo.py --random` first",
              file=sys.stderr)
        return 2
    else:
        why = passes_bar(card["objective"], ev, random_ev)
    if why:
        print(f"{run} ({obj}) fails the zoo's bar:\n  " + "\n  ".join(why), file=sys.stderr)
        if not args.force:
            return 1
        print("shipping anyway (--force): keep it out of the default study", file=sys.stderr)
    dst = WEIGHTS / obj
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("encoder.safetensors", "log.csv"):
        shutil.copyfile(run / f, dst / f)
    if args.checkpoints:
        (dst / "checkpoints").mkdir(exist_ok=True)
        for f in sorted((run / "checkpoints").glob("encoder_epoch*.safetensors")):
            shutil.copyfile(f, dst / "checkpoints" / f.name)
    card["weights"], card["log"] = "encoder.safetensors", "log.csv"
    card["data"]["path"] = "../shared/data/cifar10" if card["data"].get("path") else None
    if not args.finetuned:
        card["bar"] = {"passes": not why, "why_not": why}
    (dst / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(dst, (ev or {}).get("knn20_cls"), "fine-tuned" if args.finetuned else
          "passes the bar" if not why else "FAILS the bar")
    return 0


def _card_eval(folder: Path) -> dict:
    card = folder / "card.json"
    return (json.loads(card.read_text()).get("eval") or {}) if card.is_file() else {}


if __name__ == "__main__":
    raise SystemExit(main())
