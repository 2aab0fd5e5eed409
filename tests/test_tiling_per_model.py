"""Dense tiling cut per model (``patch: model``, the default of ``tiling: true``): models of patch 8 and 16 both run
on one tiled dataset, each on the tiles of its own patch size; their cache entries differ; the dry run counts the
tiles they see; and a model that takes one input size only (BEiT) beside whole frames is refused in one sentence
before any model loads."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import vitscope.study.cost as cost
from vitscope.capture.engine import Capture
from vitscope.data.catalog import build_dataset
from vitscope.data.synthetic_tasks import SyntheticVideos
from vitscope.data.tiling import TiledDataset
from vitscope.data.transforms import as_float, crop, resize_image
from vitscope.errors import ConfigError
from vitscope.study import load_config, run_study

pytestmark = pytest.mark.usefixtures("one_thread")

TILE, SCALE, WIDTH = 32, 2, 56  # items drawn 64 x 64, cropped to 64 x 56: the long side rounds per patch

STUDY = """
models:
  - {name: vit_small_patch16_224, label: p8, pretrained: false, seed: 1,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
  - {name: vit_small_patch16_224, label: p16, pretrained: false, seed: 2,
     kwargs: {img_size: 32, patch_size: 16, embed_dim: 48, depth: 2, num_heads: 3}}
datasets:
  clips: {name: synthetic-videos, n_images: 6, options: {n_frames: 3, tiling: true}}
analyses:
  propagation: {layers: [1], n_last_frames: 1, radius: 1, topk: 2}
batch_size: 2
num_workers: 0
progress: false
"""


@pytest.fixture
def narrow_items(monkeypatch):
    """Generated frames cropped to 64 x 56 (not square), so the resize before tiling depends on the patch size."""
    real = SyntheticVideos.raw_samples

    def raw_samples(self, indices, size):
        for s in real(self, indices, size):
            h, w = s.size
            yield crop(s, 0, 0, h, min(w, WIDTH * h // (SCALE * TILE)))
    monkeypatch.setattr(SyntheticVideos, "raw_samples", raw_samples)
    # and the size of each, told without drawing it (what the dry run counts tiles from)
    monkeypatch.setattr(SyntheticVideos, "raw_size", lambda self, i: (SCALE * TILE, WIDTH), raising=False)


def tiny_vit(patch: int):
    import vitscope as vs

    return vs.load_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=patch, embed_dim=48,
                         depth=2, num_heads=3)


def config(tmp_path, text=STUDY, extra=()):
    f = tmp_path / "study.yaml"
    f.write_text(text)
    return load_config(f, [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}", *extra])


def reference_tiles(base, ids, patch: int, mean, std) -> torch.Tensor:
    """The slow reference: each item resized (short side SCALE x TILE, long side rounded to the patch), normalised
    and cut by hand into TILE tiles from the top-left, plus one aligned to the far edge where a strip is left."""
    out = []
    for s in base.raw_samples(list(ids), SCALE * TILE):
        h, w = s.size
        short = SCALE * TILE
        if h <= w:
            size = (short, max(short, int(round(w * short / h / patch)) * patch))
        else:
            size = (max(short, int(round(h * short / w / patch)) * patch), short)
        img = as_float(resize_image(s.image, *size))
        x = (torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1) - torch.tensor(mean).view(3, 1, 1)) \
            / torch.tensor(std).view(3, 1, 1)

        def starts(n):
            k = list(range(0, n - TILE + 1, TILE))
            return k + ([n - TILE] if n % TILE else [])
        out += [x[:, y:y + TILE, z:z + TILE] for y in starts(size[0]) for z in starts(size[1])]
    return torch.stack(out)


@pytest.fixture
def recorded(monkeypatch):
    """Every forward's input, per model label."""
    seen: dict[str, list[torch.Tensor]] = {}
    real_call = Capture.__call__

    def call(self, x):
        seen.setdefault(self.vm.name, []).append(x.detach().clone())
        return real_call(self, x)
    monkeypatch.setattr(Capture, "__call__", call)
    return seen


def test_models_of_patch_8_and_16_each_see_the_tiles_of_their_own_patch(tmp_path, narrow_items, recorded):
    cfg = config(tmp_path)
    est = cost.dry_run(cfg)
    run_study(config(tmp_path))
    assert set(recorded) == {"p8", "p16"}
    base = build_dataset(cfg.datasets["clips"]).base
    tiles = {}
    for label, patch in (("p8", 8), ("p16", 16)):
        got = torch.cat(recorded[label])
        pre = tiny_vit(patch).preprocessing
        want = reference_tiles(base, range(6), patch, pre.mean, pre.std)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        tiles[label] = got
    assert tiles["p8"].shape != tiles["p16"].shape or not torch.equal(tiles["p8"], tiles["p16"])
    assert len(tiles["p8"]) == 6 * 2 * 3 and len(tiles["p16"]) == 6 * 2 * 3  # 64 x 72 and 64 x 80: 2 x 3 tiles
    # the dry run counts every forward's images: the tiles of each model's cut
    assert est.forwards == sum(len(v) for v in recorded.values())
    assert est.forward_images == sum(len(x) for v in recorded.values() for x in v)


def test_a_tiled_dataset_is_cut_per_model_by_default_and_an_integer_keeps_one_cut(tmp_path):
    cfg = config(tmp_path)
    ds = build_dataset(cfg.datasets["clips"])
    assert isinstance(ds, TiledDataset) and ds.per_model
    with pytest.raises(Exception, match="for_patch"):
        next(ds.batches(2, None))
    cut = ds.for_patch(8)
    assert cut.patch == 8 and cut.base is ds.base and len(cut) == len(ds) and cut.unit_bounds() == ds.unit_bounds()
    fixed = build_dataset(replace(cfg.datasets["clips"], options={"n_frames": 3, "tiling": True, "patch": 16}))
    assert fixed.patch == 16 and not fixed.per_model and fixed.for_patch(16) is fixed


def test_cache_keys_differ_by_the_patch_the_tiles_are_cut_for(tmp_path):
    from vitscope.study.distributed import Dist
    from vitscope.study.keys import analysis_key, dataset_keys, model_key, source
    from vitscope.study.plan import make_plan

    cfg = config(tmp_path)
    plan = make_plan(cfg)
    sources = {n: source(n, dc, cfg, plan, Dist()) for n, dc in plan.datasets.items()}
    ap = plan.analyses[0]
    keys = {label: analysis_key(model_key(mc, sources)[1], ap, sources, cfg)
            for mc, label in zip(plan.models, ("p8", "p16"), strict=True)}
    assert keys["p8"] != keys["p16"]
    assert dataset_keys(ap, sources, cfg)["data"]["tile_patch"] == "model"
    fixed = config(tmp_path, STUDY.replace("tiling: true", "tiling: true, patch: 16"))
    fplan = make_plan(fixed)
    fsources = {n: source(n, dc, fixed, fplan, Dist()) for n, dc in fplan.datasets.items()}
    assert dataset_keys(fplan.analyses[0], fsources, fixed)["data"]["tile_patch"] == 16
    assert dataset_keys(fplan.analyses[0], fsources, fixed) != dataset_keys(ap, sources, cfg)


def test_the_fixed_chunks_do_not_depend_on_the_patch(tmp_path):
    """Chunks count items, never tiles: the same ids, chunks and units for every patch size (shards and resume
    points follow them)."""
    from vitscope.data.pipeline import chunk_batches

    ds = build_dataset(config(tmp_path).datasets["clips"])
    for patch in (8, 16):
        vm = tiny_vit(patch)
        cut = ds.for_patch(patch)
        chunks = [[0, 1], [2, 3], [4, 5]]
        zero = [(it.k, it.batch.images.clone(), it.batch.index.clone())
                for it in chunk_batches(cut, chunks, vm.preprocessing, 0, 0)]
        two = [(it.k, it.batch.images.clone(), it.batch.index.clone())
               for it in chunk_batches(cut, chunks, vm.preprocessing, 0, 2)]
        assert [k for k, _, _ in zero] == [0, 1, 2]
        for (k0, x0, i0), (k2, x2, i2) in zip(zero, two, strict=True):
            assert k0 == k2 and torch.equal(x0, x2) and torch.equal(i0, i2)
        assert sorted({int(i) for _, _, idx in zero for i in idx}) == list(range(6))


WHOLE = """
models:
  - {name: vit_small_patch16_224, label: tiny-vit, pretrained: false,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
  - {name: beit-b16, pretrained: false}
datasets:
  frames: {name: davis2017, root: ROOT}
analyses:
  propagation: {}
progress: false
"""


def test_a_beit_entry_beside_whole_frames_is_refused_before_any_model_loads(tmp_path, no_model):
    text = WHOLE.replace("ROOT", str(tmp_path / "DAVIS"))
    with pytest.raises(ConfigError) as e:
        config(tmp_path, text)
    said = str(e.value)
    assert "beit-b16" in said and "'frames'" in said and "tiling: true" in said and "crop: center" in said
    assert said.count(". ") == 0 and "\n" not in said  # one sentence
    config(tmp_path, text.replace("root:", "options: {crop: center}, root:"))  # the fixes are accepted
    config(tmp_path, text.replace("root:", "options: {tiling: true}, root:"))
    # an analysis that does not run on the BEiT entry reads the frames without it
    config(tmp_path, text.replace("propagation: {}", "propagation: {models: [tiny-vit]}"))


def test_a_loaded_model_of_one_input_size_is_refused_at_load_with_the_same_sentence():
    """Where only the loaded model tells (a timm name, a file), the pass refuses it before reading a batch."""
    from types import SimpleNamespace

    from conftest import tiny
    from vitscope.data.transforms import Framing
    from vitscope.models.names import fixed_size_reason, whole_frames_refused
    from vitscope.study.keys import Source
    from vitscope.study.passes import check_frames

    vm = tiny("beit")
    assert not vm.any_size
    frames = SimpleNamespace(framing=Framing("full"), name="davis2017")
    job = SimpleNamespace(plan=SimpleNamespace(slots={"data": "frames"}))
    sources = {"frames": Source("frames", frames, [[0]], "")}
    with pytest.raises(ConfigError) as e:
        check_frames(vm, [job], sources)
    assert str(e.value) == whole_frames_refused(vm.name, "frames", fixed_size_reason("beit"))
    check_frames(tiny("vit"), [job], sources)  # a ViT takes any size
    cropped = {"frames": Source("frames", SimpleNamespace(framing=Framing("center")), [[0]], "")}
    check_frames(vm, [job], cropped)
    from vitscope.data import SyntheticVideos
    from vitscope.data.tiling import TiledDataset

    videos = SyntheticVideos(n_videos=1, n_frames=2, seed=0, size=64)
    videos.framing = Framing("full")  # whole frames, as DAVIS's: what the tiles are cut from
    tiled = {"frames": Source("frames", TiledDataset(videos, scale=2, patch=8), [[0]], "")}
    check_frames(vm, [job], tiled)  # tiles are the model's input size: the base's framing does not count
