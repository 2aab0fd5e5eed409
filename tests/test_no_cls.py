"""Models with registers and no CLS token (timm's ``vit_medium_patch16_reg4_gap_256``, the Eva
``vit_medium_patch16_rope_reg1_gap_256``): token 0 is a register, and nothing may read it as the CLS token. Every
registered analysis runs on a tiny random one of each (the studies of test_cost's `CASES`, their models swapped)
and either computes nothing from a CLS token (no 'cls' token view or query, no CLS attention metric, the
documented fallback for a CLS readout) or refuses in one sentence that says why."""

import warnings

import pandas as pd
import pytest
import torch
from study_fixtures import run_study_text as run
from study_fixtures import with_models
from test_cost import CASES

import vitscope as vs
import vitscope.analyses  # noqa: F401 - every analysis registered
from vitscope.analyses import get_analysis
from vitscope.analyses.base import ANALYSES
from vitscope.capture import stream
from vitscope.data import SyntheticShapes
from vitscope.errors import VitscopeError
from vitscope.taps_listing import live_text, text

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread is faster

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)

# kind: (timm name, the kwargs that make it a registers-without-CLS model, prefix tokens)
MODELS = {
    "vit": ("vit_small_patch16_224", {"class_token": False, "reg_tokens": 4, "global_pool": "avg"}, 4),
    "eva": ("vit_medium_patch16_rope_reg1_gap_256", {}, 1),  # its defaults: one register, no CLS token
}

# what each analysis gives such a model: 'empty' (a table without rows, with a warning that says why), 'runs' (a
# table computed from the spatial tokens, the registers or the model's own pooling, never from token 0 as a CLS)
EMPTY = {"cls_attention_maps"}
NO_TABLE = {"similarity"}  # a cross-model analysis: one model alone gives no table

# analyses whose default reads the CLS token where there is one, and the view they fall back to without one
FALLBACK_VIEW = {"corruptions": "gap_spatial", "band_noise": "gap_spatial", "shape_bias": "gap_spatial",
                 "retrieval": "gap_spatial", "residual_cka": "gap_spatial"}


def no_cls_study(text: str, kind: str) -> str:
    """test_cost's study ``text`` with its tiny ViTs made register-without-CLS models of ``kind``."""
    name, extra, _ = MODELS[kind]
    return with_models(text, name, extra)


def test_every_registered_analysis_is_covered():
    assert {c.analysis for c in CASES} == set(ANALYSES)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_models_have_registers_and_no_cls_token(kind):
    name, extra, registers = MODELS[kind]
    vm = vs.load_model(name, pretrained=False, **{**TINY, **extra})
    assert (vm.num_prefix_tokens, vm.has_cls_token) == (registers, False)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name or c.analysis) for c in CASES])
def test_no_analysis_reads_a_register_as_the_cls_token(case, kind, tmp_path):
    name = case.analysis
    try:
        tables, said = run(tmp_path, no_cls_study(case.study, kind))
    except VitscopeError as e:  # a refusal: one sentence that says why
        assert "CLS" in str(e) and "\n" not in str(e), str(e)
        return
    if name in NO_TABLE:
        assert name not in tables
        return
    if name in EMPTY:  # an empty table is not written
        assert tables.get(name, pd.DataFrame()).empty and any("has no CLS token" in s for s in said), said
        return
    df = tables[name]
    assert not df.empty
    for col in df.columns:  # no 'cls' token view, query or readout anywhere in the table (bytes columns aside: kept
        # images' PNGs, the explorer's 8-bit codes and scales)
        if not pd.api.types.is_numeric_dtype(df[col]) and col not in ("model", "model_key", "model_b", "png", "codes",
                                                                       "scales"):
            assert "cls" not in set(df[col].dropna().astype(str)), (col, sorted(set(df[col].dropna().astype(str))))
    assert not any("cls" in str(m).lower() for m in df.metric.unique())  # no CLS attention metric
    if name in FALLBACK_VIEW:
        assert set(df.token_view.dropna()) == {FALLBACK_VIEW[name]}
    if name == "saliency_iou":
        assert set(df["query"]) == {"mean"} and any("query 'cls' is skipped" in s for s in said)
    if name == "high_norm_tokens":  # every prefix token is a register: their norms are reported apart
        assert "register" in set(df.token_view)
    if name in ("attention_rollout", "gradient_rollout"):  # rolled out from the model's readout: the patch mean
        assert set(df["query"]) == {"mean of patch tokens"} and "iou_query_attention" in set(df.metric)
    if name == "logit_lens":  # the model's own pooling (the mean of the patch tokens), not token 0
        assert set(df.readout) == {"head"}


