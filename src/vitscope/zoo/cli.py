"""``vitscope zoo``: train a model of the controlled zoo, evaluate it, list the objectives and shipped models."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vitscope.errors import VitscopeError

OBJECTIVE_NAMES = ("supervised", "dino", "mocov3", "mae", "simmim", "hybrid", "finetune")

ZOO_EPILOG = """examples:
  vitscope zoo list
  vitscope zoo train --objective dino --out zoo/dino                  CIFAR-10 found in ../shared/data
  vitscope zoo train --objective dino --out zoo/dino --resume         continue an interrupted run
  vitscope zoo train --objective hybrid --lam 0.5 --out zoo/hybrid
  vitscope zoo train --objective finetune --init zoo/mae/encoder.safetensors --task reconstruction \\
      --epochs 10 --out zoo/mae-ft-rec                                saves the encoder at every epoch
  vitscope zoo train --all --device cuda --budget long --out zoo-long  the six objectives and zoo-random's
                                                                      fine-tune, 20x the budget; rerun to resume
"""

# options of one run's objective: refused with --all (each run of the zoo has its shipped settings)
_PER_OBJECTIVE = ("lam", "init", "task", "n_local", "mask_ratio")


def _arch_overrides(items: list[str]) -> dict[str, Any]:
    from dataclasses import asdict

    from vitscope.zoo.arch import ZOO_ARCH

    kw = asdict(ZOO_ARCH)
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or k not in kw:
            raise VitscopeError(f"--arch takes key=value with key in {', '.join(kw)}; got {item!r}")
        try:
            kw[k] = type(kw[k])(v)
        except ValueError:
            raise VitscopeError(f"--arch {k} must be {type(kw[k]).__name__} (like {kw[k]!r}); got {v!r}") from None
    return kw


def _need_file(run_dir: str, name: str, what: str) -> None:
    """One sentence when ``run_dir`` lacks ``name`` (instead of a FileNotFoundError traceback)."""
    from pathlib import Path

    if not (Path(run_dir) / name).is_file():
        raise VitscopeError(f"{run_dir!r} has no {name}: pass {what}")


def _cmd_train(args: argparse.Namespace) -> int:
    import torch

    from vitscope.zoo.train import TrainConfig, budget_views, resolve_device, train

    if (args.objective is None) == (not args.all):
        raise VitscopeError("give exactly one of --objective OBJ (one run) and --all (the whole zoo)")
    resolve_device(args.device)  # one sentence now when the machine lacks the device, before any work
    if args.threads:
        torch.set_num_threads(args.threads)  # the user's explicit choice for this process
    if args.all:
        return _train_all(args)
    okw: dict[str, Any] = {}
    for key, objectives in (("lam", ("hybrid",)), ("init", ("finetune",)), ("task", ("finetune",)),
                            ("n_local", ("dino",)), ("mask_ratio", ("mae", "simmim", "hybrid"))):
        value = getattr(args, key)
        if value is None:
            continue
        if args.objective not in objectives:
            raise VitscopeError(f"--{key.replace('_', '-')} applies to {', '.join(objectives)}, not {args.objective}")
        okw[key] = value
    for item in args.set:  # any other objective hyper-parameter, KEY=VALUE (VALUE read as JSON, else a string)
        key, sep, raw = item.partition("=")
        if not sep:
            raise VitscopeError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            okw[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            okw[key.replace("-", "_")] = raw
    if args.objective == "finetune" and "init" not in okw:
        raise VitscopeError("finetune needs --init: a zoo checkpoint (encoder.safetensors) or a model name")
    views = budget_views(args.budget, args.objective) if args.budget else args.budget_views
    cfg = TrainConfig(objective=args.objective, out=args.out, budget_views=views, epochs=args.epochs,
                      objective_kwargs=okw, **_given(args), **_common(args))
    try:
        card = train(cfg, resume=args.resume, stop_after_steps=args.stop_after_steps)
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise VitscopeError(str(e)) from e
    if card.get("status") == "stopped":
        print(json.dumps(card))
        return 0
    print(f"{card['name']}: {card['image_views']} image-views in {card['wall_time_s'] / 60:.1f} min, "
          f"20-NN (CLS) {card['final_knn']['cls']:.3f}\nweights: {card['weights']}\nlog:     {card['log']}")
    return 0


def _common(args: argparse.Namespace) -> dict[str, Any]:
    """`TrainConfig` fields that one run and every run of --all take from the command line alike."""
    return dict(data=args.data, batch_size=args.batch_size, lr=args.lr, seed=args.seed, arch=_arch_overrides(args.arch),
                ckpt_minutes=args.ckpt_minutes, save_epochs=args.save_epochs, synthetic_n=tuple(args.synthetic_n),
                progress=not args.no_progress, precision=args.precision, adamw=args.adamw, device=args.device)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The monitor's and the epoch's options the command line gave (the rest: `TrainConfig`'s defaults for one
    run, the shipped runs' settings for --all)."""
    return {k: getattr(args, k) for k in ("epoch_views", "knn_every", "knn_train", "knn_test")
            if getattr(args, k) is not None}


