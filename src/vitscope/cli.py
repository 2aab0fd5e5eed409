"""The `vitscope` command: list models and taps, run a study, rebuild a report."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Any, get_args

from vitscope.errors import STOPPED_BY, VitscopeError
from vitscope.models.registry import Family
from vitscope.zoo.cli import add_zoo_parser

EPILOG = """examples:
  vitscope models                               the model registry
  vitscope taps dino-b16                        every tap point of a model, with its shape
  vitscope analyses                             every analysis: parameters, taps, data, sources
  vitscope run                                  the embedded default study (offline)
  vitscope run study.yaml batch_size=16         a study of your own, with overrides
  vitscope recipes                              each source paper's study (run: recipe:NAME data_root=/data)
  vitscope datasets                             the dataset formats and what each provides
  vitscope report vitscope-runs/default         rebuild a run's report.html
  vitscope cache                                the cache by model and analysis (prune: --older-than, --max-size)
  vitscope report RUN_DIR --export figs --format pdf   every figure as a file, sized for a paper
  vitscope findings RUN_DIR --family mine=contrastive  which similarity findings hold under every measure
  vitscope zoo train --objective dino --out zoo/dino   train a model of the controlled zoo (docs/ZOO.md)
"""


def _arch_label(spec) -> str:  # noqa: ANN001 - ModelSpec
    """The timm factory name, plus the real size when the entry overrides the factory's (the zoo's ViT is
    built from vit_small_patch16_224 with 8 blocks x 96, patch 4, 32 px)."""
    kw = spec.model_kwargs
    size = [f"{kw['depth']} blocks" if "depth" in kw else "", f"x {kw['embed_dim']}" if "embed_dim" in kw else "",
            f"{kw['num_heads']} heads" if "num_heads" in kw else "",
            f"patch {kw['patch_size']}" if "patch_size" in kw else "",
            f"{kw['img_size']} px" if "img_size" in kw else ""]
    if not any(size[:2]):  # only the input size is overridden: the factory name says the architecture
        return spec.timm_name
    return f"{spec.timm_name} ({', '.join(p for p in size if p).replace(', x ', ' x ')})"


def _cmd_models(args: argparse.Namespace) -> int:
    from vitscope.models import list_specs
    from vitscope.models.registry import describe_family

    # the family as the report names it: "untrained", "contrastive → classification" for a fine-tuned model
    rows = [(s.name, _arch_label(s), describe_family(s.family, s.supervision), s.weights.kind,
             str(s.preprocessing.input_size), s.citation.split(",")[0])
            for s in list_specs() if args.family in (None, s.family)]
    head = ("name", "timm architecture", "family", "weights", "input", "citation")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"\n{len(rows)} models. Any timm ViT name or a local checkpoint works too; "
          "`vitscope taps NAME` shows a model's tap points.")
    return 0


def _cmd_taps(args: argparse.Namespace) -> int:
    from vitscope.taps_listing import text

    print(text(args.model, args.weights), end="")  # a registry entry: the shipped snapshot, no torch
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from vitscope.study.config import format_recipes

    print(format_recipes(), end="")  # the recipes' YAML read as text: no torch
    return 0


def _cmd_analyses(args: argparse.Namespace) -> int:
    from vitscope.analyses_listing import format_markdown, format_text, snapshot

    infos = snapshot(args.names)  # read off the code when it was generated: no torch (vitscope/analyses_listing.py)
    print(format_markdown(infos) if args.markdown else format_text(infos, full=bool(args.names)), end="")
    return 0


# signals that stop a study as Ctrl-C does (`_stop_as_ctrl_c`), and the one that did (for the exit code)
_STOP_SIGNALS = ("SIGTERM", "SIGHUP")
_stopped_by = STOPPED_BY


def _stop_as_ctrl_c() -> dict[int, Any]:
    """SIGTERM (a cluster's time limit or preemption, `kill`) and SIGHUP (a closed terminal) stop a study as
    Ctrl-C does: the pass saves its partial states and the run ends in one line, with exit code 128 + the
    signal's number, and the same command resumes. A signal its caller set to be ignored stays ignored (a
    `nohup` run goes on). Returns the handlers it replaced (`_restore`)."""
    import signal

    def stop(signum: int, _frame: Any) -> None:
        _stopped_by.append(signum)
        raise KeyboardInterrupt

    replaced = {}
    for name in _STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            replaced[sig] = signal.signal(sig, stop)
    return replaced


def _restore(handlers: dict[int, Any]) -> None:
    import signal

    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitscope.study.config import parse_models_slice

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)
        config = None
    models = parse_models_slice(args.models) if args.models is not None else None
    handlers = _stop_as_ctrl_c() if threading.current_thread() is threading.main_thread() else {}
    try:
        return _run(args, config, overrides, models)
    finally:
        _restore(handlers)
        from vitscope.study.helper import dismiss

        dismiss()  # one started early and given no models


def _run(args: argparse.Namespace, config: str | None, overrides: list[str], models: tuple[int, int] | None) -> int:
    from pathlib import Path

    from vitscope.study.config import early_refusals, load_config, slice_models

    def early(cfg: Any) -> None:
        """Before torch is imported (issue 41: a refusal within a second or so): a model name nothing knows, a
        missing or empty data folder, a run directory another run is writing into (a slice takes no lock; a dry
        run notes a model it cannot resolve); then the helper started, importing torch on the core this
        process leaves idle."""
        if models is not None:
            slice_models(cfg.models, *models)  # a slice with no models: one sentence before torch
        early_refusals(cfg, names=not args.dry_run,
                       lock=models is None and not args.dry_run and os.environ.get("RANK", "0") == "0")
        if models is None and not args.dry_run:
            from vitscope.study.config import recipe_name, recipe_path
            from vitscope.study.helper import prespawn

            recipe = recipe_name(config)
            prespawn(str(recipe_path(recipe)) if recipe is not None else config)

    cfg = load_config(config, overrides, early=early)  # the config's own checks that need no torch come first
    if args.quiet:
        cfg.progress = False
    if args.dry_run:
        from vitscope.study.cost import dry_run

        print(dry_run(cfg, models).text())
        return 0
    from vitscope.study import run_study  # torch and timm: after the config is known to be valid

    try:
        out = run_study(cfg, overwrite=args.overwrite, models=models)
    except (OSError, RuntimeError) as e:  # a write nothing explained yet: the file's own folder, the shared
        # memory the reading workers hand batches over in (torch says "unable to write to file </torch_...>"),
        # else the run directory's
        from vitscope.files import disk_error

        name = getattr(e, "filename", None)
        where = Path(name).parent if name else Path("/dev/shm") if "</torch_" in str(e) else Path(cfg.output_dir)
        err = disk_error(e, where)
        if err is e:
            raise
        raise err from e
    if os.environ.get("RANK", "0") == "0" and models is None:
        print(f"results: {out / 'results'}\nreport:  {out / 'report.html'}")
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    """`vitscope cache [DIR]` lists; `vitscope cache prune [DIR] --older-than 30d --max-size 2GB` removes (no torch)."""
    from pathlib import Path

    from vitscope.study.cache import human, listing, parse_age, parse_size, prune, units, user_cache_root

    words = list(args.args)
    pruning = bool(words) and words[0] == "prune"
    if pruning:
        words.pop(0)
    if len(words) > 1:
        raise VitscopeError(f"vitscope cache takes one directory, got {len(words)} ({' '.join(words)}): "
                            "`vitscope cache [DIR]` or `vitscope cache prune [DIR] --older-than 30d`")
    older = parse_age(args.older_than) if args.older_than is not None else None
    size = parse_size(args.max_size) if args.max_size is not None else None
    if (older is not None or size is not None) and not pruning:
        raise VitscopeError("--older-than and --max-size are options of `vitscope cache prune`")
    if pruning and older is None and size is None:
        raise VitscopeError("vitscope cache prune needs --older-than AGE (e.g. 30d) or --max-size SIZE (e.g. 2GB)")
    def states(folder: Path) -> Path:
        """A study's `cache_dir` is the states folder itself; $VITSCOPE_CACHE_DIR is vitscope's folder, which
        holds `states/`: either names the same cache here (the one of the two that holds entries)."""
        if (folder / "states").is_dir() and not units(folder):
            return folder / "states"
        return folder

    if words:
        root = states(Path(words[0]))
    else:
        user = user_cache_root()
        if user is None:
            raise VitscopeError("this user has no cache directory (no home directory): pass the cache_dir to list")
        root = user / "states" if units(user / "states") or not units(user) else user
    if root.exists() and not root.is_dir():
        raise VitscopeError(f"{str(root)!r} is a file, not a cache directory")
    if not pruning:
        print(listing(root), end="")
        return 0
    removed, left = prune(root, older, size)
    print(f"removed {len(removed)} entries ({human(sum(u.size for u in removed))}); the cache {root} holds "
          f"{human(left)}")
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from vitscope.data.catalog import CAPABILITIES, describe

    print(describe())
    print("\ncapabilities (what analyses need):")
    for k, v in CAPABILITIES.items():
        print(f"  {k:<13} {v}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitscope.report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise VitscopeError(f"{str(run_dir)!r} is not a directory: pass a run directory (the output_dir of a "
                            "`vitscope run`)")
    if not any((run_dir / "results").glob("*.parquet")):
        raise VitscopeError(f"{str(run_dir)!r} holds no results/*.parquet, so there is nothing to report: pass "
                            "the output_dir of a finished `vitscope run`")
    if args.export:
        from vitscope.report.export import export

        files = export(run_dir, args.export, args.format, args.columns)
        print(f"{len(files)} figures ({args.format}) in {args.export} (captions: {args.export}/figures.tsv)")
        return 0
    print(write_report(run_dir))
    return 0


def _cmd_findings(args: argparse.Namespace) -> int:
    from pathlib import Path

    import vitscope.findings as findings

    manifest = findings.read_manifest(args.run_dir)
    families = findings.parse_families(args.family, manifest["models"])
    table = findings.check_measures(args.run_dir, families)
    if table.empty:
        raise VitscopeError(findings.no_check_reason(args.run_dir, families))
    print(findings.to_markdown(table))
    if not (Path(args.run_dir) / "results" / "similarity.parquet").is_file():
        print(f"\nOnly CKA here: {findings.HOW_TO_GET_SIMILARITY} for the other measures.")
    print(f"\n-> {findings.write(args.run_dir, table)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vitscope", description="How Vision Transformers see, whatever taught them.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the same flags after the command (`vitscope run -q`); there SUPPRESS keeps the top-level value when absent
    common = argparse.ArgumentParser(add_help=False)
    for parser, default, shown in ((p, False, True), (common, argparse.SUPPRESS, False)):
        parser.add_argument("-v", "--verbose", action="store_true", default=default,
                            help="log what is loaded and computed" if shown else argparse.SUPPRESS)
        parser.add_argument("-q", "--quiet", action="store_true", default=default,
                            help="no progress bars, errors only" if shown else argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("models", help="list the model registry", parents=[common])
    m.add_argument("--family", choices=[f for f in get_args(Family) if f != "none"])
    m.set_defaults(func=_cmd_models)

    t = sub.add_parser("taps", help="list the tap points of a model, with shapes for one image", parents=[common])
    t.add_argument("model", help="registry name, timm name, or a vitscope checkpoint file")
    t.add_argument("--weights", help="checkpoint to load (the architecture alone is enough for shapes)")
    t.set_defaults(func=_cmd_taps)

    a = sub.add_parser("analyses", help="list the analyses: parameters, taps, data they need, sources",
                       parents=[common])
    a.add_argument("names", nargs="*", metavar="NAME", help="only these analyses, with their full description")
    a.add_argument("--markdown", action="store_true", help="as the markdown of docs/analyses.md")
    a.set_defaults(func=_cmd_analyses)

    rc = sub.add_parser("recipes", help="list the recipes: each source paper's study, run by `vitscope run "
                        "recipe:NAME data_root=/data`", parents=[common])
    rc.set_defaults(func=_cmd_recipes)

    r = sub.add_parser("run", help="run a study (the embedded default if no config is given)", parents=[common],
                       description="Run a study: each model once over the dataset, every analysis from that "
                                   "one pass. Overrides are OmegaConf dotlist: key=value, e.g. batch_size=16 "
                                   "dataset.n_images=512 'analyses.cka.views=[gap]'.")
    r.add_argument("config", nargs="?", help="study YAML, or recipe:NAME (`vitscope recipes`; give data_root=/path) "
                                             "(default: the embedded default study)")
    r.add_argument("overrides", nargs="*", help="key=value overrides")
    r.add_argument("--overwrite", action="store_true",
                   help="replace the results of another config in the output directory")
    r.add_argument("--models", metavar="K/N",
                   help="compute only the K-th of N slices of the models (round-robin) into the cache, for jobs on "
                        "several machines sharing it; a final run without --models writes tables and report "
                        "(docs/CLUSTER.md)")
    r.add_argument("--dry-run", action="store_true",
                   help="print what the run would cost (passes, forwards, cache growth, memory of the largest "
                        "batch's taps, superlinear finalize steps) without reading any weights or writing anything")
    r.set_defaults(func=_cmd_run)

    c = sub.add_parser("cache", help="list the cache by model and analysis, or prune it (least recently used first)",
                       parents=[common],
                       description="`vitscope cache [DIR]` lists the cache (default: this user's) by model and "
                                   "analysis with sizes and last use; `vitscope cache prune [DIR] --older-than 30d "
                                   "--max-size 2GB` removes entries unused for longer, then the least recently used "
                                   "until the cache fits.")
    c.add_argument("args", nargs="*", metavar="[prune] [DIR]", help="prune, and the cache directory")
    c.add_argument("--older-than", metavar="AGE", help="prune: entries last used longer ago (30d, 12h, 90min, 2w)")
    c.add_argument("--max-size", metavar="SIZE", help="prune: then least recently used first, down to SIZE "
                                                      "(2GB = 2e9 bytes, 2GiB or 2G = 2 x 1024^3)")
    c.set_defaults(func=_cmd_cache)

    d = sub.add_parser("datasets", help="list the dataset formats, what each provides and its options",
                       parents=[common])
    d.set_defaults(func=_cmd_datasets)

    rep = sub.add_parser("report", help="rebuild report.html of a run directory", parents=[common])
    rep.add_argument("run_dir")
    rep.add_argument("--export", metavar="DIR", help="write every figure as a file into DIR instead (for a paper)")
    rep.add_argument("--format", choices=["pdf", "svg", "png"], default="pdf",
                     help="with --export: vector pdf (fonts embedded), svg, or png at 300 dpi (default: pdf)")
    rep.add_argument("--columns", type=int, choices=[1, 2],
                     help="with --export: lay every figure out one (3.5 in) or two (7.16 in) columns wide "
                          "(default: the narrower that holds it)")
    rep.set_defaults(func=_cmd_report)

    fi = sub.add_parser("findings", parents=[common],
                        help="which similarity findings (contrastive vs MIM) hold under every similarity measure of a "
                             "run: holds / fails / inconclusive per measure",
                        description="Re-checks each similarity finding (two contrastive models more alike than "
                                    "contrastive and MIM) under every measure of the run's results/cka.parquet and "
                                    "results/similarity.parquet, and writes the table to "
                                    "results/summary/findings.parquet. Models are grouped by the objective family "
                                    "the manifest records (registry entries); give others with --family.")
    fi.add_argument("run_dir", help="the output_dir of a `vitscope run`")
    fi.add_argument("--family", action="append", default=[], metavar="LABEL=FAMILY",
                    help="a model's objective family (contrastive, reconstructive, explicit, language, hybrid, "
                         "none), for models the registry does not know; repeat for several")
    fi.set_defaults(func=_cmd_findings)

    add_zoo_parser(sub)
    return p


def _one_line_result_warnings() -> None:
    """A VitscopeWarning (a result that means little, images skipped) reaches the command line as one line,
    ``vitscope: warning: ...`` (not Python's file, line and source-line preamble); other warnings keep Python's
    format."""
    import warnings

    from vitscope.errors import VitscopeWarning

    if getattr(warnings.formatwarning, "_vitscope", False):  # installed already (main called again)
        return
    python_format = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):  # noqa: ANN001, ANN202 - warnings' signature
        if issubclass(category, VitscopeWarning):
            return f"vitscope: warning: {message}\n"
        return python_format(message, category, filename, lineno, line)

    fmt._vitscope = True  # type: ignore[attr-defined]
    warnings.formatwarning = fmt


def main(argv: list[str] | None = None) -> int:
    command_line = argv is None  # the `vitscope` command itself (tests and callers pass their arguments)
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 1):  # `--models -1/2`: argparse would take -1/2 for an option and say nothing useful
        if argv[i] == "--models" and argv[i + 1].startswith("-"):
            argv[i:i + 2] = [f"--models={argv[i + 1]}"]
            break
    args, extra = parser.parse_known_args(argv)
    # `vitscope run STUDY -q key=value`: overrides after a flag are overrides too (argparse ends a positional
    # list at the first flag); anything else left over is an error, as argparse would say
    if extra and getattr(args, "func", None) is _cmd_run and all("=" in a or a.startswith("~") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra and getattr(args, "func", None) is _cmd_cache and not any(a.startswith("-") for a in extra):
        args.args = [*args.args, *extra]  # `vitscope cache prune --older-than 30d DIR`: the folder after the options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    level = logging.ERROR if args.quiet else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s")
    _one_line_result_warnings()
    _stopped_by.clear()
    try:
        return int(args.func(args) or 0)
    except VitscopeError as e:
        print(f"vitscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: one line (a study says what is saved and that
        # rerunning resumes); the exit code of a process that signal ended, 128 + its number
        import signal

        said = str(e) or "interrupted"
        if _stopped_by:
            said = said.replace("interrupted", f"interrupted by {signal.Signals(_stopped_by[-1]).name}", 1)
        print(f"vitscope: {said}", file=sys.stderr)
        if command_line:  # what is left is the interpreter's exit: a second Ctrl-C ends it at once, silently
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        return 128 + (_stopped_by[-1] if _stopped_by else signal.SIGINT)
    except BrokenPipeError:  # `vitscope datasets | head`: the reader left; say nothing, as `cat` does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would raise again
        return 141


if __name__ == "__main__":
    sys.exit(main())
