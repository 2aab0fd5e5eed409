"""No analysis silently returns nothing: a table without rows for a model says why (`Analysis.empty_reason`), as a
ResultWarning naming the analysis, the model and the reason, and in report.html under the analysis's section.

Every registered analysis (the registry is iterated, so a new one is covered the day it is added) is finalized on
an input that yields no rows where one exists (a fresh accumulator: no image fed); an analysis that refuses to
finalize without images is fed a few generated images of the data it needs instead. Either way it must give rows
or a non-empty reason, and the reason must come back from its saved state (a cache hit says it too)."""

from __future__ import annotations

import html
import warnings
from typing import Any

import pandas as pd
import pytest

import vitscope.analyses  # noqa: F401 - every analysis registered
from conftest import tiny
from vitscope.analyses.base import ANALYSES, EMPTY_MODEL, EMPTY_REASON, Analysis, PairAnalysis, explain_empty, has_cross
from vitscope.errors import ResultWarning
from vitscope.study.stages import _label, _named_in, cross_stage


def model_word(a: Any) -> str:
    return "model pair" if isinstance(a, PairAnalysis) else "model"

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread is faster

#: parameters an analysis needs to be built at all on this machine (the defaults of ``corruptions`` include
#: corruptions of an optional package); any other analysis is built with its defaults
PARAMS: dict[str, dict[str, Any]] = {"corruptions": {"corruptions": "noise", "severities": [1]}}

NO_CLS = "class_token: false, reg_tokens: 4, global_pool: avg"


def _build(cls: type, vm: Any) -> Any:
    params = PARAMS.get(cls.name, {})
    return cls(vm.info(), vm.info(), **params) if getattr(cls, "pair", False) else cls(vm, **params)


def _slots(cls: type) -> dict[str, frozenset[str]]:
    """Each dataset slot of the analysis and what it must provide."""
    return {"data": frozenset(cls.needs), **{k: frozenset(v) for k, v in cls.inputs.items()}}


def _generated_dataset(needs: frozenset[str], n: int) -> Any:
    """A generated dataset (no files) of ``n`` images providing ``needs``: the first such format registered."""
    from vitscope.data.catalog import FORMATS, build_dataset
    from vitscope.study.config import DatasetConfig

    for name, fmt in FORMATS.items():
        if getattr(fmt, "generated", False) and needs <= set(fmt.provides):
            return build_dataset(DatasetConfig(name=name, n_images=n))
    raise AssertionError(f"no generated dataset provides {sorted(needs)}: add one, or another route to this test")


def _fed(cls: type, vm: Any) -> tuple[Any, pd.DataFrame | None]:
    """The analysis fed 16 generated images of what each of its slots needs, and its table."""
    from vitscope.analyses._drive import run_passes

    a = _build(cls, vm)
    data = {slot: _generated_dataset(needs, 16) for slot, needs in _slots(cls).items()}
    if isinstance(a, PairAnalysis):
        a.datasets = {slot: ds.name for slot, ds in data.items()}
        for b in data["data"].batches(8, vm.preprocessing):
            a.update(vm, vm, b)
    else:
        run_passes(a, vm, data, batch_size=8)
    return a, a.finalize()