@pytest.mark.parametrize("kind", list(MODELS))
def test_high_norm_tokens_reports_every_register_of_a_model_without_a_cls_token(kind):
    """Token 0 is a register too: the register norms' exact minimum and maximum are over every prefix token (token
    0 made the longest by a hook, so a count that leaves it out misses the maximum)."""
    name, extra, p = MODELS[kind]
    vm = vs.load_model(name, pretrained=False, **{**TINY, **extra})

    def longer_token_0(module, args, out):
        out = out.clone()
        out[:, 0] *= 100
        return out

    for blk in vm.model.blocks:
        blk.register_forward_hook(longer_token_0)
    batches = list(SyntheticShapes(n=6, seed=1).batches(3, vm.preprocessing))
    a = get_analysis("high_norm_tokens")(vm, knn=False)
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    feats = vs.extract(vm, torch.cat([b.images for b in batches]), [f"block{i}.out" for i in range(vm.depth)])
    for i in range(vm.depth):
        reg = torch.linalg.vector_norm(feats[f"block{i}.out"][:, :p].float(), dim=-1).double()
        q = df[(df.metric == "norm_quantile") & (df.layer == i) & (df.token_view == "register")]
        assert q[q["quantile"] == 0.0].value.iloc[0] == pytest.approx(float(reg.min()), rel=1e-6)
        assert q[q["quantile"] == 1.0].value.iloc[0] == pytest.approx(float(reg.max()), rel=1e-6)
        assert float(reg.max()) == pytest.approx(float(reg[:, 0].max()))  # the hook's token
    assert df[df.metric == "cls_attention_absorbed"].empty


@pytest.mark.parametrize("analysis, params, data", [
    ("stir", "{iterations: 1, view: cls}", "shapes: {name: synthetic-shapes, n_images: 4}"),
    ("stir", "{iterations: 1, match_view: cls}", "shapes: {name: synthetic-shapes, n_images: 4}"),
    ("corruptions", "{corruptions: noise, severities: [1], token_view: cls}",
     "shapes: {name: synthetic-shapes, n_images: 4}"),
    ("similarity", "{view: cls}", "shapes: {name: synthetic-shapes, n_images: 4}"),
])
def test_asking_for_the_cls_token_of_a_model_without_one_is_refused_in_one_sentence(analysis, params, data,
                                                                                      tmp_path):
    from test_cost import PAIR, study

    text = study(analysis, params, data=data, models=PAIR if analysis == "stir" else None)
    with pytest.raises(VitscopeError, match="no CLS token") as e:
        run(tmp_path, no_cls_study(text, "vit"))
    assert "\n" not in str(e.value)


def test_the_taps_listing_gives_the_cls_view_only_to_a_model_with_a_cls_token():
    for entry in ("sup-s16", "dinov2-s14-reg"):  # the shipped snapshot: a CLS token (and 4 registers)
        assert text(entry).splitlines()[-1].startswith("token views: cls, spatial, gap, gap_spatial (prefix tokens: ")
    listing = live_text("vit_medium_patch16_rope_reg1_gap_256")  # built: one register, no CLS token
    assert listing.splitlines()[-1] == "token views: spatial, gap, gap_spatial (prefix tokens: 1, no CLS token)"


@pytest.mark.parametrize("analysis, params", [("cka", {"views": ["cls"]}), ("residual_cka", {"views": "cls"}),
                                              ("semantics", {"views": ["cls"]}), ("retrieval", {"views": ["cls"]})])
def test_an_analysis_left_with_no_view_says_it_computes_nothing(analysis, params):
    """Only 'cls' asked of a model without one: one warning that the analysis computes nothing for it (never a
    silent empty table); with another view beside it, 'cls' is left out without a word (the documented fallback)."""
    from vitscope.errors import ResultWarning

    name, extra, _ = MODELS["vit"]
    vm = vs.load_model(name, pretrained=False, **extra, **TINY)
    cls = get_analysis(analysis)
    with pytest.warns(ResultWarning, match=rf"{analysis}: model .* has no CLS token, and the only token view asked "
                                           "for is 'cls', so it computes nothing for this model"):
        assert cls(vm, **params).views == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResultWarning)
        assert cls(vm, views=["cls", "gap"]).views == ["gap"]