def _train_all(args: argparse.Namespace) -> int:
    """``zoo train --all``: the six objectives, then zoo-random fine-tuned for classification, one after another
    into OUT/<objective> and OUT/finetune-cls, each with its shipped model's settings (`zoo_recipes`) at the
    chosen budget; always resuming: a finished run is skipped, a stopped one continued, a new one started."""
    from vitscope.zoo.train import TrainConfig, train, zoo_recipes

    given = [f"--{k.replace('_', '-')}" for k in _PER_OBJECTIVE if getattr(args, k) is not None]
    given += ["--set"] if args.set else []
    given += ["--epochs"] if args.epochs is not None else []
    if given:
        raise VitscopeError(f"{', '.join(given)} cannot be given with --all, which trains every run with its shipped "
                            "settings (use --budget or --budget-views for the budget, --objective for one run)")
    runs = zoo_recipes(args.out, args.budget or "default", args.budget_views)
    for i, (label, fields) in enumerate(runs, 1):
        cfg = TrainConfig(**{**_common(args), **fields, **_given(args)})  # what the command line gave: every run
        head = f"[{i}/{len(runs)}] {label} -> {cfg.out}:"
        try:
            result = train(cfg, resume=True, stop_after_steps=args.stop_after_steps,
                           announce=lambda what, head=head: print(f"{head} {what}", flush=True))
        except (ValueError, FileNotFoundError, TypeError, VitscopeError) as e:
            raise VitscopeError(f"{label}: {e}") from e
        if result.get("status") == "stopped":
            print(f"{head} stopped at step {result['step']:,} of {result['total_steps']:,} (state written; run the "
                  "same command again to continue)", flush=True)
        else:
            print(f"{head} finished: {result['budget']['steps']:,} steps, {result['image_views']:,} image-views in "
                  f"{result['wall_time_s'] / 60:.1f} min, 20-NN (CLS) {result['final_knn']['cls']:.3f}", flush=True)
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    import torch

    from vitscope.zoo.evaluate import add_to_card

    if args.threads:
        torch.set_num_threads(args.threads)
    _need_file(args.run_dir, "card.json", "a `vitscope zoo train` output directory")
    card = add_to_card(args.run_dir, args.data, tuple(args.synthetic_n), per_block=not args.final_only,
                       reconstruction_only=args.reconstruction_only)
    e = card["eval"]
    if not args.reconstruction_only:
        print(f"{card['name']} on {e['data']} ({e['n_train']} train / {e['n_test']} test images): "
              f"20-NN CLS {e['knn20_cls']:.3f} GAP {e['knn20_gap']:.3f}, linear probe CLS {e['probe_cls']:.3f} "
              f"GAP {e['probe_gap']:.3f} -> {args.run_dir}/card.json")
    if "reconstruction" in e:
        r = e["reconstruction"]
        print(f"{card['name']}: held-out {r['loss']} {r['model']:.4g} against the trivial predictor's "
              f"{r['trivial_loss']:.4g}: ratio {r['ratio']:.3f} [{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}] over "
              f"{r['draws']} mask draws of {r['n_images']} images -> {args.run_dir}/card.json")
    return 0


