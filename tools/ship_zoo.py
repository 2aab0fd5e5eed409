"""Copy a finished zoo run into the package: weights, decoder (masked modelling), log, and the card with paths made
relative, the bar's verdict and the margins over zoo-random.

    python tools/ship_zoo.py RUN_DIR OBJECTIVE [--checkpoints]    (after `vitscope zoo evaluate RUN_DIR`)
    python tools/ship_zoo.py --random               (once: zoo-random, the zoo's initialisation untrained (seed 0),
                                                     its card and per-block evaluation, the bar's reference)
    python tools/ship_zoo.py --rejudge              (every shipped card: verdict and margins again from its numbers)

A run is shipped only if it passes the zoo's bar (`vitscope.zoo.evaluate.judge`: each objective family on its own
evidence against zoo-random; docs/ZOO.md). A run that fails is not copied; the reason is printed (``--force``
ships it anyway, for a model kept out of the default study).
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
    ap.add_argument("--rejudge", action="store_true",
                    help="record the bar's verdict and the margins again in every shipped card, from its numbers")
    ap.add_argument("--random", action="store_true",
                    help=f"write zoo-random (the zoo's initialisation at seed 0, untrained) to {RANDOM} and evaluate "
                         "it into its card")
    args = ap.parse_args()
    from vitscope.zoo.evaluate import CardError, add_to_card, judge, margins, write_untrained

    if args.rejudge:
        return rejudge()
    if args.random:
        write_untrained(RANDOM)
        add_to_card(RANDOM)
        print(RANDOM / "card.json")
        return 0
    if not args.run or not args.objective:
        ap.error("RUN_DIR and OBJECTIVE are required")
    run, obj = Path(args.run), args.objective
    card = json.loads((run / "card.json").read_text())
    try:
        verdict = None if args.finetuned else judge(card, _card(RANDOM))
    except CardError as e:
        print(f"{run}: {e}", file=sys.stderr)
        return 2
    if verdict is not None and not verdict.passes:
        print(f"{run} ({obj}) fails the zoo's bar: {verdict.reason}", file=sys.stderr)
        if not args.force:
            return 1
        print("shipping anyway (--force): keep it out of the default study", file=sys.stderr)
    dst = WEIGHTS / obj
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("encoder.safetensors", "log.csv", "decoder.safetensors"):
        if (run / f).is_file():
            shutil.copyfile(run / f, dst / f)
    if args.checkpoints:
        (dst / "checkpoints").mkdir(exist_ok=True)
        for f in sorted((run / "checkpoints").glob("encoder_epoch*.safetensors")):
            shutil.copyfile(f, dst / "checkpoints" / f.name)
    card["weights"], card["log"] = "encoder.safetensors", "log.csv"
    card["data"]["path"] = "../shared/data/cifar10" if card["data"].get("path") else None
    if verdict is not None:
        card["bar"] = verdict.record()
        card["margins"] = margins(card, _card(RANDOM))
    _write(dst / "card.json", card)
    print(dst, "fine-tuned" if verdict is None else verdict.reason)
    return 0


def rejudge() -> int:
    """The bar's verdict and the margins recorded again in every shipped card (after the bar changed)."""
    from vitscope.zoo.evaluate import CardError, judge, margins

    rnd, status = _card(RANDOM), 0
    for path in sorted(WEIGHTS.glob("*/card.json")):
        card = json.loads(path.read_text())
        try:
            verdict = judge(card, rnd)
        except CardError as e:
            print(f"{path.parent.name}: {e}", file=sys.stderr)
            status = 2
            continue
        if verdict is None:
            continue
        card["bar"], card["margins"] = verdict.record(), margins(card, rnd)
        _write(path, card)
        print(f"{path.parent.name}: {'passes' if verdict.passes else 'FAILS'}: {verdict.reason}")
    return status


def _write(path: Path, card: dict) -> None:
    path.write_text(json.dumps(card, indent=2) + "\n")


def _card(folder: Path) -> dict:
    card = folder / "card.json"
    return json.loads(card.read_text()) if card.is_file() else {}


if __name__ == "__main__":
    raise SystemExit(main())
