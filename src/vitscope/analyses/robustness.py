"""Robustness lenses per layer (math in `vitscope.metrics.robustness`, perturbations in
`vitscope.data.perturb`): shape vs texture bias, frequency-band noise, common corruptions.

Every number needs class decisions, from one of two *readouts* (column ``readout``):

- ``head``: the model's own classifier, when its label space covers the dataset's classes: an ImageNet-1k
  head on the 16 cue-conflict categories through the 16-class mapping of Geirhos et al. (ICLR 2019; the
  mean probability of each category's ImageNet classes), on a 1000-class ImageNet dataset directly; a zoo
  model's CIFAR-10 head on CIFAR-10. One decision per image (``layer`` empty).
- ``probe``: at every layer, a linear probe (`vitscope.metrics.semantics.linear_probe`, as the semantics
  analysis fits) on the pooled tokens (CLS, else the mean of the patch tokens) of clean images of the same
  classes: for ``shape_bias`` the ``train`` input (in the default study the generated `synthetic-silhouettes`,
  shape-only and texture-only images each labelled by its cue, so the probe learns every class from either cue;
  `vitscope.data.silhouettes`), for ``band_noise`` / ``corruptions`` the clean
  images of the dataset's own train split (``batch.is_test``), else of the stratified split of
  `vitscope.analyses.splits` (per class, every ``test_every``-th image in id order is a test image; decided
  in ``finalize``, so perturbed views keep every image's features until then), scored on its test split,
  clean and perturbed. The probe picks its weight decay by cross-validation on its training images, as
  semantics' does (``probe_tune``, ``probe_grid``, ``probe_folds``, ``probe_max_iter``); probe rows record
  ``n_train``, ``n_test``, ``probe_weight_decay`` and ``probe_iterations``, and a class without training
  images or with fewer than two test images warns, naming it.

A readout whose clean accuracy is within noise of chance (its 95 % Wilson interval reaches the majority-class
rate) decides nothing worth reading: its bias or robustness figures (``shape_bias``; ``drop``;
``relative_drop``, ``mca_relative_drop``) are left empty (NaN) and the column ``reason`` says why
(`chance_reason`); the clean accuracy rows carry ``chance``, ``value_lo`` and ``value_hi``.

``readout: auto`` computes both where possible (the head where it covers the data; probes where clean
training images exist), ``head`` / ``probe`` one of them; neither possible fails at configuration with one
sentence. Perturbations are views of the main dataset (`views()`), one forward pass each, shared by every
model and cached like the clean pass; the images are generated on the fly, deterministic per (image, view,
seed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar

import pandas as pd
import torch

from vitscope.analyses.base import Analysis, register_analysis
from vitscope.analyses.pooled import PooledTable
from vitscope.analyses.splits import ProbeFolds, TestEvery, check_test_every, split_warnings, stratified_test
from vitscope.bounds import Count, Iterations, NonNegative, Positive, Range
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
HEAD_SPACES = ("imagenet-1k", "cifar10", "none")
PROBE_COLUMNS = ("n_train", "n_test", "probe_weight_decay", "probe_iterations")  # what a probe row records


def check_head_classes(who: str, head_classes: str | None) -> None:
    """One sentence for a ``head_classes`` parameter that names no label space vitscope knows (None: the model's)."""
    if head_classes is not None and head_classes not in HEAD_SPACES:
        raise ConfigError(f"{who}: head_classes {head_classes!r} is not a label space vitscope knows; "
                          f"choose {', '.join(HEAD_SPACES)}")


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
    return False


def head_scores(space: str, classes: Sequence[str], logits: torch.Tensor) -> torch.Tensor:
    """(N, C) scores over the dataset's ``classes`` from the head's logits."""
    if space == "imagenet-1k" and len(classes) != 1000:
        return R.imagenet_to_16(logits, classes)
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
        self.layers = self.layers_param(layers)
        self.readout_param = readout
        self.head_space = (None if head_classes == "none" else head_classes) or head_label_space(vm)
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


# ---------------------------------------------------------------- shape vs texture bias
@register_analysis
class ShapeBias(_Robustness):
    """Shape vs texture bias on cue-conflict images (Geirhos et al., ICLR 2019; per model in Park et al., "What do
    self-supervised ViTs learn?", ICLR 2023, last layer only): among the decisions that are either the shape
    class or the texture class, the fraction that follow the shape, with the counts (``n_shape``,
    ``n_texture``, ``n_other``; images whose shape and texture class agree are left out). Per layer from
    linear probes fitted on the clean ``train`` input (images of the same classes: the generated silhouettes'
    shape-only and texture-only images, or scenes with random textures, a shape-only probe), and from
    the model's head where it covers the classes. Rows per (readout, layer): ``shape_bias``, ``n_shape``,
    ``n_texture``, ``n_other``, ``n_images`` (images whose cues differ), ``n_excluded``, ``shape_match`` /
    ``texture_match``, and ``clean_accuracy`` of the probe on held-out clean training images.
    ``match_denominator``: what ``shape_match`` / ``texture_match`` divide by, ``all`` (default: every
    cue-conflict image, the left-out ones included, as model-vs-human's ``fraction-correct-shape`` /
    ``-texture``) or ``kept`` (the images whose cues differ); a column of the table. The shape bias does not
    depend on it. It carries a 95 % Wilson interval (``value_lo``, ``value_hi``) and ``stderr`` over the
    ``n_shape + n_texture`` decisions it is the fraction of (`shape_bias_interval`; the decisions of a fixed
    readout are independent trials; benchmarks/calibration.py, docs/CALIBRATION.md)."""

    name = "shape_bias"
    description = "shape vs texture bias on cue-conflict images, per layer (probes) and for the head"
    needs = frozenset({"cue_conflict"})
    inputs = {"train": frozenset({"labels"})}
    state_version = 6  # 6: the shape bias's Wilson interval; 5: the head's decisions as a tally (`R.shape_bias_tally`);
    # 4: no shape bias from a probe at chance (reason); 3: stratified split, tuned probe;
    # 2: match_denominator (every image by default)

    def __init__(self, vm: Any, match_denominator: str = "all", **kw: Any):
        super().__init__(vm, **kw)
        self.match_denominator = R.check_match_denominator(match_denominator)
        self.cue_texture: list[torch.Tensor] = []  # texture class of each row of tables['cue'], in order

    @classmethod
    def views(cls, params: dict) -> list[str]:
        """Only the clean images; called by the planner at configuration, so an unknown ``match_denominator`` is
        one sentence before any model loads."""
        R.check_match_denominator(params.get("match_denominator", "all"))
        return ["clean"]

    def merge(self, other: Analysis) -> None:
        super().merge(other)
        assert isinstance(other, ShapeBias)
        self.cue_texture.extend(other.cue_texture)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "cue_texture": torch.cat(self.cue_texture) if self.cue_texture
                else torch.empty(0, dtype=torch.long)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.cue_texture = [state["cue_texture"]] if len(state["cue_texture"]) else []

    def _check_train_classes(self, names: Sequence[str] | None) -> None:
        """At the first clean training batch (when `configure` was not told the classes): the probe's classes
        must be the cue-conflict images' classes."""
        if names is None:
            return
        self.dataset_classes["train"] = list(names)
        ok, why = self.probe_possible()
        if not ok and self.use_probe:
            if not self.use_head:
                raise ConfigError(f"shape_bias: {self.model_name} has no classifier head covering the cue-conflict "
                                  f"classes and there are no clean images for a linear probe ({why})")
            self.use_probe = False  # the head decides; no probe rows

    def probe_possible(self) -> tuple[bool, str]:
        train = self.datasets.get("train")
        if "train" in self.datasets and train is None:
            return False, "no dataset provides clean labelled training images"
        if train is not None and train == self.datasets.get("data"):
            raise ConfigError(f"shape_bias: its train input is the cue-conflict set {train!r} itself; name a dataset "
                              "of clean images of the same classes with train_dataset: (e.g. synthetic-silhouettes)")
        mine, theirs = self.classes_of("data"), self.classes_of("train")
        if mine is not None and theirs is not None and list(mine) != list(theirs):
            return False, (f"the training images ({train}) have other classes than the cue-conflict images "
                           f"({len(theirs)} vs {len(mine)} classes)")
        return True, ""

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self._ensure_configured(batch)
        slot = self._slot(batch)
        texture = batch.extra.get("texture_labels") if slot == "data" else None
        if slot == "data" and texture is None and "train" not in self.datasets:
            slot = "train"  # by hand (no planner): batches without texture labels are the clean training images
        key = "cue" if slot == "data" else "train"
        if key == "train" and not self.seen.get("train") and "train" not in self.dataset_classes:
            self._check_train_classes(batch.extra.get("class_names"))
        take = min(self.max_images - self.seen.get(key, 0), len(batch))
        if take <= 0:
            return
        labels = on_host(batch.labels)[:take].long()
        if key == "cue":
            tex = on_host(torch.as_tensor(texture))[:take].long()
            if self.use_head:  # before the probe's copy to the host: a tally on the device
                d, _ = self._head_decisions(feats, take)
                self._add_tally("cue", R.shape_bias_tally(d, on_device(labels, d.device), on_device(tex, d.device)))
            if self.use_probe:
                self._add_pooled("cue", feats, batch, take, labels, torch.ones(take, dtype=torch.bool))
                self.cue_texture.append(tex)
            self.n_images += take
        elif self.use_probe:
            self._add_pooled("train", feats, batch, take, labels, self._is_test(batch, take))
        self.seen[key] = self.seen.get(key, 0) + take

    @staticmethod
    def key_numbers(df: pd.DataFrame) -> pd.DataFrame:
        """Per model and readout (head; last-layer probe): shape bias, its counts, the probe's clean accuracy;
        and the block where the probes' shape bias peaks."""
        rows = []
        for (model, decision), g in decision_rows(df).groupby(["model", "decision"], sort=False):
            v = g.set_index("metric")["value"]
            row = {"model": model, "readout": decision, "shape bias": v.get("shape_bias"),
                   "shape / texture / other": f"{int(v.get('n_shape', 0))} / {int(v.get('n_texture', 0))} / "
                                              f"{int(v.get('n_other', 0))}",
                   "clean accuracy (probe)": v.get("clean_accuracy", float("nan"))}
            per = df[(df.model == model) & (df.metric == "shape_bias") & (df.readout == "probe")]
            if len(per) and decision != "head" and per["value"].notna().any():
                row["peak block"] = int(per.loc[per["value"].astype(float).idxmax(), "layer"])
            row["reason"] = _reason_of(g)
            rows.append(row)
        return pd.DataFrame(rows)

    def finalize(self) -> pd.DataFrame:
        rows: list[dict[str, Any]] = []
        if "cue" in self.heads:
            c = R.shape_bias_of_tally(self.heads["cue"], self.match_denominator)
            rows += [{"metric": k, "readout": "head", "value": float(v),
                      **(shape_bias_interval(c) if k == "shape_bias" else {})} for k, v in c.items()]
        cue, train = self.tables.get("cue"), self.tables.get("train")
        if self.use_probe and cue is not None and train is not None and len(train) > 1 and len(cue):
            shape = cue.column("labels")
            texture = torch.cat(self.cue_texture) if self.cue_texture else torch.empty(0, dtype=torch.long)
            ytr, test = train.column("labels"), self._split(train)
            if not self._check_split(ytr, test):  # no held-out clean accuracy: fit on every training image
                test = torch.zeros_like(test)
            fit = ~test
            c = self._num_classes(ytr, shape, texture)
            sizes = {"n_train": int(fit.sum()), "n_test": int(test.sum())}
            for j, layer in enumerate(self.layers):
                xtr = train.layer(j)
                (d_cue, d_test), cols = self._probe(xtr[fit], ytr[fit], [cue.layer(j), xtr[test]], c)
                counts = R.shape_bias_counts(d_cue, shape, texture, self.match_denominator)
                acc, n_test = R.accuracy(d_test, ytr[test]), int(test.sum())
                chance = S.majority_rate(ytr[fit], ytr[test])
                reason = chance_reason(acc, n_test, chance)
                rows += [{"metric": k, "layer": layer, "readout": "probe", **sizes, **cols,
                          **({"value": math.nan, "reason": reason} if reason and k == "shape_bias"
                             else {"value": float(v), **(shape_bias_interval(counts) if k == "shape_bias" else {})})}
                         for k, v in counts.items()]
                rows.append({"metric": "clean_accuracy", "layer": layer, "readout": "probe", "value": acc,
                             **sizes, **cols, **_clean_columns(acc, n_test, chance)})
        df = _with_reason(self.tidy(rows))
        df["token_view"] = df["readout"].map({"probe": self.token_view, "head": None})
        df["dataset"] = self.datasets.get("data")
        df["match_denominator"] = self.match_denominator
        return df


# ---------------------------------------------------------------- accuracy under perturbed views
class _ViewAccuracy(_Robustness):
    """Accuracy of each readout on the clean test images and on each perturbed view of them."""

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self._ensure_configured(batch)
        view = str(getattr(batch, "view", "clean") or "clean")
        take = min(self.max_images - self.seen.get(view, 0), len(batch))
        if take <= 0:
            return
        labels = on_host(batch.labels)[:take].long()
        if view == "clean" and batch.extra.get("corruption") is not None:  # pre-corrupted images (CorruptedFolder)
            self._add_precorrupted(feats, batch, take, labels)
            return
        is_test = self._is_test(batch, take)
        if view == "clean":
            self.n_images += take
        if self.use_head:  # before the probe's copy to the host: a tally on the device
            d, c = self._head_decisions(feats, take)
            self._add_tally(view, R.accuracy_tally(d, on_device(labels, d.device), c))
        if self.use_probe:  # every image: the split is decided in finalize, and only test images are scored
            self._add_pooled(view, feats, batch, take, labels, is_test)
        self.seen[view] = self.seen.get(view, 0) + take

    def _add_precorrupted(self, feats: Mapping[str, torch.Tensor], batch: Any, take: int, labels: torch.Tensor
                          ) -> None:
        """Images that come corrupted (``batch.extra['corruption' / 'severity']``): each group is scored like the
        view that would have made it, by the head (no clean images of the same set exist for a probe)."""
        if not self.use_head:
            raise ConfigError(f"{self.name}: {self.datasets.get('data') or 'the dataset'} holds pre-corrupted images, "
                              f"which only a classifier head covering its classes can score; {self.model_name} has "
                              f"{'no such head' if self.head_space is None else 'a ' + self.head_space + ' head'}"
                              " (or the dataset's classes are unknown)")
        names = list(batch.extra["corruption"][:take])
        d, c = self._head_decisions(feats, take)
        sev = on_device(torch.as_tensor(batch.extra["severity"])[:take], d.device)
        kinds = list(dict.fromkeys(names))
        kind = on_device(torch.tensor([kinds.index(n) for n in names]), d.device)
        y = on_device(labels, d.device)
        for k, name in enumerate(kinds):  # every severity of the names seen: views without images are left out
            for s in P.SEVERITIES:
                self._add_tally(P.corruption_key(name, s), R.accuracy_tally(d, y, c, (kind == k) & (sev == s)))
        self.seen["clean"] = self.seen.get("clean", 0) + take
        self.n_images += take

    def _accuracies(self) -> list[dict[str, Any]]:
        """Rows (readout, layer, view, accuracy, n_images) for every view seen."""
        out: list[dict[str, Any]] = []
        views = [v for v in self._view_order() if v in self.heads or v in self.tables]
        for v in views:
            if v in self.heads:
                acc, n, chance = R.accuracy_of_tally(self.heads[v])
                if n:  # none: a severity of a pre-corrupted name that no image had
                    out.append({"readout": "head", "layer": None, "view": v, "value": acc, "n_images": n,
                                "chance": chance})
        clean = self.tables.get("clean")
        if self.use_probe and clean is not None and len(clean) > 1:
            y, test = clean.column("labels"), self._split(clean)
            if self._check_split(y, test):
                test_ids = clean.column("ids")[test]
                tests = {"clean": (lambda j: clean.layer(j)[test], y[test])}
                for v in views:
                    if v != "clean" and v in self.tables:
                        t = self.tables[v]
                        keep = t.column("is_test") if self.own_split else torch.isin(t.column("ids"), test_ids)
                        tests[v] = ((lambda j, t=t, keep=keep: t.layer(j)[keep]), t.column("labels")[keep])
                c = self._num_classes(y)
                sizes = {"n_train": int((~test).sum()), "n_test": int(test.sum())}
                chance = S.majority_rate(y[~test], y[test])
                for j, layer in enumerate(self.layers):
                    xtr = clean.layer(j)[~test]
                    decs, cols = self._probe(xtr, y[~test], [f(j) for f, _ in tests.values()], c)
                    for (v, (_, yv)), d in zip(tests.items(), decs, strict=True):
                        out.append({"readout": "probe", "layer": layer, "view": v, "value": R.accuracy(d, yv),
                                    "n_images": len(yv), "chance": chance, **sizes, **cols})
        return out

    def _view_order(self) -> list[str]:
        seen = list(dict.fromkeys([*self.heads, *self.tables]))
        return ["clean"] + [v for v in seen if v != "clean"]

    @staticmethod
    def _clean(acc: list[dict[str, Any]]) -> dict[tuple[str, Any], dict[str, Any]]:
        """Per (readout, layer): the clean accuracy row, and ``reason`` (`chance_reason`) and ``extra`` (the
        columns of its own row) beside it."""
        out = {}
        for r in acc:
            if r["view"] == "clean":
                out[(r["readout"], r["layer"])] = {**r, "reason": chance_reason(r["value"], r["n_images"], r["chance"]),
                                                   "extra": _clean_columns(r["value"], r["n_images"], r["chance"])}
        return out


def _reason_of(g: pd.DataFrame) -> str:
    """The first ``reason`` among the rows (a key-numbers cell; empty where every figure is reported)."""
    reasons = g["reason"].dropna() if "reason" in g.columns else []
    return str(reasons.iloc[0]) if len(reasons) else ""


def _with_reason(df: pd.DataFrame) -> pd.DataFrame:
    """The ``reason`` column present (None where a figure is reported)."""
    if "reason" not in df.columns:
        df["reason"] = None
    return df


def _band_of(view: str) -> int | None:
    kind, args = _parse_view(view)
    return int(args["band"]) if kind == "band_noise" and "band" in args else None


@register_analysis
class BandNoise(_ViewAccuracy):
    """Accuracy under frequency-band noise (Park et al., "What do self-supervised ViTs learn?", ICLR 2023, after
    Park & Kim, "How do vision transformers work?", ICLR 2022), bands 0..``n_bands``-1 of width ``width`` (0.1 pi)
    from low to high frequency (`vitscope.data.perturb.band_noise`). ``band_definition``: ``circular_rms``
    (default): Gaussian noise filtered to an annulus of radial frequency, scaled to the same noise energy
    (``rms`` per pixel, images in [0, 1]) in every band; ``square_sign``: Park et al.'s public code, +-``eps``
    sign noise filtered to a square annulus of the shifted spectrum and not renormalised, so its energy grows
    with the band (3.7-4.9x from band 0 to bands 8-9 at 32 px). The default keeps the energy fixed so that a
    band's drop measures its frequency, not its larger noise; ``square_sign`` reproduces the source's numbers.
    Rows per (readout, layer, band): ``accuracy`` and ``drop`` (clean accuracy minus it, in accuracy points);
    ``band`` -1 is the clean accuracy; every row names its ``band_definition``. Each carries its 95 % interval
    (``value_lo``, ``value_hi``, ``stderr``) over its ``n_images``: an accuracy's Wilson interval
    (`R.accuracy_interval`), a drop's paired interval valid however the images' clean and noisy decisions go
    together (`R.drop_interval`). ``bands``: a subset of the bands to run (default all)."""

    name = "band_noise"
    description = "accuracy and its drop under noise confined to a frequency band, per band and layer"
    state_version = 6  # 6: every accuracy and drop with its 95 % interval (value_lo, value_hi, stderr); 5: the head's
    # decisions as tallies (`R.accuracy_tally`); 4: no drop from a readout at chance (reason); 3: stratified split,
    # tuned probe;
    # 2: band_definition (circular_rms | square_sign)

    def __init__(self, vm: Any, n_bands: Bands = P.N_BANDS, bands: Sequence[NonNegative] | None = None,
                 rms: Positive = 0.1, width: Positive = P.BAND_WIDTH, band_definition: str = "circular_rms",
                 eps: Positive = 0.1, **kw: Any):
        super().__init__(vm, **kw)
        self.params = {"n_bands": n_bands, "bands": bands, "rms": rms, "width": width,
                       "band_definition": band_definition, "eps": eps}
        type(self).views(self.params)  # validates

    @classmethod
    def views(cls, params: dict) -> list[str]:
        n = int(params.get("n_bands", P.N_BANDS))
        bands = params.get("bands")
        bands = list(range(n)) if bands is None else [int(b) for b in bands]
        bad = [b for b in bands if not 0 <= b < n]
        if bad:
            raise ConfigError(f"band_noise: bands {bad} do not exist; with n_bands={n} the bands are 0..{n - 1}")
        rms, width = float(params.get("rms", 0.1)), float(params.get("width", P.BAND_WIDTH))
        definition = P.check_band_definition(params.get("band_definition", "circular_rms"))
        eps = float(params.get("eps", 0.1))
        if rms <= 0 or width <= 0 or eps <= 0:
            raise ConfigError("band_noise: rms, eps and width must be positive")
        if definition == "square_sign":  # its amplitude is eps; rms does not apply
            extra = f",definition=square_sign,eps={eps}"
        else:
            extra = f",rms={rms}" if rms != 0.1 else ""
        extra += f",width={width}" if width != P.BAND_WIDTH else ""
        return ["clean"] + [f"band_noise:band={b},n_bands={n}{extra}" for b in bands]

    @staticmethod
    def key_numbers(df: pd.DataFrame) -> pd.DataFrame:
        """Per model and readout (head; last-layer probe): clean accuracy, the drop in the lowest and the highest
        band, and the band that costs most."""
        rows = []
        for (model, decision), g in decision_rows(df).groupby(["model", "decision"], sort=False):
            acc = g[g.metric == "accuracy"].set_index("band")["value"]
            drop = g[g.metric == "drop"].set_index("band")["value"].sort_index()
            if drop.empty:
                continue
            rows.append({"model": model, "readout": decision, "clean accuracy": acc.get(-1, float("nan")),
                         f"drop, band {int(drop.index[0])} (low)": drop.iloc[0],
                         f"drop, band {int(drop.index[-1])} (high)": drop.iloc[-1],
                         "worst band": int(drop.astype(float).idxmax()) if drop.notna().any() else None,
                         "worst drop": drop.max(), "reason": _reason_of(g)})
        return pd.DataFrame(rows)

    def finalize(self) -> pd.DataFrame:
        rows = []
        acc = self._accuracies()
        clean = self._clean(acc)
        for r in acc:
            band = -1 if r["view"] == "clean" else _band_of(r["view"])
            base = {"layer": r["layer"], "readout": r["readout"], "band": band, "n_images": r["n_images"],
                    **{k: r[k] for k in PROBE_COLUMNS if k in r}}
            c = clean.get((r["readout"], r["layer"]), {"value": math.nan, "reason": None, "extra": {}})
            rows.append({**base, "metric": "accuracy", "value": r["value"],
                         **R.accuracy_interval(r["value"], r["n_images"]), **(c["extra"] if band == -1 else {})})
            if band != -1:
                drop = math.nan if c["reason"] else R.drop(c["value"], r["value"])
                iv = R.drop_interval(c["value"], r["value"], r["n_images"]) if not c["reason"] else {}
                rows.append({**base, "metric": "drop", "value": drop, "reason": c["reason"], **iv})
        df = _with_reason(self.tidy(rows))
        df["token_view"] = df["readout"].map({"probe": self.token_view, "head": None})
        n = int(self.params["n_bands"])
        width = float(self.params["width"])
        df["band_low"] = df["band"].map(lambda b: b * width / math.pi if b >= 0 else float("nan"))
        df["band_high"] = df["band"].map(lambda b: (b + 1) * width / math.pi if b >= 0 else float("nan"))
        df["n_bands"] = n
        df["band_definition"] = self.params["band_definition"]
        return df


def _corruption_of(view: str) -> tuple[str, int] | None:
    kind, args = _parse_view(view)
    return (args["name"], int(args["severity"])) if kind == "corruption" else None


@register_analysis
class Corruptions(_ViewAccuracy):
    """Accuracy under the common corruptions of ImageNet-C / CIFAR-10-C (Hendrycks & Dietterich, "Benchmarking
    Neural Network Robustness to Common Corruptions and Perturbations", ICLR 2019; what Merlin et al., "What
    happens during finetuning of ViTs: an invariance based investigation" (2023), correlate with what
    fine-tuning forgets), generated on the fly (`vitscope.data.perturb.corruption`).
    Rows per (readout, layer): ``accuracy`` per ``corruption`` (with its ``family``) and ``severity`` (0 = clean),
    ``relative_drop`` from clean per corruption and severity, ``mca`` (mean corruption accuracy over the
    corruptions and severities run) and ``mca_relative_drop``. Every ``accuracy`` and ``mca`` carries its 95 %
    interval (``value_lo``, ``value_hi``, ``stderr``) over its ``n_images`` (`R.accuracy_interval`: Wilson's,
    conservative for the mean). ``corruptions``: names, family names
    ('noise', 'blur', 'weather', 'digital', 'held-out') or 'common' (the 15 of ImageNet-C), ``severities``: of 1..5.
    ``backend``: 'auto' (torch versions where they exist, else the imagecorruptions-imaug package), 'native',
    'package'. ``table``: the constants, 'imagenet' (ImageNet-C's, made for 224-px images) or 'cifar'
    (CIFAR-10-C's, made for 32-px images; the native corruptions only)."""

    name = "corruptions"
    description = "accuracy under ImageNet-C / CIFAR-10-C corruptions at severities 1-5, mean corruption accuracy"
    state_version = 5  # 5: every accuracy and the mca with its 95 % interval (value_lo, value_hi, stderr), mca rows
    # with n_images; 4: the head's decisions as tallies (`R.accuracy_tally`); 3: no relative drop from a readout
    # at chance (reason)

    def __init__(self, vm: Any, corruptions: Any = "common", severities: Sequence[Severity] = P.SEVERITIES,
                 backend: str = "auto", table: str = "imagenet", **kw: Any):
        super().__init__(vm, **kw)
        self.params = {"corruptions": corruptions, "severities": severities, "backend": backend, "table": table}
        type(self).views(self.params)

    def probe_possible(self) -> tuple[bool, str]:
        if str(self.datasets.get("data") or "").startswith("corrupted"):
            return False, f"{self.datasets['data']} holds only corrupted images"
        return True, ""

    @staticmethod
    def corruption_names(which: Any) -> list[str]:
        which = [which] if isinstance(which, str) else list(which)
        out: list[str] = []
        for w in which:
            if w == "common":
                out += P.COMMON
            elif w == "all":
                out += P.CORRUPTIONS
            elif w in P.FAMILIES:
                out += P.FAMILIES[w]
            else:
                P.check_corruption(w, 1)
                out.append(w)
        return list(dict.fromkeys(out))

    @classmethod
    def views(cls, params: dict) -> list[str]:
        try:
            names = cls.corruption_names(params.get("corruptions", "common"))
            sev = [int(s) for s in params.get("severities", P.SEVERITIES)]
            for s, raw in zip(sev, params.get("severities", P.SEVERITIES), strict=True):
                if s != raw or not 1 <= s <= 5:
                    raise ConfigError(f"corruptions: severity {raw!r} does not exist; severities are 1..5")
            backend, table = params.get("backend", "auto"), params.get("table", "imagenet")
            P.check_backend(names, backend, table)
        except ConfigError:
            raise
        except Exception as e:  # VitscopeError from perturb: same sentence, config-time type
            raise ConfigError(f"corruptions: {e}") from e
        b = ("" if backend == "auto" else f",backend={backend}") + ("" if table == "imagenet" else f",table={table}")
        return ["clean"] + [f"corruption:name={n},severity={s}{b}" for n in names for s in sev]

    @staticmethod
    def key_numbers(df: pd.DataFrame) -> pd.DataFrame:
        """Per model and readout (head; last-layer probe): clean accuracy, mean corruption accuracy, its
        relative drop, and the corruption that costs most (mean over severities)."""
        rows = []
        for (model, decision), g in decision_rows(df).groupby(["model", "decision"], sort=False):
            v = g[g.corruption.isna()].set_index("metric")["value"]
            acc = g[(g.metric == "accuracy") & (g.severity > 0)].groupby("corruption")["value"].mean()
            clean = g[(g.metric == "accuracy") & (g.severity == 0)]["value"]
            rows.append({"model": model, "readout": decision,
                         "clean accuracy": float(clean.iloc[0]) if len(clean) else float("nan"),
                         "mean corruption accuracy": v.get("mca", float("nan")),
                         "relative drop": v.get("mca_relative_drop", float("nan")),
                         "worst corruption": acc.idxmin() if len(acc) else None, "reason": _reason_of(g)})
        return pd.DataFrame(rows)

    def finalize(self) -> pd.DataFrame:
        rows = []
        acc = self._accuracies()
        clean = self._clean(acc)
        none = {"value": math.nan, "reason": None, "extra": {}}
        per: dict[tuple[str, Any], dict[tuple[str, int], float]] = {}
        for r in acc:
            key = (r["readout"], r["layer"])
            c = clean.get(key, none)
            cs = ("clean", 0) if r["view"] == "clean" else _corruption_of(r["view"])
            base = {"layer": r["layer"], "readout": r["readout"], "corruption": cs[0], "severity": cs[1],
                    "family": P.FAMILY_OF.get(cs[0], "clean"), "n_images": r["n_images"],
                    **{k: r[k] for k in PROBE_COLUMNS if k in r}}
            rows.append({**base, "metric": "accuracy", "value": r["value"],
                         **R.accuracy_interval(r["value"], r["n_images"]), **(c["extra"] if not cs[1] else {})})
            if cs[1]:
                per.setdefault(key, {})[cs] = r["value"]
                rows.append({**base, "metric": "relative_drop", "reason": c["reason"],
                             "value": math.nan if c["reason"] else R.relative_drop(c["value"], r["value"])})
        for (readout, layer), a in per.items():
            c = clean.get((readout, layer), none)
            s = R.corruption_summary(a, c["value"])
            n = c.get("n_images", 0)
            rows += [{"metric": k, "layer": layer, "readout": readout, "n_images": n,
                      **({"value": math.nan, "reason": c["reason"]} if c["reason"] and k != "mca" else {"value": v}),
                      **(R.accuracy_interval(v, n) if k == "mca" else {})}
                     for k, v in s.items()]
        df = _with_reason(self.tidy(rows))
        df["token_view"] = df["readout"].map({"probe": self.token_view, "head": None})
        return df
