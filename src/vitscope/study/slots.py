"""The study's datasets (`DatasetConfig`, `study_datasets`; `vitscope.study.config` re-exports them, and the
planner reads them here) and which of them each analysis reads, decided without torch: its main input
(``needs``) and its named inputs (``inputs``) matched with the datasets by what their formats provide
(`vitscope.data.catalog`).
`vitscope.study.config.check` runs it from the shipped listing before torch is imported; the planner
(`vitscope.study.plan`) runs it from the analysis classes. A mismatch is one sentence naming what is missing
and which configured or built-in datasets have it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vitscope.data.catalog import FORMATS, get_format
from vitscope.errors import ConfigError, close_matches

MAIN = "data"  # the slot of an analysis's main dataset


@dataclass
class DatasetConfig:
    name: str = "synthetic-shapes"         # the format: `vitscope datasets` lists them
    n_images: int = 256                    # generated items, or at most this many of a real dataset
    seed: int = 0
    size: int | None = None                # pixels: generated sets, or whole frames' resized side (davis 480)
    root: str | None = None                # real formats: the dataset's folder
    split: str | None = None               # davis: train | val; spair71k: trn | val | test; cifar10: train | test
    annotations: str | None = None         # coco / partimagenet: the annotation json
    classes: str | None = None             # imagefolder: class-list file (e.g. the ImageNet-50 ids)
    per_class: int | None = None           # imagefolder: first N sorted files per class
    test_root: str | None = None           # imagefolder: same classes, the test split (default root/test|val)
    options: dict[str, Any] = field(default_factory=dict)  # further arguments of the format's loader


def study_datasets(cfg: Any) -> dict[str, DatasetConfig]:
    """The study's named datasets: ``datasets`` in order, after the ``dataset`` shorthand (named after its
    format); the generated shapes when neither is given."""
    out: dict[str, DatasetConfig] = {}
    if cfg.dataset is not None:
        out[cfg.dataset.name] = cfg.dataset
    for name, d in cfg.datasets.items():
        if name in out:
            raise ConfigError(f"dataset name {name!r} is given twice (as `dataset:` and under `datasets:`)")
        out[name] = d
    return out or {"synthetic-shapes": DatasetConfig()}


def check_dataset_formats(cfg: Any) -> None:
    """Every dataset of the study names a format, and gives the `root` and annotation file the format reads
    (`vitscope.study.config.check`; the plan checks it too, `vitscope.study.plan.make_plan`): one ConfigError
    sentence otherwise."""
    for dn, dc in study_datasets(cfg).items():
        where = "dataset" if cfg.dataset is not None and cfg.dataset is dc else f"datasets.{dn}"
        try:
            fmt = get_format(dc.name)
        except ConfigError as e:
            raise ConfigError(f"{where}.name: {e}") from None
        if "root" in fmt.options and not dc.root:
            raise ConfigError(f"{where}.root: the {dc.name} format reads its files from `root`, and none is given")
        if "annotations" in fmt.options and not dc.annotations:
            raise ConfigError(f"{where}.annotations: the {dc.name} format needs its annotation file")


def match_slots(analysis: str, needs: Iterable[str], inputs: Mapping[str, Iterable[str]], params: Mapping[str, Any],
                datasets: Mapping[str, Any]) -> dict[str, str]:
    """``{slot: dataset name}`` for ``analysis``: its main dataset (``params['dataset']`` or the first of
    ``datasets`` that provides ``needs``) and each of its ``inputs`` (``params['<slot>_dataset']`` or the first
    that provides what it needs); a ``*_dataset`` key that names no input is refused."""
    slots = {MAIN: _match(analysis, MAIN, frozenset(needs), params.get("dataset"), datasets)}
    for slot, wants in inputs.items():
        slots[slot] = _match(analysis, slot, frozenset(wants), params.get(f"{slot}_dataset"), datasets)
    stray = [k for k in params if str(k).endswith("_dataset") and str(k)[:-len("_dataset")] not in inputs]
    if stray:
        names = ", ".join(["dataset", *(f"{s}_dataset" for s in inputs)])
        raise ConfigError(f"analyses.{analysis}.{stray[0]}: {analysis} has no such input "
                          + (f"(its inputs: {names})" if inputs else "(its only input: dataset)"))
    return slots


def check_dataset_name(analysis: str, key: str, given: Any, datasets: Mapping[str, Any]) -> None:
    """An analysis's ``dataset`` (or ``<input>_dataset``) one of the study's ``datasets``, else one sentence with
    the close matches."""
    if not isinstance(given, str):
        raise ConfigError(f"analyses.{analysis}.{key} must name one of the study's datasets "
                          f"({', '.join(datasets)}); got {given!r}")
    if given not in datasets:
        hint = close_matches(given, list(datasets))
        raise ConfigError(f"analyses.{analysis}.{key}: no dataset named {given!r} in the study"
                          + (f"; did you mean {', '.join(hint)}?" if hint else ".")
                          + f" Datasets: {', '.join(datasets)}.")


def _match(analysis: str, slot: str, needs: frozenset[str], given: str | None, datasets: Mapping[str, Any]) -> str:
    what = "" if slot == MAIN else f" (its input {slot!r})"
    key = "dataset" if slot == MAIN else f"{slot}_dataset"
    if given is not None:
        check_dataset_name(analysis, key, given, datasets)
        missing = needs - get_format(datasets[given].name).provides
        if missing:
            raise ConfigError(f"analyses.{analysis}{what} needs {', '.join(sorted(missing))}, which dataset "
                              f"{given!r} ({datasets[given].name}) does not provide; {_who_has(needs, datasets)}")
        return given
    for dn, dc in datasets.items():
        if needs <= get_format(dc.name).provides:
            return dn
    raise ConfigError(f"analyses.{analysis}{what} needs a dataset with {', '.join(sorted(needs))}, and none of the "
                      f"study's datasets ({', '.join(datasets)}) has it; {_who_has(needs, datasets)}")


def _who_has(needs: frozenset[str], datasets: Mapping[str, Any]) -> str:
    configured = [dn for dn, dc in datasets.items() if needs <= get_format(dc.name).provides]
    builtin = [f.name for f in FORMATS.values() if needs <= f.provides]
    builtin.sort(key=lambda n: not FORMATS[n].generated)
    parts = []
    if configured:
        parts.append(f"configured datasets that have it: {', '.join(configured)} (name one with `dataset:`)")
    parts.append(f"formats that have it: {', '.join(builtin) or 'none'} (add one under `datasets:`)")
    return "; ".join(parts) + "."


def analysis_models(analysis: str, given: Any, labels: list[str]) -> list[str] | None:
    """The models ``analysis`` runs on (its planner key ``models``: a label or a list of labels; the label of a
    ``checkpoints:`` list names all its epochs, ``<label>@<epoch>``) in the order of ``labels``, the study's; None
    where not given (every model). An unknown label, an empty list or anything else is one ConfigError sentence
    with the closest labels, before any model loads (no torch needed)."""
    if given is None:
        return None
    where = f"analyses.{analysis}.models"
    names = [given] if isinstance(given, str) else given
    if isinstance(names, dict) or not hasattr(names, "__iter__"):
        raise ConfigError(f"{where} must be a list of model labels, not {given!r}")
    names = list(names)
    if not names:
        raise ConfigError(f"{where} is empty: name at least one model, or leave the key out to run on every model")
    chosen: set[str] = set()
    for x in names:
        epochs = [lab for lab in labels if isinstance(x, str) and lab.startswith(f"{x}@")]  # a checkpoints: list
        if not isinstance(x, str) or (x not in labels and not epochs):
            hint = close_matches(str(x), labels)
            said = f"; did you mean {', '.join(hint)}?" if hint else f"; its models: {', '.join(labels)}"
            raise ConfigError(f"{where}: no model labelled {x!r} in the study{said}")
        chosen.update([x] if x in labels else epochs)
    return [lab for lab in labels if lab in chosen]
