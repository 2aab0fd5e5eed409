"""The study plan, made at config time before any model loads: which dataset feeds which analysis, under
which views, which models are related, and in which order models are processed.

Matching: an analysis declares what its main dataset must provide (``needs``) and any further inputs
(``inputs``); the user may name the dataset (``dataset: NAME``, ``<slot>_dataset: NAME`` in its parameters),
otherwise it gets the first of the study's datasets that provides what it needs. A mismatch is one
sentence naming what is missing and which configured or built-in datasets have it.

Models: an analysis runs on every model of the study unless its entry names some (``models: [LABEL, ...]``, the
labels as `label_of` gives them); then its passes, cache entries, estimate, table rows and cross-model stage are
of those models alone, and the others never configure it (a readout one of them cannot give is no refusal).
Pair analyses name theirs with ``pairs``.

Passes: each analysis subscribes to (dataset, view) passes: its main dataset under every view it asks for
(clean first), and its further inputs clean. The runner makes one forward pass per (model, dataset, view)
that any unfinished analysis of that model needs, shared by all of them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from vitscope.analyses import get_analysis
from vitscope.data.views import CLEAN, check_view
from vitscope.errors import ConfigError, close_matches
from vitscope.study.slots import MAIN, analysis_models, check_dataset_formats, match_slots, study_datasets

PLANNER_KEYS = ("dataset", "pairs", "models")  # analysis parameters the planner reads and strips (and `<slot>_dataset`)


@dataclass
class AnalysisPlan:
    name: str
    cls: type
    params: dict[str, Any]                 # the constructor's parameters (planner keys stripped)
    slots: dict[str, str]                  # slot -> dataset name ("data" is the main one)
    views: list[str]                       # view keys of the main dataset, clean first
    pair: bool = False
    pairs: list[tuple[str, str]] = field(default_factory=list)
    models: list[str] | None = None        # the labels it runs on, in study order (None: every model)

    def runs_on(self, label: str) -> bool:
        """Whether this (single-model) analysis runs on the model labelled ``label``."""
        return self.models is None or label in self.models

    @property
    def passes(self) -> list[tuple[str, str]]:
        """(dataset, view) in feeding order: the main dataset clean, further inputs clean, the main views."""
        main = self.slots[MAIN]
        out = [(main, CLEAN)]
        out += [(d, CLEAN) for s, d in self.slots.items() if s != MAIN and (d, CLEAN) not in out]
        out += [(main, v) for v in self.views if v != CLEAN]
        return out

    def batch_sizes(self) -> list[int]:
        """Every ``batch_size`` the analysis will use (given or its default): shards align to them."""
        value = self.params.get("batch_size", _default(self.cls, "batch_size"))
        return [int(value)] if isinstance(value, int) and value > 0 else []


@dataclass
class Plan:
    datasets: dict[str, Any]               # name -> DatasetConfig, those some analysis uses, in config order
    analyses: list[AnalysisPlan]
    models: list[Any]                      # ModelConfig, parents before their fine-tuned models

    def align(self, dataset: str, batch_size: int) -> int:
        """Shard boundaries on ``dataset`` are multiples of this (the forward batch and every analysis batch)."""
        import math

        a = batch_size
        for ap in self.analyses:
            if dataset in ap.slots.values():
                for b in ap.batch_sizes():
                    a = math.lcm(a, b)
        return a

    def single_of(self, label: str) -> list[AnalysisPlan]:
        """The single-model analyses that run on the model labelled ``label`` (its ``models``), in plan order."""
        return [ap for ap in self.analyses if not ap.pair and ap.runs_on(label)]


def _default(cls: type, name: str) -> Any:
    p = inspect.signature(cls.__init__).parameters.get(name)
    return None if p is None or p.default is p.empty else p.default


def label_of(m: Any) -> str:
    return m.label or m.name


def make_plan(cfg: Any) -> Plan:
    datasets = study_datasets(cfg)
    check_dataset_formats(cfg)  # `vitscope run` checks them before it imports torch too
    models = _order_models(cfg.models)
    labels = [label_of(m) for m in models]
    plans = []
    for name, raw in cfg.analyses.items():
        cls = get_analysis(name)
        raw = dict(raw or {})
        slots = match_slots(name, cls.needs, cls.inputs or {}, raw, datasets)
        for key in ["dataset", *(f"{slot}_dataset" for slot in cls.inputs or {})]:
            raw.pop(key, None)
        pair = bool(getattr(cls, "pair", False))
        pairs: list[tuple[str, str]] = []
        if pair:
            pairs = _pairs(name, raw.pop("pairs", None), models, labels)
        chosen = analysis_models(name, raw.pop("models", None), labels)
        if pair and chosen is not None:
            raise ConfigError(f"analyses.{name} compares model pairs: name them with `pairs: [[A, B]]`, not `models`")
        main = datasets.get(slots.get(MAIN, ""))
        if main is not None and main.name in getattr(cls, "corrupted_formats", ()):
            views = [CLEAN]  # the images come corrupted (their own corruption and severity): nothing goes on top
        else:
            views = [check_view(v) for v in cls.views(raw)]
        if CLEAN not in views:
            views.insert(0, CLEAN)
        plans.append(AnalysisPlan(name, cls, raw, slots, views, pair, pairs, chosen))
    used = {d for ap in plans for d in ap.slots.values()}
    return Plan({n: d for n, d in datasets.items() if n in used}, plans, models)


def _pairs(analysis: str, given: Any, models: list[Any], labels: list[str]) -> list[tuple[str, str]]:
    if given is not None:
        pairs = []
        for p in given:
            p = list(p)
            if len(p) != 2:
                raise ConfigError(f"analyses.{analysis}.pairs: each pair is [A, B]; got {p}")
            for x in p:
                if x not in labels:
                    hint = close_matches(str(x), labels)
                    raise ConfigError(f"analyses.{analysis}.pairs: no model labelled {x!r}"
                                      + (f"; did you mean {', '.join(hint)}?" if hint else ""))
            pairs.append((str(p[0]), str(p[1])))
    else:
        pairs = [(m.finetuned_from, label_of(m)) for m in models if m.finetuned_from]
    if not pairs:
        raise ConfigError(f"analyses.{analysis} compares model pairs: declare `finetuned_from: LABEL` on a model "
                          f"or give analyses.{analysis}.pairs: [[A, B]]")
    return pairs


def _order_models(models: list[Any]) -> list[Any]:
    """Config order, except that a model comes after the one it was fine-tuned from."""
    labels = [label_of(m) for m in models]
    by_label = dict(zip(labels, models, strict=True))
    for m in models:
        if m.finetuned_from is not None:
            if m.finetuned_from not in by_label:
                hint = close_matches(str(m.finetuned_from), labels)
                raise ConfigError(f"model {label_of(m)!r}: finetuned_from names no model of the study: "
                                  f"{m.finetuned_from!r}" + (f"; did you mean {', '.join(hint)}?" if hint else ""))
            if m.finetuned_from == label_of(m):
                raise ConfigError(f"model {label_of(m)!r} cannot be fine-tuned from itself")
    out: list[Any] = []
    placing: set[str] = set()

    def place(m: Any) -> None:
        lab = label_of(m)
        if any(label_of(x) == lab for x in out):
            return
        if lab in placing:
            raise ConfigError(f"models: finetuned_from relations form a cycle through {lab!r}")
        placing.add(lab)
        if m.finetuned_from is not None:
            place(by_label[m.finetuned_from])
        out.append(m)

    for m in models:
        place(m)
    return out