def _rows_or_reason(cls: type, vm: Any) -> tuple[str, Any, pd.DataFrame | None]:
    """('empty', analysis, table) from a fresh accumulator where it finalizes without images, else ('fed', ...)."""
    a = _build(cls, vm)
    a.datasets = {slot: f"{slot}-set" for slot in _slots(cls)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "empty", a, a.finalize()
    except Exception:  # noqa: BLE001 - refuses to finalize without images: loud, never silent; fed some instead
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ("fed", *_fed(cls, vm))


@pytest.fixture(scope="module")
def vm():
    return tiny("vit")


@pytest.mark.parametrize("name", sorted(ANALYSES))
def test_every_registered_analysis_gives_rows_or_says_why(vm, name):
    cls = ANALYSES[name]
    route, a, df = _rows_or_reason(cls, vm)
    if has_cross(cls):  # judged after the cross-model stage, as in a study: rows there, or said with the reason
        frames = {name: [df]}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cross_stage({name: [a]}, frames)
        said = [str(w.message) for w in caught if issubclass(w.category, ResultWarning) and "no rows" in str(w.message)]
        if df is None or not len(df):
            mine = frames[name][0]
            if mine.attrs.get(EMPTY_REASON):
                assert said[0] == f"{name}: no rows for {model_word(a)} {_label(a)!r}: {mine.attrs[EMPTY_REASON]}"
            else:  # no reason: the cross-model table must have rows of this model
                assert _named_in(a, frames[name][-1]), f"{name}: no rows for its model, and no reason"
    if df is not None and len(df):
        return
    reason = a.empty_reason()
    assert isinstance(reason, str) and reason.strip(), f"{name}: an empty table ({route}) without a reason"
    if route == "empty" and type(a).empty_reason is Analysis.empty_reason and not a.no_rows_because:
        assert "no images" in reason, reason  # the generic reason says what it was fed: nothing
    # derived from the state, not remembered from update: a state read back from the cache says the same
    b = _build(cls, vm)
    b.datasets = dict(a.datasets)
    b.load_state_dict(a.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = b.finalize()
    assert again is None or not len(again)
    assert b.empty_reason() == reason
    marked = explain_empty(a, df, "m")
    assert len(marked) == 0 and marked.attrs[EMPTY_REASON] == reason.strip().rstrip(".")
    assert marked.attrs[EMPTY_MODEL] == "m"


def test_a_table_with_rows_is_left_alone_and_a_reason_is_never_empty(vm):
    cls = ANALYSES["attention_distance"]
    a = cls(vm)
    rows = pd.DataFrame({"value": [1.0]})
    assert explain_empty(a, rows, "m") is rows and not rows.attrs

    class Mute(cls):  # an analysis whose own reason is blank or fails still gets a sentence
        def empty_reason(self) -> str:
            return "  "

    class Broken(cls):
        def empty_reason(self) -> str:
            raise RuntimeError("boom")

    assert "no reason" in explain_empty(Mute(vm), None, "m").attrs[EMPTY_REASON]
    assert "boom" in explain_empty(Broken(vm), pd.DataFrame(), "m").attrs[EMPTY_REASON]


def test_a_model_without_cls_token_says_why_its_cls_views_give_nothing():
    from vitscope.analyses.base import views_with_cls

    vm = tiny("vit", class_token=False, reg_tokens=4, global_pool="avg")
    a = ANALYSES["cls_attention_maps"](vm)
    assert "CLS token" in a.empty_reason()

    class Holder:
        name, model_name, has_cls_token, no_rows_because = "x", "m", False, None

    h = Holder()
    with pytest.warns(ResultWarning):
        assert views_with_cls(h, ["cls"]) == []
    assert "'cls'" in h.no_rows_because
    h2 = Holder()
    h2.has_cls_token = True
    assert views_with_cls(h2, ["cls", "gap"]) == ["cls", "gap"] and h2.no_rows_because is None


def test_a_model_without_classifier_head_says_why_gradient_rollout_is_empty_also_from_the_cache():
    vm = tiny("vit", num_classes=0)
    cls = ANALYSES["gradient_rollout"]
    a = cls(vm)
    assert not len(a.finalize())
    cached = cls(vm.info())  # as a cache hit builds it: from the model's info, which says nothing of the head
    assert cached.has_head
    cached.load_state_dict(a.state_dict())
    for x in (a, cached):
        assert x.empty_reason() == "the model has no classifier head, so there is no predicted class to explain"


def test_the_cross_model_stage_says_why_its_table_is_empty():
    from vitscope.study.stages import CROSS, cross_stage

    class Fake:
        def __init__(self, model: str, n_images: int = 3):
            self.model_name, self.n_images, self.name = model, n_images, "fake"

        def empty_reason(self) -> str:
            return f"{self.model_name} saw {self.n_images} images."

        @classmethod
        def cross(cls, analyses):
            return pd.DataFrame({"model": [], "model_b": [], "value": []})

        @classmethod
        def cross_empty_reason(cls, analyses):
            return f"only {len(analyses)} models."

    class Named(Fake):  # its cross-model table has rows of model 'b' (as model_b) only
        @classmethod
        def cross(cls, analyses):
            return pd.DataFrame({"model": ["z"], "model_b": ["b"], "value": [1.0]})

    class NoCross(Fake):  # a cross-model part that gave nothing this time (None): each empty model is said
        @classmethod
        def cross(cls, analyses):
            return None

    rows = pd.DataFrame({"model": ["a"], "value": [1.0]})
    frames: dict[str, list[Any]] = {"fake": [rows, None], "named": [None, pd.DataFrame(), None], "none": [None]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cross_stage({"fake": [Fake("a"), Fake("b", 0)], "named": [Named("a"), Named("b"), Named("c")],
                     "none": [NoCross("n")]}, frames)
    said = sorted(str(w.message) for w in caught if issubclass(w.category, ResultWarning))
    assert said == ["fake: no rows for model 'b': b saw 0 images",
                    "fake: no rows for the cross-model stage: only 2 models",
                    "named: no rows for model 'a': a saw 3 images", "named: no rows for model 'c': c saw 3 images",
                    "none: no rows for model 'n': n saw 3 images"]
    assert len(frames["none"]) == 1 and frames["none"][0].attrs[EMPTY_MODEL] == "n"
    assert frames["fake"][0] is rows and frames["fake"][1].attrs == {EMPTY_REASON: "b saw 0 images", EMPTY_MODEL: "b"}
    assert frames["fake"][2].attrs == {EMPTY_REASON: "only 2 models", EMPTY_MODEL: CROSS}
    assert not frames["named"][1].attrs and len(frames["named"]) == 4  # b: named by the cross table
    # the default reason counts the models and those fed images
    assert "2 model(s), 1 of which" in Analysis.cross_empty_reason([Fake("a"), Fake("b", 0)])


def test_empty_tables_become_the_summary_table_in_study_order(tmp_path):
    from vitscope.study import rundir
    from vitscope.study.tables import empty_reasons, write_tables

    def empty(model: str, reason: str) -> pd.DataFrame:
        df = pd.DataFrame({"model": [], "value": []})
        df.attrs[EMPTY_REASON], df.attrs[EMPTY_MODEL] = reason, model
        return df

    rows = pd.DataFrame({"model": ["a"], "analysis": ["x"], "value": [1.0]})
    frames = {"x": [rows, empty("b", "no masks")], "y": [empty("a", "no pairs"), pd.DataFrame(), None]}
    want = pd.DataFrame({"analysis": ["x", "y"], "model": ["b", "a"], "reason": ["no masks", "no pairs"]})
    pd.testing.assert_frame_equal(empty_reasons(frames), want)
    written = write_tables(tmp_path, frames, {}, {})
    assert rundir.EMPTY_TABLE in written and "y.parquet" not in written
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "results" / rundir.EMPTY_TABLE), want)
    # a study whose tables all have rows writes no such table, and a rerun's swap removes the old one
    assert rundir.EMPTY_TABLE not in write_tables(tmp_path, {"x": [rows]}, {}, {"results_files": written})
    assert not (tmp_path / "results" / rundir.EMPTY_TABLE).exists()


def _study(models: list[tuple[str, str]]) -> str:
    entries = "".join(f"""
  - name: vit_small_patch16_224
    label: {label}
    pretrained: false
    kwargs: {{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3{extra}}}""" for label, extra in models)
    return f"""
models:{entries}
dataset: {{name: synthetic-shapes, n_images: 8}}
analyses:
  cls_attention_maps: {{keep_images: 0}}
  attention_distance: {{}}
batch_size: 4
progress: false
"""


def _run(out, cache, text: str) -> tuple[Any, list[str]]:
    from vitscope.study import load_config, run_study

    (out.parent / f"{out.name}.yaml").write_text(text)
    cfg = load_config(out.parent / f"{out.name}.yaml", [f"output_dir={out}", f"cache_dir={cache}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_study(cfg)
    return out, [str(w.message) for w in caught if issubclass(w.category, ResultWarning)]


@pytest.mark.slow
def test_a_study_says_why_a_model_has_no_rows_in_its_output_and_report(tmp_path):
    from vitscope.report.run import load_run
    from vitscope.study import rundir

    cache = tmp_path / "cache"
    out, said = _run(tmp_path / "run", cache, _study([("with-cls", ""), ("no-cls", ", " + NO_CLS)]))
    reason = "the model has no CLS token, so there is no CLS attention map"
    line = f"cls_attention_maps: no rows for model 'no-cls': {reason}"
    assert said.count(line) == 1, said  # once, one sentence naming the analysis, the model and the reason
    assert not [s for s in said if "no rows for model 'with-cls'" in s or s.startswith("attention_distance: no rows")]
    table = pd.read_parquet(out / "results" / "cls_attention_maps.parquet")
    assert set(table["model"]) == {"with-cls"}
    empty = pd.read_parquet(out / "results" / rundir.EMPTY_TABLE)
    assert empty.to_dict("records") == [{"analysis": "cls_attention_maps", "model": "no-cls", "reason": reason}]
    assert rundir.EMPTY_TABLE in rundir.read_manifest(out)["results_files"]
    page = (out / "report.html").read_text()
    section = page.split("<h2 id='cls_attention_maps'>", 1)[1].split("<h2 ", 1)[0]
    assert f"no rows for no-cls: {html.escape(reason)}" in section
    assert "data-table='cls_attention_maps'" in section  # the other model's table is still there
    assert load_run(out).empty == {"cls_attention_maps": [("no-cls", reason)]}

    # the model without CLS alone, its states read back from the cache: said again, and a section with no table
    out2, said2 = _run(tmp_path / "run2", cache, _study([("no-cls", ", " + NO_CLS)]))
    assert rundir.read_manifest(out2)["models"]["no-cls"]["analyses_from_cache"] == ["cls_attention_maps",
                                                                                      "attention_distance"]
    assert said2.count(line) == 1, said2
    assert not (out2 / "results" / "cls_attention_maps.parquet").exists()
    page = (out2 / "report.html").read_text()
    assert "<a href='#cls_attention_maps'>" in page
    section = page.split("<h2 id='cls_attention_maps'>", 1)[1].split("<h2 ", 1)[0]
    assert f"no rows for no-cls: {html.escape(reason)}" in section and "data-table=" not in section


@pytest.mark.slow
def test_a_pair_stage_without_rows_says_why_also_from_the_cache(tmp_path):
    import study_fixtures

    from vitscope.analyses.base import register_analysis

    class PairNothing(study_fixtures.PairSeen):
        """Test: a pair stage that finds nothing to measure."""

        name = "pair_nothing"

        def finalize(self) -> Any:
            return self.tidy([])

        def empty_reason(self) -> str:
            return f"none of its {len(self.rows)} images had anything to compare"

    tiny_kw = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"
    text = f"""
models:
  - {{name: vit_small_patch16_224, label: pt, pretrained: false, seed: 1, kwargs: {tiny_kw}}}
  - {{name: vit_small_patch16_224, label: ft, pretrained: false, seed: 2, finetuned_from: pt, kwargs: {tiny_kw}}}
dataset: {{name: synthetic-shapes, n_images: 4}}
analyses:
  pair_nothing: {{}}
  attention_distance: {{}}
batch_size: 4
progress: false
"""
    register_analysis(PairNothing)
    try:
        line = "pair_nothing: no rows for model pair 'pt->ft': none of its 4 images had anything to compare"
        for run in ("run", "run2"):  # computed, then read back from the cache into a fresh output_dir
            out, said = _run(tmp_path / run, tmp_path / "cache", text)
            assert said.count(line) == 1, said
            assert len([s for s in said if "no rows" in s]) == 1, said
            page = (out / "report.html").read_text()
            section = page.split("<h2 id='pair_nothing'>", 1)[1].split("<h2 ", 1)[0]
            assert "no rows for pt-&gt;ft: none of its 4 images had anything to compare" in section
        assert rundir_models(out)["ft"]["pairs"] == {"pair_nothing:pt": {"from_cache": True}}
    finally:
        ANALYSES.pop("pair_nothing", None)


def rundir_models(out) -> dict[str, Any]:
    from vitscope.study import rundir

    return rundir.read_manifest(out)["models"]


@pytest.mark.slow
def test_rows_from_the_cross_model_stage_are_rows_and_one_model_alone_says_why(tmp_path):
    """similarity with its default grid has no rows within a model: its rows are pairs of models, from the
    cross-model stage. Two models: nothing said; one model alone: its reason, said once and in the report."""
    tiny_kw = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"

    def text(labels: list[str]) -> str:
        models = "".join(f"\n  - {{name: vit_small_patch16_224, label: {m}, pretrained: false, seed: {i}, "
                         f"kwargs: {tiny_kw}}}" for i, m in enumerate(labels))
        return f"""
models:{models}
dataset: {{name: synthetic-shapes, n_images: 12}}
analyses:
  similarity: {{n_subset: 8, k: 3, rsa_images: 6, n_permutations: 0, n_groups: 3}}
batch_size: 4
progress: false
"""

    out, said = _run(tmp_path / "two", tmp_path / "cache", text(["a", "b"]))
    assert not [s for s in said if "no rows" in s], said
    assert set(pd.read_parquet(out / "results" / "similarity.parquet").model_b) == {"b"}
    out, said = _run(tmp_path / "one", tmp_path / "cache", text(["a"]))
    line = [s for s in said if "no rows" in s]
    assert len([s for s in said if "compares models" in s]) == 1, said  # once
    assert len(line) == 1 and line[0].startswith("similarity: no rows for model 'a': it compares models"), said
    reason = line[0].split(": ", 2)[2]
    assert f"no rows for a: {html.escape(reason)}" in (out / "report.html").read_text()