def _cmd_findings(args: argparse.Namespace) -> int:
    from vitscope.zoo.findings import check, to_markdown

    _need_file(args.run_dir, "manifest.json", "the output_dir of a `vitscope run` of zoo models")
    table = check(args.run_dir)
    if table.empty:
        raise VitscopeError(f"{args.run_dir}: no finding could be checked (the study needs contrastive and "
                            "reconstructive models and the attention / semantics / fourier / cka analyses)")
    print(to_markdown(table))
    _print_by_measure(args.run_dir)
    return 0


def _print_by_measure(run_dir: str) -> None:
    """The similarity finding re-checked under every measure of the run's similarity table (`vitscope.findings`),
    printed and written to results/summary/findings.parquet; one sentence on how to get it when the run has none."""
    from pathlib import Path

    import vitscope.findings as findings

    if not (Path(run_dir) / "results" / "similarity.parquet").is_file():
        print(f"\nThe similarity finding rests on CKA alone in this run: {findings.HOW_TO_GET_SIMILARITY} to "
              "re-check it under Procrustes, the shape metric, the CCA family, RSA, mutual k-NN, CKNNA and ridge R².")
        return
    table = findings.check_measures(run_dir)
    if table.empty:
        print(f"\n{findings.no_check_reason(run_dir)}.")
        return
    print("\n" + findings.to_markdown(table))
    print(f"\n(per measure: {findings.write(run_dir, table)})")


def _cmd_list(args: argparse.Namespace) -> int:
    from vitscope.zoo.arch import ZOO_ARCH
    from vitscope.zoo.objectives import OBJECTIVES
    from vitscope.zoo.train import ZOO_BATCH_SIZE, ZOO_BUDGET_VIEWS

    print(f"architecture: {ZOO_ARCH}\nbudget: {ZOO_BUDGET_VIEWS:,} image-views per objective, batch {ZOO_BATCH_SIZE}\n")
    rows = []
    for name, cls in OBJECTIVES.items():
        if name == "finetune":  # needs a checkpoint; the exported model keeps its source's family
            rows.append((name, "(source's)", "1", cls.summary))
        else:
            rows.append((name, cls.family, f"{cls().views.views_per_image():g}", cls.summary))
    head = ("objective", "family", "views/img", "what it does")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
    print("\nshipped (load with vitscope.load_model(name)); the bar each model is judged by (docs/ZOO.md):")
    for line in shipped_lines():
        print(line)
    return 0


