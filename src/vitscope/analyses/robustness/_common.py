"""Shared plumbing of the robustness analyses (`vitscope.analyses.robustness`): the readouts (the
model's head, linear probes) and their label spaces, the chance rule, the intervals and the per-view state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar

import pandas as pd
import torch

from vitscope.analyses.base import Analysis
from vitscope.analyses.pooled import PooledTable
from vitscope.analyses.splits import ProbeFolds, TestEvery, check_test_every, split_warnings, stratified_test
from vitscope.bounds import Count, Iterations, Positive, Range
from vitscope.capture.views import token_view
from vitscope.data import perturb as P
from vitscope.errors import ConfigError, VitscopeError
from vitscope.host import host_copy, on_device, on_host
from vitscope.metrics import robustness as R
from vitscope.metrics import semantics as S

#: frequency bands: each is a pass over every image
Bands = Annotated[int, Range(1, 100, why="each band is one more pass over every image")]
#: a corruption severity of the ImageNet-C / CIFAR-10-C tables
Severity = Annotated[int, Range(min(P.SEVERITIES), max(P.SEVERITIES))]

READOUTS = ("auto", "head", "probe")
#: label spaces a classifier head may be declared to output (``head_classes``): ImageNet-1k (1000 logits), CIFAR-10
#: (10), CIFAR-100 (100, its fine labels in the official order: e.g. a model fine-tuned on CIFAR-100 scored on
#: CIFAR-100-C), 'dataset' (the user states that logit k is the dataset's class k, in its order: a model fine-tuned
#: on the user's own classes), or none (the head is not used)
HEAD_SPACES = ("imagenet-1k", "cifar10", "cifar100", "dataset", "none")
PROBE_COLUMNS = ("n_train", "n_test", "probe_weight_decay", "probe_iterations")  # what a probe row records


def check_head_classes(who: str, head_classes: str | None) -> None:
    """One sentence for a ``head_classes`` parameter that names no label space vitscope knows (None: the model's)."""
    if head_classes is not None and head_classes not in HEAD_SPACES:
        raise ConfigError(f"{who}: head_classes {head_classes!r} is not a label space vitscope knows; "
                          f"choose {', '.join(HEAD_SPACES)}")


#: logits of a head of each label space
HEAD_SIZES = {"imagenet-1k": 1000, "cifar10": 10, "cifar100": 100}


def check_head_size(who: str, vm: Any, head_classes: str | None) -> None:
    """One sentence when a declared ``head_classes`` space does not match the number of logits the model's head
    outputs (a model whose head size is unknown passes)."""
    want = HEAD_SIZES.get(str(head_classes))
    model = getattr(vm, "model", None)
    n = int(getattr(model, "num_classes", 0) or 0) if model is not None else 0
    if want and n and n != want:
        raise ConfigError(f"{who}: head_classes {head_classes!r} needs a head of {want} logits; "
                          f"{getattr(vm, 'name', 'the model')} has {n}")


def head_label_space(vm: Any) -> str | None:
    """What the model's classifier outputs: 'imagenet-1k' (1000 logits), 'cifar10' (a zoo model's 10-way head:
    the zoo trains on CIFAR-10), or None (headless, or a label space vitscope does not know)."""
    model = getattr(vm, "model", None)
    n = int(getattr(model, "num_classes", 0) or 0) if model is not None else 0
    if n == 1000:
        return "imagenet-1k"
    spec = getattr(vm, "spec", None)
    if n == 10 and spec is not None and str(getattr(spec, "name", "")).startswith("zoo-"):
        return "cifar10"
    return None


def known_classes(dataset: str | None) -> list[str] | None:
    """Class names of the datasets vitscope generates or knows by name (used when the planner does not pass
    the dataset's classes)."""
    if not dataset:
        return None
    from vitscope.data import silhouettes
    from vitscope.data.synthetic import SHAPES, VARIANT_NAMES

    if dataset in VARIANT_NAMES.values():
        return list(SHAPES)
    if dataset in silhouettes.NAMES.values():
        return list(silhouettes.CLASSES)
    if dataset.startswith("cifar100") or dataset.startswith("cifar-100"):
        from vitscope.data.formats.robustness import CIFAR100_CLASSES

        return list(CIFAR100_CLASSES)
    if dataset.startswith("cifar10") or dataset.startswith("cifar-10"):
        return list(R.CIFAR10_CLASSES)
    return None


def head_covers(space: str | None, classes: Sequence[str] | None) -> bool:
    """Whether a head of label space ``space`` decides among ``classes``."""
    if space is None or classes is None:
        return False
    if space == "imagenet-1k":
        return len(classes) == 1000 or (len(classes) > 1 and set(classes) <= set(R.CATEGORIES_16))
    if space == "cifar10":
        return list(classes) == list(R.CIFAR10_CLASSES)
    if space == "cifar100":
        from vitscope.data.formats.robustness import CIFAR100_CLASSES

        return list(classes) == list(CIFAR100_CLASSES)
    return space == "dataset"  # stated by the user: logit k is class k (`head_scores` checks the count)


def head_scores(space: str, classes: Sequence[str], logits: torch.Tensor) -> torch.Tensor:
    """(N, C) scores over the dataset's ``classes`` from the head's logits."""
    if space == "imagenet-1k" and len(classes) != 1000:
        return R.imagenet_to_16(logits, classes)
    if space == "dataset" and logits.shape[-1] != len(classes):
        raise ConfigError(f"head_classes 'dataset' says logit k is the dataset's class k, but the head gives "
                          f"{logits.shape[-1]} logits for the dataset's {len(classes)} classes; declare the head's "
                          f"label space ({', '.join(h for h in HEAD_SPACES if h != 'dataset')}) instead")
    return logits


def decision_rows(df: pd.DataFrame, head_only: bool = False, column: str = "decision") -> pd.DataFrame:
    """Per model, the head's rows and the last layer's probe rows, labelled in ``column`` ("head" or "probe,
    block N"); ``head_only``: the probe rows only for a model without a head (one decision per model, as the
    figures show it)."""
    out = []
    for _, g in df.groupby("model", sort=False):
        head = g[g.readout == "head"]
        if len(head):
            out.append(head.assign(**{column: "head"}))
            if head_only:
                continue
        probe = g[g.readout == "probe"]
        if len(probe):
            last = pd.to_numeric(probe["layer"]).max()
            out.append(probe[pd.to_numeric(probe["layer"]) == last].assign(**{column: f"probe, block {int(last)}"}))
    return pd.concat(out, ignore_index=True) if out else df.iloc[:0].assign(**{column: None})


def chance_reason(accuracy: float, n: int, chance: float) -> str | None:
    """Why a readout's bias or robustness figure is not reported: its clean ``accuracy`` on ``n`` images is within
    noise of ``chance`` (the 95 % Wilson interval reaches it); None when it is above chance (or unknown)."""
    lo, hi, _ = S.binomial_interval(accuracy, n)
    if not (math.isfinite(lo) and math.isfinite(chance)) or lo > chance:
        return None
    return (f"readout at chance: clean accuracy {accuracy:.3g} [{lo:.3g}, {hi:.3g}] on {n} images is within noise "
            f"of chance {chance:.3g}")


def shape_bias_interval(counts: Mapping[str, float]) -> dict[str, float]:
    """``stderr``, ``value_lo``, ``value_hi`` of a shape bias (`R.shape_bias_counts`): the Wilson interval of
    ``n_shape`` out of the ``n_shape + n_texture`` decisions that follow either cue (NaN without one)."""
    n = int(counts["n_shape"]) + int(counts["n_texture"])
    lo, hi, se = S.binomial_interval(float(counts["shape_bias"]), n)
    return {"stderr": se, "value_lo": lo, "value_hi": hi}


def _clean_columns(accuracy: float, n: int, chance: float) -> dict[str, float]:
    """``chance``, ``value_lo``, ``value_hi`` of a clean accuracy row."""
    lo, hi, _ = S.binomial_interval(accuracy, n)
    return {"chance": chance, "value_lo": lo, "value_hi": hi}


def _parse_view(view: str) -> tuple[str, dict[str, str]]:
    """'kind:a=1,b=2' -> ('kind', {'a': '1', 'b': '2'}); 'clean' -> ('clean', {})."""
    kind, _, args = str(view).partition(":")
    out = {}
    for part in filter(None, args.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = v.strip()
    return kind.strip(), out


class _Robustness(Analysis):
    """Shared plumbing: readout choice, pooled features per view (for probes) and head decisions per view."""

    needs: ClassVar[frozenset[str]] = frozenset({"labels"})
    inputs: ClassVar[dict[str, frozenset[str]]] = {}
    # 3: the head's decisions kept as tallies on the device (heads: {view: tensor}), not per image;
    # 2: stratified split decided in finalize (perturbed views keep every image), tuned probe, n_train / n_test
    state_version: ClassVar[int] = 3

    def __init__(self, vm: Any, layers: Any = None, readout: str = "auto", head_classes: str | None = None,
                 classes: Sequence[str] | None = None, token_view: str | None = None, max_images: Count = 5000,
                 test_every: TestEvery = 5, probe_tune: bool = True, probe_grid: Sequence[Positive] = S.PROBE_GRID,
                 probe_folds: ProbeFolds = 2, probe_max_iter: Iterations = 1000, probe_weight_decay: Positive = 1e-4):
        super().__init__(vm)
        if readout not in READOUTS:
            raise ConfigError(f"{self.name}: readout {readout!r} does not exist; choose {', '.join(READOUTS)}")
        check_head_classes(self.name, head_classes)
        check_head_size(self.name, vm, head_classes)
        self.layers = self.layers_param(layers)
        self.readout_param = readout
        self.head_space = (None if head_classes == "none" else head_classes) or head_label_space(vm)
        model = getattr(vm, "model", None)  # the head's logits, where known (0: unknown, e.g. a cached state's info)
        self.head_logits = int(getattr(model, "num_classes", 0) or 0) if model is not None else 0
        self.classes_param = list(classes) if classes is not None else None
        self.token_view = token_view or ("cls" if self.has_cls_token else "gap_spatial")
        self.max_images, self.test_every = int(max_images), check_test_every(test_every, self.name)
        self.probe_kw = S.probe_options(self.name, probe_tune, probe_grid, probe_folds, probe_max_iter,
                                        probe_weight_decay)
        self.own_split = False  # the dataset has its own split (batch.is_test), kept in the tables' is_test
        self.dataset_classes: dict[str, list[str] | None] = {}
        self.use_head: bool | None = None  # decided by `configure` (or at the first batch)
        self.use_probe: bool | None = None
        self.tables: dict[str, PooledTable] = {}
        # per view, a tally of the head's decisions on the features' device (`R.accuracy_tally`; shape_bias's
        # 'cue': `R.shape_bias_tally`): sums, so the decisions never wait for the host
        self.heads: dict[str, torch.Tensor] = {}
        self.seen: dict[str, int] = {}

    @classmethod
    def views(cls, params: dict) -> list[str]:
        """Views of the main dataset this analysis reads (the engine's contract; here: only the clean images)."""
        return ["clean"]

    # -- configuration ---------------------------------------------------------------------------------------
    def classes_of(self, slot: str) -> list[str] | None:
        if slot == "data" and self.classes_param is not None:
            return self.classes_param
        got = self.dataset_classes.get(slot)
        return list(got) if got is not None else known_classes(self.datasets.get(slot))

    def probe_possible(self) -> tuple[bool, str]:
        """(whether clean training images of the dataset's classes exist, why not)."""
        return True, ""

    def configure(self, dataset_classes: Mapping[str, Sequence[str] | None] | None = None) -> None:
        """Decide the readouts from the datasets' class names (``{slot: classes}``, slot 'data' = the main
        dataset); one sentence when no readout can decide among the dataset's classes."""
        if dataset_classes:
            self.dataset_classes = {k: list(v) if v is not None else None for k, v in dataset_classes.items()}
        classes = self.classes_of("data")
        head = head_covers(self.head_space, classes)
        if head and self.head_space == "dataset" and self.head_logits and self.head_logits != len(classes or ()):
            raise ConfigError(f"{self.name}: head_classes 'dataset' says logit k is class k of "
                              f"{self.datasets.get('data') or 'the dataset'}, but {self.model_name}'s head gives "
                              f"{self.head_logits} logits for its {len(classes or ())} classes")
        probe, why = self.probe_possible()
        what = self.datasets.get("data") or "the dataset"
        if self.readout_param == "head" and not head:
            space = self.head_space or "no classifier head"
            raise ConfigError(f"{self.name}: readout 'head' needs a classifier whose label space covers the classes "
                              f"of {what}; {self.model_name} has {space}" + ("" if classes else
                                                                             " and the classes are unknown"))
        if self.readout_param == "probe" and not probe:
            raise ConfigError(f"{self.name}: readout 'probe' needs clean training images of the same classes; {why}")
        if not head and not probe:
            raise ConfigError(f"{self.name}: {self.model_name} has no classifier head covering the classes of {what} "
                              f"and there are no clean images for a linear probe ({why}); give a dataset of the "
                              "same classes as the probe's training data or use a model with such a head")
        self.use_head = head and self.readout_param in ("auto", "head")
        self.use_probe = probe and self.readout_param in ("auto", "probe")

    def required_taps(self) -> list[str]:
        taps = [f"block{i}.out" for i in self.layers] if self.use_probe is not False else []
        return taps + (["logits"] if self.use_head is not False and self.head_space else [])

    # -- accumulation -----------------------------------------------------------------------------------------
    def _slot(self, batch: Any) -> str:
        ds = getattr(batch, "dataset", None)
        for slot, name in self.datasets.items():
            if slot != "data" and name is not None and name == ds:
                return slot
        return "data"

    def _is_test(self, batch: Any, take: int) -> torch.Tensor:
        """The dataset's own split of the batch's rows; all False when it has none (decided in finalize)."""
        if batch.is_test is not None:
            self.own_split = True
            return on_host(batch.is_test)[:take].bool()
        return torch.zeros(take, dtype=torch.bool)

    def _split(self, table: PooledTable) -> torch.Tensor:
        """Test flags of a table of clean training images: the dataset's own, else `stratified_test`."""
        if self.own_split:
            return table.column("is_test")
        return stratified_test(table.column("ids"), table.column("labels"), self.test_every)

    def _check_split(self, y: torch.Tensor, test: torch.Tensor) -> bool:
        """`split_warnings` for this model's probe split; False when no class can be scored."""
        names = self.classes_of("train" if "train" in self.datasets and self.name == "shape_bias" else "data")
        return split_warnings(f"{self.name}: model {self.model_name!r}, probe split", y, test, names)

    def _probe(self, train: torch.Tensor, y: torch.Tensor, tests: list[torch.Tensor], c: int
               ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Decisions of one tuned probe on each of ``tests``, and the columns that record it."""
        decs, fit = R.probe_fit_decisions(train, y, tests, c, where=f"{self.name}: model {self.model_name!r}",
                                          device=self.device, **self.probe_kw)
        cols = {"probe_weight_decay": fit.weight_decay if fit else float("nan"),
                "probe_iterations": fit.iterations if fit else float("nan")}
        return decs, cols

    def _pool(self, feats: Mapping[str, torch.Tensor], take: int) -> list[torch.Tensor]:
        return [token_view(feats[f"block{i}.out"][:take], self.token_view, self.num_prefix_tokens, self.has_cls_token)
                for i in self.layers]

    def _add_pooled(self, key: str, feats: Mapping[str, torch.Tensor], batch: Any, take: int, labels: torch.Tensor,
                    is_test: torch.Tensor) -> None:
        """Pooled features of the batch's first ``take`` rows at every layer (what the probes read) under ``key``:
        the batch's one copy to the host (`PooledTable.append`)."""
        self.tables.setdefault(key, PooledTable(len(self.layers))).append(
            self._pool(feats, take), on_host(batch.index)[:take].long(), labels, is_test)

    def _head_decisions(self, feats: Mapping[str, torch.Tensor], take: int) -> tuple[torch.Tensor, int]:
        """The head's decisions for the batch's first ``take`` rows, on the device, and how many classes they are
        among (the dataset's)."""
        scores = head_scores(self.head_space, self.classes_of("data"), feats["logits"][:take].detach())
        return scores.argmax(1), scores.shape[1]

    def _add_tally(self, key: str, tally: torch.Tensor) -> None:
        """Add a tally of head decisions to ``key``'s, on the tally's device (a batch's: a loaded state sits on the
        CPU until then)."""
        mine = self.heads.get(key)
        if mine is not None and mine.shape != tally.shape:
            raise VitscopeError(f"{self.name}: view {key!r} was tallied with {len(mine)} counts, this batch with "
                                f"{len(tally)} (a different number of classes)")
        self.heads[key] = tally if mine is None else on_device(mine, tally.device) + tally

    def _ensure_configured(self, batch: Any) -> None:
        """Decide the readouts at the first batch when no one called `configure` (the study runner does not yet):
        the main dataset's classes come from the parameter ``classes``, ``batch.extra['class_names']`` (set by the
        file formats and the generated shapes), or its name."""
        if self.use_head is None or self.use_probe is None:
            names = batch.extra.get("class_names") if self._slot(batch) == "data" else None
            self.configure({"data": list(names)} if names is not None and not self.dataset_classes else None)

    # -- protocol -----------------------------------------------------------------------------------------
    def merge(self, other: Analysis) -> None:
        assert isinstance(other, type(self)) and other.layers == self.layers
        for k, t in other.tables.items():
            self.tables.setdefault(k, PooledTable(len(self.layers))).extend(t)
        for k, tally in other.heads.items():  # added on this part's device
            mine = self.heads.get(k)
            self._add_tally(k, tally.clone() if mine is None else on_device(tally, mine.device))
        for k, n in other.seen.items():
            self.seen[k] = self.seen.get(k, 0) + n
        self.n_images += other.n_images
        self.own_split = self.own_split or other.own_split
        if self.use_head is None:
            self.use_head, self.use_probe = other.use_head, other.use_probe

    def state_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "token_view": self.token_view, "head_space": self.head_space,
                "use_head": self.use_head, "use_probe": self.use_probe, "datasets": dict(self.datasets),
                "dataset_classes": self.dataset_classes,
                "tables": {k: t.state_dict() for k, t in self.tables.items()},
                "heads": {k: host_copy(t) for k, t in self.heads.items()},
                "seen": dict(self.seen), "n_images": self.n_images, "own_split": self.own_split}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.layers, self.token_view = list(state["layers"]), state["token_view"]
        self.head_space, self.use_head, self.use_probe = state["head_space"], state["use_head"], state["use_probe"]
        self.datasets = dict(state.get("datasets") or self.datasets)
        self.dataset_classes = dict(state.get("dataset_classes") or {})
        self.tables = {k: PooledTable.from_state(t) for k, t in state["tables"].items()}
        self.heads = {k: t.clone() for k, t in state["heads"].items()}
        self.seen, self.n_images = dict(state["seen"]), int(state["n_images"])
        self.own_split = bool(state.get("own_split", False))

    def _num_classes(self, *labels: torch.Tensor) -> int:
        classes = self.classes_of("data")
        seen = max((int(y.max()) + 1 for y in labels if len(y)), default=1)
        return max(len(classes) if classes else 0, seen)


def _reason_of(g: pd.DataFrame) -> str:
    """The first ``reason`` among the rows (a key-numbers cell; empty where every figure is reported)."""
    reasons = g["reason"].dropna() if "reason" in g.columns else []
    return str(reasons.iloc[0]) if len(reasons) else ""


def _with_reason(df: pd.DataFrame) -> pd.DataFrame:
    """The ``reason`` column present (None where a figure is reported)."""
    if "reason" not in df.columns:
        df["reason"] = None
    return df
