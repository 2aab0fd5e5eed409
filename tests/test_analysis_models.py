"""The per-analysis model filter (`models: [LABEL, ...]` in an analysis's entry, a planner key): the analysis runs,
caches, resumes, is estimated and enters the cross-model stage on those models only; the others never build or
configure it, and have no "no rows" reason in its table. An unknown label is one sentence before torch."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from study_fixtures import tiny_study_yaml
from test_cost import TINY, Counter, config, model
from test_fast_refusals import refused_before_torch

import vitscope.study.cost as cost
import vitscope.study.pool as pool
from vitscope.errors import ConfigError
from vitscope.study import run_study
from vitscope.study.cache import Cache
from vitscope.study.distributed import Dist
from vitscope.study.keys import analysis_key, model_key
from vitscope.study.keys import source as make_source
from vitscope.study.plan import label_of, make_plan

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = model("a", "seed: 1, ") + model("b", "seed: 2, ") + model("c", "seed: 3, ")
# corruptions on a alone (its noise view: a pass the others do not make), attention_distance on every model, cka
# on c and a (named out of study order: the plan keeps the study's)
STUDY = (f"models:\n{MODELS}datasets:\n  shapes: {{name: synthetic-shapes, n_images: 8}}\nanalyses:\n"
         "  corruptions: {corruptions: noise, severities: [1], models: [a]}\n"
         "  attention_distance: {}\n"
         "  cka: {batch_size: 4, views: [gap], models: [c, a]}\n"
         "batch_size: 4\nsave_every: 1\nprogress: false\n")
RUNS_ON = {"corruptions": {"a"}, "attention_distance": {"a", "b", "c"}, "cka": {"a", "c"}}


def tables(out):
    return {p.stem: pd.read_parquet(p) for p in (out / "results").glob("*.parquet")}


def models_named(frame: pd.DataFrame) -> set[str]:
    """Every label a table's rows name (as ``model`` or, for cross-model rows, ``model_b``)."""
    cols = [c for c in ("model", "model_b") if c in frame.columns]
    return {str(x) for c in cols for x in frame[c].dropna().unique()}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The study run once with its forwards counted (`test_cost.Counter`): (run dir, estimate, counter, cfg,
    warnings said)."""
    import warnings

    tmp = tmp_path_factory.mktemp("models")
    counter = Counter()
    real = pool.load_model
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.setattr(pool, "load_model", lambda *a, **k: counter.watch(real(*a, **k)))
        est = cost.dry_run(config(tmp, STUDY))
        cfg = config(tmp, STUDY)
        out = run_study(cfg, on_batch=lambda label, batch: None)  # on_batch: no helper process, all counted here
    return out, est, counter, cfg, [str(w.message) for w in caught]


def test_the_plan_records_each_analysis_s_models_in_study_order(tmp_path):
    plan = make_plan(config(tmp_path, STUDY))
    got = {ap.name: ap.models for ap in plan.analyses}
    assert got == {"corruptions": ["a"], "attention_distance": None, "cka": ["a", "c"]}
    assert [ap.name for ap in plan.single_of("b")] == ["attention_distance"]
    assert "models" not in plan.analyses[0].params  # a planner key, not the analysis's parameter


@pytest.mark.filterwarnings("ignore")
def test_each_table_has_rows_of_its_models_only_and_the_cross_stage_pairs_only_them(ran):
    out, *_ = ran
    t = tables(out)
    for name, labels in RUNS_ON.items():
        assert models_named(t[name]) == labels, name
    cka = t["cka"]
    cross = cka[cka.model_b.notna() & (cka.model_b != cka.model)]  # a model's own rows name it twice
    assert len(cross) and set(zip(cross.model, cross.model_b, strict=True)) == {("a", "c")}


def test_no_model_an_analysis_was_not_asked_to_run_on_is_said_to_have_no_rows(ran):
    out, *_, said = ran
    for name, labels in RUNS_ON.items():
        for other in {"a", "b", "c"} - labels:
            assert not any(s.startswith(f"{name}: no rows for model {other!r}") for s in said), said
    empty = out / "results" / "summary" / "empty.parquet"
    if empty.is_file():
        rows = pd.read_parquet(empty)
        for name, labels in RUNS_ON.items():
            assert set(rows[rows.analysis == name].model) <= labels


def test_cache_entries_exist_for_each_analysis_s_models_only(ran):
    out, _, _, cfg, _ = ran
    plan = make_plan(cfg)
    cache = Cache(cfg.cache_dir)
    sources = {n: make_source(n, dc, cfg, plan, Dist()) for n, dc in plan.datasets.items()}
    for mc in plan.models:
        mkey = model_key(mc, sources)[1]
        for ap in plan.analyses:
            finished = cache.finished(mkey, ap.name, analysis_key(mkey, ap, sources, cfg))
            assert finished == (label_of(mc) in RUNS_ON[ap.name]), (label_of(mc), ap.name)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["analyses_read_from_cache"] == [0, sum(len(v) for v in RUNS_ON.values())]


def test_the_dry_run_counts_the_forwards_of_the_run_and_fewer_than_without_the_filter(ran, tmp_path):
    _, est, counter, _, _ = ran
    assert counter.calls > 0
    assert (est.forwards, est.forward_images, est.gradients) == (counter.calls, counter.images, counter.gradients)
    assert est.total == sum(len(v) for v in RUNS_ON.values())
    everywhere = cost.dry_run(config(tmp_path, STUDY.replace(", models: [a]}", "}").replace(", models: [c, a]}", "}")))
    assert everywhere.total == 9 and everywhere.forwards > est.forwards  # b and c's noise passes left out


@pytest.mark.filterwarnings("ignore")
def test_a_rerun_reads_everything_back_and_runs_no_batch(ran):
    out, _, _, cfg, _ = ran
    fed: list[int] = []
    before = tables(out)
    run_study(cfg, on_batch=lambda m, b: fed.append(b))
    assert fed == []
    manifest = json.loads((out / "manifest.json").read_text())
    n = sum(len(v) for v in RUNS_ON.values())
    assert manifest["analyses_read_from_cache"] == [n, n]
    after = tables(out)
    for name in before:
        pd.testing.assert_frame_equal(after[name], before[name])


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kill_after", [3, 7])  # in a's noise pass (corruptions alone); in b's pass
def test_a_killed_run_resumes_to_the_uninterrupted_run_s_tables(ran, tmp_path, kill_after):
    ref, *_ = ran

    class Killed(Exception):
        pass

    fed: list[tuple[str, int]] = []

    def kill(m, b):
        fed.append((m, b))
        if len(fed) == kill_after:
            raise Killed

    with pytest.raises(Killed):
        run_study(config(tmp_path, STUDY), on_batch=kill)
    fed.clear()
    out = run_study(config(tmp_path, STUDY), on_batch=lambda m, b: fed.append((m, b)))
    assert fed  # resumed: some batches were left
    want, got = tables(ref), tables(out)
    assert set(got) == set(want)
    for name in want:
        pd.testing.assert_frame_equal(got[name], want[name])


# ------------------------------------------------------------------ refusals


def test_an_unknown_label_is_one_sentence_with_close_matches_before_torch(tmp_path):
    study = tmp_path / "study.yaml"
    study.write_text(tiny_study_yaml() + f"output_dir: {tmp_path / 'out'}\n")
    refused_before_torch([str(study), "analyses.cka.models=[tinyy]"],
                         "analyses.cka.models: no model labelled 'tinyy' in the study; did you mean tiny?")


@pytest.mark.parametrize("models, words", [
    ("[aa]", "analyses.cka.models: no model labelled 'aa' in the study; did you mean a?"),
    ("[]", "analyses.cka.models is empty"),
    ("{x: 1}", "analyses.cka.models must be a list of model labels"),
])
def test_a_bad_models_key_is_refused_before_any_model_loads(tmp_path, monkeypatch, models, words):
    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    text = STUDY.replace("cka: {batch_size: 4, views: [gap], models: [c, a]}",
                         f"cka: {{batch_size: 4, views: [gap], models: {models}}}")
    with pytest.raises(ConfigError) as e:
        run_study(config(tmp_path, text))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_pair_analysis_takes_pairs_not_models(tmp_path):
    pair = model("a", "seed: 1, ") + model("b", "seed: 2, finetuned_from: a, ")
    text = (f"models:\n{pair}datasets:\n  shapes: {{name: synthetic-shapes, n_images: 8}}\nanalyses:\n"
            "  head_agreement: {ks: [3], models: [b]}\nbatch_size: 4\nprogress: false\n")
    with pytest.raises(ConfigError, match="name them with `pairs"):
        make_plan(config(tmp_path, text))


# ------------------------------------------------------------------ a readout only some models can give


def head_study(models_key: str) -> str:
    """An ImageNet-headed tiny model (1000 logits) and a CIFAR-10 fine-tune of it (10 logits), corruptions read
    by the head as CIFAR-10 on the shipped CIFAR-10 images: only the fine-tune has a covering head."""
    in1k = model("in1k", "seed: 1, ")
    ft = (f"  - {{name: vit_small_patch16_224, label: ft, pretrained: false, seed: 2, finetuned_from: in1k, "
          f"kwargs: {TINY.replace('}', ', num_classes: 10}')}}}\n")
    return (f"models:\n{in1k}{ft}datasets:\n  photos: {{name: cifar10-test-1k, n_images: 8}}\nanalyses:\n"
            f"  corruptions: {{corruptions: noise, severities: [1], readout: head, head_classes: cifar10{models_key}}}"
            "\nbatch_size: 4\nprogress: false\n")


@pytest.mark.filterwarnings("ignore")
def test_a_head_readout_runs_on_the_one_model_with_a_covering_head_when_restricted_to_it(tmp_path):
    for d in ("all", "ft"):
        (tmp_path / d).mkdir()
    with pytest.raises(ConfigError, match="head_classes 'cifar10' needs a head of 10 logits; in1k has 1000"):
        run_study(config(tmp_path / "all", head_study("")), on_batch=lambda m, b: None)
    out = run_study(config(tmp_path / "ft", head_study(", models: [ft]")), on_batch=lambda m, b: None)
    t = tables(out)["corruptions"]
    assert models_named(t) == {"ft"} and len(t)


def test_the_planner_keys_of_the_plan_and_of_the_no_torch_check_are_the_same():
    from vitscope.analyses_listing import PLANNER_KEYS, planner_key
    from vitscope.study.plan import PLANNER_KEYS as PLAN_KEYS

    assert PLANNER_KEYS == PLAN_KEYS and planner_key("models")


@pytest.mark.filterwarnings("ignore")
def test_a_model_no_single_model_analysis_runs_on_is_never_loaded_and_the_report_is_drawn(tmp_path, monkeypatch):
    text = (f"models:\n{model('a', 'seed: 1, ')}{model('b', 'seed: 2, ')}datasets:\n"
            "  shapes: {name: synthetic-shapes, n_images: 4}\nanalyses:\n  attention_distance: {models: [a]}\n"
            "batch_size: 4\nprogress: false\n")
    loaded: list[str] = []
    real = pool.load_model
    monkeypatch.setattr(pool, "load_model", lambda *a, **k: loaded.append(k.get("seed")) or real(*a, **k))
    out = run_study(config(tmp_path, text), on_batch=lambda m, b: None)
    assert loaded == [1]  # b (seed 2) never loaded
    assert models_named(tables(out)["attention_distance"]) == {"a"}
    assert (out / "report.html").is_file()
    assert json.loads((out / "manifest.json").read_text())["analyses_read_from_cache"] == [0, 1]


def test_the_label_of_a_checkpoint_list_names_all_its_epochs():
    from vitscope.study.slots import analysis_models

    labels = ["pt", "ft@0", "ft@1", "ft@2", "other"]
    assert analysis_models("corruptions", ["ft"], labels) == ["ft@0", "ft@1", "ft@2"]
    assert analysis_models("corruptions", ["ft@1", "pt"], labels) == ["pt", "ft@1"]
    with pytest.raises(ConfigError, match="no model labelled 'f'"):
        analysis_models("corruptions", ["f"], labels)