def shipped_lines(width: int = 116) -> list[str]:
    """A few lines per shipped zoo model: what it saw, its accuracy, the bar's verdict with its reason and 95 %
    interval, and its margins over zoo-random (findings, not conditions)."""
    import textwrap

    from vitscope.models.registry import REGISTRY
    from vitscope.zoo.evaluate import CardError, judge, margins, random_card, shipped_card

    names = [n for n, spec in REGISTRY.items() if n.startswith("zoo-") and spec.weights.kind == "file"]
    lines = []
    try:
        rnd = random_card()
    except CardError as err:
        return [f"  {err}"]

    def say(text: str) -> None:
        lines.extend(textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="      "))

    for name in names:
        c = shipped_card(name)
        if c is None:
            lines.append(f"  {name}: not trained yet")
            continue
        e = c.get("eval") or {}
        acc = f"20-NN CLS {e['knn20_cls']:.3f}, probe CLS {e['probe_cls']:.3f}" if e.get("knn20_cls") else \
            f"20-NN CLS {c['final_knn']['cls']:.3f} (monitor subset)" if c.get("final_knn") else "not evaluated"
        seen = f"{c['image_views']:,} image-views of {c['data']['name']}" if c.get("image_views") else "untrained"
        lines.append(f"  {name}: {seen}; {acc}")
        try:
            verdict = judge(c, rnd)
            found = margins(c, rnd) if verdict is not None else None
        except CardError as err:
            say(f"bar: not judged, {err} [not in the default study]")
            continue
        if verdict is None or found is None:
            say("bar: the reference every bar measures against" if name == "zoo-random" else
                "bar: not judged (a fine-tuned model)")
            continue
        say(f"bar ({verdict.family}): {'passes' if verdict.passes else 'FAILS'}: {verdict.reason}"
            + ("" if verdict.passes else " [not in the default study]"))
        k, p, a = found["knn20"], found["probe"], found["attn_dist_change"]
        say(f"findings over zoo-random: best-block 20-NN {k['margin']:+.3f} [{k['interval'][0]:+.3f}, "
            f"{k['interval'][1]:+.3f}], probe {p['margin']:+.3f} [{p['interval'][0]:+.3f}, {p['interval'][1]:+.3f}]; "
            f"mean attention distance per block {' '.join(f'{x:+.2f}' for x in a['per_block'])} "
            f"(each ± {a['half_width']:.2f})"
            + ("; held-out loss ratio with a decoder re-fitted for {steps} steps: this encoder {e[0]:.3f} [{e[1]:.3f}, "
               "{e[2]:.3f}], zoo-random {u[0]:.3f} [{u[1]:.3f}, {u[2]:.3f}]".format(
                   steps=found["reconstruction_refit"]["steps"], e=found["reconstruction_refit"]["encoder"],
                   u=found["reconstruction_refit"]["untrained"]) if "reconstruction_refit" in found else ""))
    return lines


