"""query_attention_maps: the maps of chosen query tokens equal the query's row of the raw ``block{i}.attn`` tap
(spatial keys, renormalised; a slow reference here, no vitscope.metrics), for named positions, fractions and
'centre'/'corner'/'cls'; models with registers and without CLS; merge and resume like one pass; bad queries are
one ConfigError sentence; the figure draws one mosaic per kept image whatever the number of models."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from study_fixtures import fed_by_hand, run_analysis, shapes_batches

import vitscope as vs
from conftest import TINY, tiny
from vitscope.analyses import get_analysis
from vitscope.analyses.base import validate_params
from vitscope.errors import ConfigError
from vitscope.report.figures import FIGURES

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "query_attention_maps"


def _no_cls(**kw):
    """A tiny ViT with 4 registers and no CLS token (4 prefix tokens, none of them a CLS)."""
    return vs.load_model("vit_small_patch16_224", pretrained=False, class_token=False, reg_tokens=4,
                         global_pool="avg", **{**TINY, **kw})


_batches = shapes_batches


def _run(vm, batches, **params):
    return run_analysis(NAME, vm, batches, **params)


def _ref_map(attn, b, hd, token, p, grid):
    """Row ``token`` of image b, head hd over the spatial keys, renormalised, as an (h, w) grid: explicit loops."""
    h, w = grid
    row = [float(attn[b, hd, token, p + k]) for k in range(h * w)]
    total = sum(row)
    return torch.tensor([[row[r * w + c] / total for c in range(w)] for r in range(h)], dtype=torch.float64)


def _grid(df, **where):
    for k, v in where.items():
        df = df[df[k] == v]
    h, w = int(df.row.max()) + 1, int(df.col.max()) + 1
    assert len(df) == h * w
    out = torch.zeros(h, w, dtype=torch.float64)
    for r, c, v in zip(df.row.astype(int), df.col.astype(int), df.value, strict=True):
        out[r, c] = v
    return out


def _check_against_tap(vm, df, batches, queries, cells, images):
    """Every (image, query, layer, head) map and each head mean equals the raw tap's row of the query token.

    ``cells``: query label -> its (row, col) worked out by hand, or None for the CLS token (row 0)."""
    x = torch.cat([b.images for b in batches])
    ids = torch.cat([b.index for b in batches]).tolist()
    feats = vs.extract(vm, x, [f"block{i}.attn" for i in range(vm.depth)])
    p, (h, w) = vm.num_prefix_tokens, vm.grid_size
    for label in queries:
        cell = cells[label]
        token = 0 if cell is None else p + cell[0] * w + cell[1]
        q = df[(df["query"] == label)]
        rows = q[q.metric == "query_attention"]
        if cell is None:
            assert rows.query_row.isna().all() and rows.query_col.isna().all()
        else:
            assert set(rows.query_row) == {cell[0]} and set(rows.query_col) == {cell[1]}
        for image in images:
            b = ids.index(image)
            for i in range(vm.depth):
                attn = feats[f"block{i}.attn"].double()
                refs = [_ref_map(attn, b, hd, token, p, (h, w)) for hd in range(vm.num_heads)]
                for hd, ref in enumerate(refs):
                    got = _grid(rows, image=image, layer=i, head=hd)
                    assert torch.allclose(got, ref, atol=1e-6), (label, image, i, hd)
                mean = _grid(q[q.metric == "query_attention_mean"], image=image, layer=i)
                assert torch.allclose(mean, sum(refs) / len(refs), atol=1e-6), (label, image, i)


@pytest.mark.parametrize("kind", ["vit", "reg"])
def test_maps_are_the_query_rows_of_the_attention_tap(kind):
    vm = tiny(kind)  # 4x4 grid; 'reg': a CLS token and 4 registers
    assert vm.grid_size == (4, 4)
    batches = _batches(vm)
    queries = ["centre", "corner", [1, 2], [0.3, 0.9], "cls", [0.0, 1.0]]
    df = _run(vm, batches, keep_images=2, queries=queries).finalize()
    # by hand on a 4x4 grid: centre = the patch holding the point (2, 2), fractions floor(f * 4), 1.0 the last patch
    cells = {"centre": (2, 2), "corner": (0, 0), "(1, 2)": (1, 2), "(0.3, 0.9)": (1, 3), "cls": None,
             "(0.0, 1.0)": (0, 3)}
    assert list(dict.fromkeys(df["query"].dropna())) == list(cells)
    assert (df.n_images == 5).all()
    assert sorted(df.image.dropna().unique().tolist()) == [0, 1]
    images = df[df.metric == "input_image"]
    assert images.image.tolist() == [0, 1] and images.value.isna().all() and images.png.notna().all()
    maps = df[df.metric == "query_attention"]
    assert len(maps) == 2 * len(cells) * vm.depth * vm.num_heads * 16
    assert df[df.metric == "query_attention_mean"]["head"].isna().all()
    _check_against_tap(vm, df, batches, list(cells), cells, [0, 1])


def test_registers_without_a_cls_token():
    vm = _no_cls()
    assert (vm.num_prefix_tokens, vm.has_cls_token) == (4, False)
    batches = _batches(vm, n=3)
    df = _run(vm, batches, keep_images=3).finalize()  # the default queries: centre and corner
    assert list(dict.fromkeys(df["query"].dropna())) == ["centre", "corner"]
    _check_against_tap(vm, df, batches, ["centre", "corner"], {"centre": (2, 2), "corner": (0, 0)}, [0, 1, 2])
    with pytest.raises(ConfigError, match="no CLS token") as e:
        get_analysis(NAME)(vm, queries=["centre", "cls"])
    assert "\n" not in str(e.value)


def test_fractions_and_positions_follow_the_grid():
    vm = tiny("vit", img_size=48)  # a 6x6 grid
    assert vm.grid_size == (6, 6)
    batches = _batches(vm, n=2)
    df = _run(vm, batches, keep_images=1, queries=["center", [0.3, 0.9], [5, 5], [1.0, 0.0]]).finalize()
    cells = {"centre": (3, 3), "(0.3, 0.9)": (1, 5), "(5, 5)": (5, 5), "(1.0, 0.0)": (5, 0)}
    _check_against_tap(vm, df, batches, list(cells), cells, [0])
    with pytest.raises(ConfigError, match="outside the model's 4x4 patch grid"):
        get_analysis(NAME)(tiny("vit"), queries=[[5, 5]])


@pytest.mark.parametrize("queries,match", [
    ([[4, 0]], "outside the model's 4x4 patch grid"),
    ([[0, -1]], "outside the model's 4x4 patch grid"),
    ([[1.5, 0.5]], r"in \[0, 1\]"),
    ([[0.5, float("nan")]], r"in \[0, 1\]"),
    (["middle"], "unknown query 'middle'"),
    ([[1, 2, 3]], "a name or a \\[row, col\\] pair"),
    ([[True, 1]], "a name or a \\[row, col\\] pair"),
    (["centre", "center"], "given twice"),
    ([], "queries is empty"),
])
def test_a_bad_query_is_one_config_error_sentence_at_construction(queries, match):
    vm = tiny("vit")
    with pytest.raises(ConfigError, match=match) as e:
        get_analysis(NAME)(vm, queries=queries)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(NAME)


def test_parameters_are_checked_without_a_model():
    cls = get_analysis(NAME)
    validate_params(cls, {"queries": ["centre", [1, 2], [0.25, 0.5], "cls"], "keep_images": 2, "layers": [0]})
    validate_params(cls, {"queries": "corner"})
    for bad in ({"keep_images": 0}, {"queries": [{"row": 1}]}, {"queries": 3}):
        with pytest.raises(ConfigError) as e:
            validate_params(cls, bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="keep_images"):
        cls(tiny("vit"), keep_images=0)


def _fed(vm, batches, **params):
    return fed_by_hand(NAME, vm, batches, **params)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    a, b = a.reset_index(drop=True), b.reset_index(drop=True)
    other = [c for c in a.columns if c != "value"]
    pd.testing.assert_frame_equal(a[other], b[other])
    assert a.value.to_numpy() == pytest.approx(b.value.to_numpy(), abs=1e-7, nan_ok=True)


def test_merge_of_two_shards_and_resume_equal_one_pass():
    vm = tiny("reg")
    order = [6, 2, 5, 0, 4, 1, 3]  # the kept images (0, 1, 2) arrive out of order, across shards
    batches = _batches(vm, n=7, bs=3, indices=order)  # batches of 3, 3, 1
    params = {"keep_images": 3, "queries": ["centre", [0, 3], "cls"], "layers": [0, 2]}
    whole = _fed(vm, batches, **params)
    first, second = _fed(vm, batches[2:], **params), _fed(vm, batches[:2], **params)
    first.merge(second)  # the later images first
    part = _fed(vm, batches[:1], **params)
    state = part.state_dict()
    for v in state.values():
        assert isinstance(v, torch.Tensor | int | float | str | list | dict | tuple | type(None))
    resumed = get_analysis(NAME)(vm, **params)
    resumed.load_state_dict(state)
    for b in batches[1:]:
        with vs.Capture(vm, resumed.required_taps()) as cap:
            resumed.update(cap(b.images), b)
    ref = whole.finalize()
    assert ref[ref.metric == "input_image"].image.tolist() == [0, 1, 2]
    for other in (first, resumed):
        _same(other.finalize(), ref)
    # bounded: the state holds keep_images maps after 3 and after 7 images
    shapes = {k: tuple(v.shape) for k, v in whole.state_dict().items() if isinstance(v, torch.Tensor)}
    assert shapes == {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert shapes["kept_maps"] == (3, 3, 2, vm.num_heads, 4, 4)
    with pytest.raises(vs.VitscopeError, match="different settings"):
        whole.merge(get_analysis(NAME)(vm, keep_images=3, queries=["centre"], layers=[0, 2]))
    with pytest.raises(ConfigError):
        get_analysis(NAME)(vm, keep_images=2).load_state_dict(state)


def test_update_never_waits_for_the_device(monkeypatch):
    from host_syncs import HostSyncs

    import vitscope.host

    monkeypatch.setattr(vitscope.host, "CPU_READS", False)
    vm = tiny("vit")
    a = get_analysis(NAME)(vm, keep_images=2)
    for b in _batches(vm, n=4):
        with vs.Capture(vm, a.required_taps()) as cap:
            feats = cap(b.images)
        with HostSyncs() as s:
            a.update(feats, b)
        assert s.count == 0, dict(s.where)


def test_figure_one_mosaic_per_image_rows_models_times_queries():
    batches_of = {}
    tables = []
    queries = ["centre", "corner", "cls"]
    for label, vm in (("model-a", tiny("vit")), ("model-b", tiny("reg"))):
        batches_of[label] = _batches(vm, n=3)
        t = _run(vm, batches_of[label], keep_images=2, queries=queries, layers=[0, 2]).finalize()
        tables.append(t.assign(model=label))
    both = pd.concat(tables, ignore_index=True)
    draw = FIGURES[NAME]
    for df, n_models in ((tables[0], 1), (both, 2)):
        figs = draw(df)
        assert len(figs) == 2  # one per kept image, whatever the number of models
        for caption, fig in figs:
            ax = fig.axes[0]
            labels = [t.get_text() for t in ax.get_yticklabels()]
            assert len(labels) == n_models * len(queries)
            assert [t.get_text() for t in ax.get_xticklabels()][1:] == ["block 0", "block 2"]
            # a dot on the image and on each block's map for every spatial query of every model
            dots = sum(len(c.get_offsets()) for c in ax.collections)
            assert dots == n_models * 2 * 3
            assert len(ax.images) == 1 and "Park et al." in caption
            plt.close(fig)
    assert draw(both.iloc[0:0]) == []
    assert draw(both[both.metric != "input_image"]) == []


def test_figure_marks_the_query_where_the_table_says():
    vm = tiny("vit")
    df = _run(vm, _batches(vm, n=1), keep_images=1, queries=[[1, 3]], layers=[1]).finalize()
    (_, fig), = FIGURES[NAME](df)
    ax = fig.axes[0]
    xs, ys = ax.collections[0].get_offsets().T
    side = ax.images[0].get_array().shape[0]  # one row: the mosaic is one cell high
    step = ax.images[0].get_array().shape[1] - side  # two cells (image, one block) and a gap: step + side wide
    # the patch (1, 3) of the 4x4 grid: its centre, in the image's cell and in the block's
    assert list(ys) == pytest.approx([(1 + 0.5) * side / 4] * 2)
    assert list(xs) == pytest.approx([(3 + 0.5) * side / 4, step + (3 + 0.5) * side / 4])
    plt.close(fig)