def add_zoo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``zoo train``, ``zoo evaluate`` and ``zoo list`` to the ``vitscope`` command's subparsers."""
    z = subparsers.add_parser("zoo", help="train the controlled zoo: one small ViT per objective, one budget",
                              epilog=ZOO_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    zsub = z.add_subparsers(dest="zoo_command", required=True, metavar="ZOO_COMMAND")

    t = zsub.add_parser("train", help="train (or resume) one zoo model", epilog=ZOO_EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--objective", default=None, choices=OBJECTIVE_NAMES, help="the objective of one run")
    t.add_argument("--all", action="store_true",
                   help="instead of --objective: the six objectives, then zoo-random fine-tuned for classification, "
                        "into OUT/<objective> and OUT/finetune-cls, each with its shipped model's settings at the "
                        "chosen budget; always resumes (a finished run is skipped), so rerun the same command after "
                        "an interruption")
    t.add_argument("--out", required=True, help="output directory (weights, card.json, log.csv, training state); "
                                                "with --all the folder of the runs' folders")
    t.add_argument("--device", default="cpu",
                   help="where the objective, the views and the k-NN monitor run: cpu (default), cuda, cuda:N")
    t.add_argument("--data", default=None,
                   help="CIFAR-10 ImageFolder root with train/ and test/ (default: ../shared/data/cifar10 or "
                        "/work/shared/data/cifar10 if present, else generated shapes); 'synthetic' forces shapes")
    budget = t.add_mutually_exclusive_group()
    budget.add_argument("--budget", choices=["default", "long"], default=None,
                        help="a named budget: default = the shipped models' (250,000 image-views for the six "
                             "objectives, 80,000 for a fine-tune: 8 epochs of 10,000), long = 20x that. Without "
                             "--budget, --budget-views or --epochs one run trains on 250,000 image-views (a "
                             "fine-tune too) and --all on the default budget")
    budget.add_argument("--budget-views", type=int, default=None,
                        help="image-views to train on (default: the zoo budget, `vitscope zoo list`); with --all, "
                             "for every run")
    budget.add_argument("--epochs", type=float, default=None, help="budget in epochs of --epoch-views image-views")
    t.add_argument("--epoch-views", type=int, default=None,
                   help="image-views per logged epoch (default: the number of training images; with --all the "
                        "run's budget over its shipped number of epochs, 10, or 8 for the fine-tune)")
    t.add_argument("--batch-size", type=int, default=128)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt (--all always does)")
    t.add_argument("--stop-after-steps", type=int, default=None, metavar="N",
                   help="stop after N steps in all (the budget's schedule; state written, no export): a short "
                        "probe of the full run that `--resume` continues; with --all, of every run")
    t.add_argument("--lam", type=float, default=None, help="hybrid: weight of the contrastive loss (default 0.5)")
    t.add_argument("--init", default=None, help="finetune: checkpoint or model name to start from")
    t.add_argument("--task", choices=["classification", "reconstruction"], default=None,
                   help="finetune: the task (default classification)")
    t.add_argument("--n-local", type=int, default=None, help="dino: number of 16-px local crops (default 2)")
    t.add_argument("--mask-ratio", type=float, default=None, help="mae / simmim / hybrid: fraction masked")
    t.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="objective hyper-parameters, e.g. teacher_temp=0.04 (`vitscope zoo list` names them)")
    t.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: forward under bfloat16 autocast (weights and AdamW stay fp32); see docs/ZOO.md")
    t.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default",
                   help="torch's AdamW implementation (same update; speed measured in benchmarks/zoo_throughput.py)")
    t.add_argument("--save-epochs", default="auto",
                   help="epochs whose encoder is kept under OUT/checkpoints: 'all', 'none', or e.g. 0,1,2,5 "
                        "(default: all for finetune, none otherwise)")
    t.add_argument("--knn-every", type=int, default=None,
                   help="20-NN evaluation every K epochs (and at the end); default 1, with --all the shipped runs' "
                        "(2, the fine-tune 4)")
    t.add_argument("--knn-train", type=int, default=None,
                   help="train images of the 20-NN monitor (default 5000; with --all the shipped runs': 5000, the "
                        "fine-tune 2000)")
    t.add_argument("--knn-test", type=int, default=None,
                   help="test images of the 20-NN monitor (default 2000; with --all 2000, the fine-tune 1000)")
    t.add_argument("--ckpt-minutes", type=float, default=10.0, help="also save the training state every N minutes")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads for this run (default: torch's)")
    t.add_argument("--arch", nargs="*", default=[], metavar="KEY=VALUE",
                   help="architecture overrides for experiments (e.g. depth=2 embed_dim=32); not the zoo's")
    t.add_argument("--synthetic-n", type=int, nargs=2, default=[5000, 1000], metavar=("TRAIN", "TEST"),
                   help="sizes of the generated set when no CIFAR-10 is used")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_cmd_train)

    ev = zsub.add_parser("evaluate", help="20-NN and linear-probe accuracy of a trained run, written to its card")
    ev.add_argument("run_dir", help="a `zoo train` output directory (encoder.safetensors + card.json)")
    ev.add_argument("--data", default=None, help="as for `zoo train` (default: the CIFAR-10 it finds)")
    ev.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ev.add_argument("--synthetic-n", type=int, nargs=2, default=[5000, 1000], metavar=("TRAIN", "TEST"),
                    help="sizes of the generated set when no CIFAR-10 is used")
    ev.add_argument("--reconstruction-only", action="store_true",
                    help="mae / simmim: add (or redo) only the held-out reconstruction loss the bar judges, keeping "
                         "the card's other numbers")
    ev.add_argument("--final-only", action="store_true",
                    help="the final block only, not every block (a fine-tuned model: no bar to judge)")
    ev.set_defaults(func=_cmd_evaluate)

    fi = zsub.add_parser("findings", help="which of the sources' findings (contrastive vs MIM) hold in a study; "
                                                 "the similarity finding under every measure of its similarity table")
    fi.add_argument("run_dir", help="a finished `vitscope run` output directory")
    fi.set_defaults(func=_cmd_findings)

    ls = zsub.add_parser("list", help="the objectives, the architecture, the budget and the shipped models")
    ls.set_defaults(func=_cmd_list)
    return z
