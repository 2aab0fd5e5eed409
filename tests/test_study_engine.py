"""The study engine: named datasets matched with what analyses need, views, related models, checkpoint lists,
the shipped CIFAR-10 subset. Routing is checked with test analyses that record every image they are fed."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from vitscope.cli import main
from vitscope.errors import ConfigError
from vitscope.study import load_config, run_study

TINY = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"

TWO_DATASETS = f"""
models:
  - {{name: vit_small_patch16_224, label: tiny, pretrained: false, kwargs: {TINY}}}
datasets:
  shapes: {{name: synthetic-shapes, n_images: 10}}
  photos: {{name: cifar10-test-1k, n_images: 20}}
analyses:
  seen_ids: {{views: ["test_shift:amount=0.3"]}}
  seen_labelled: {{dataset: photos}}
  seen_masked: {{}}
batch_size: 4
progress: false
"""



def write(tmp_path, text, name="study.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def seen(run_dir, name):
    df = pd.read_parquet(Path(run_dir) / "results" / f"{name}.parquet")
    return df


def test_each_analysis_is_fed_only_its_own_datasets_and_views(fixtures, tmp_path):
    cfg = load_config(write(tmp_path, TWO_DATASETS), [f"output_dir={tmp_path / 'run'}"])
    out = run_study(cfg)
    a = seen(out, "seen_ids")  # no needs: the first dataset, clean and under its view
    assert set(a.token_view) == {"shapes|clean", "shapes|test_shift:amount=0.3"}
    for v in ("shapes|clean", "shapes|test_shift:amount=0.3"):
        assert sorted(a[a.token_view == v].layer) == list(range(10))
    clean = a[a.token_view == "shapes|clean"].sort_values("layer").value.to_numpy()
    shifted = a[a.token_view == "shapes|test_shift:amount=0.3"].sort_values("layer").value.to_numpy()
    assert not np.allclose(clean, shifted)  # the view changed the pixels
    b = seen(out, "seen_labelled")  # named dataset
    assert set(b.token_view) == {"photos|clean"}
    # class-balanced (item i of the shipped subset is class i // 100): 2 per class, its first and last item
    assert sorted(b.layer) == [100 * c + j for c in range(10) for j in (0, 99)]
    c = seen(out, "seen_masked")  # needs masks: the first dataset that has them
    assert set(c.token_view) == {"shapes|clean"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["datasets"]["photos"]["n_images"] == 20 and manifest["datasets"]["shapes"]["n_images"] == 10


def test_views_are_the_same_pixels_for_every_model_and_seeded(fixtures, tmp_path):
    from vitscope.data.views import apply_view

    x = torch.rand(3, 3, 8, 8)
    idx = torch.tensor([5, 6, 7])
    a = apply_view(x, idx, "test_shift:amount=0.3", (0.0,) * 3, (1.0,) * 3, seed=0)
    b = apply_view(x[1:], idx[1:], "test_shift:amount=0.3", (0.0,) * 3, (1.0,) * 3, seed=0)  # other batching
    c = apply_view(x, idx, "test_shift:amount=0.3", (0.0,) * 3, (1.0,) * 3, seed=1)
    assert torch.equal(a[1:], b) and not torch.equal(a, c)
    # normalisation is undone before the view and redone after it
    m, s = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    normed = (x - torch.tensor(m).view(1, 3, 1, 1)) / torch.tensor(s).view(1, 3, 1, 1)
    got = apply_view(normed, idx, "test_shift:amount=0.3", m, s, seed=0)
    back = got * torch.tensor(s).view(1, 3, 1, 1) + torch.tensor(m).view(1, 3, 1, 1)
    assert torch.allclose(back, a, atol=1e-5)


def test_a_view_pass_is_cached_and_a_rerun_runs_nothing(fixtures, tmp_path):
    cfg = write(tmp_path, TWO_DATASETS)
    run_study(load_config(cfg, [f"output_dir={tmp_path / 'run'}"]))
    calls = []
    run_study(load_config(cfg, [f"output_dir={tmp_path / 'run'}"]), on_batch=lambda m, b: calls.append(b))
    assert calls == []
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["analyses_read_from_cache"] == [3, 3]


@pytest.mark.parametrize("kill_after, save_every, resumed", [
    # passes: shapes clean (3 chunks), shapes under the view (3), photos clean (5)
    (5, "1", [2, 0, 1, 2, 3, 4]),  # after view chunk 1 was fed and saved: the rest of the view pass, the photos
    # issue 41: a kill in a later pass lost the passes finished before it (their jobs wait for the model's last
    # pass and were saved only every save_every batches, 10 here: never); now a kill saves every started job
    (8, "10", [2, 3, 4]),  # photos chunks 0 and 1 fed: the photos from their third chunk, nothing else again
])
def test_a_killed_pass_resumes_where_it_stopped_to_identical_tables(fixtures, tmp_path, kill_after, save_every,
                                                                    resumed):
    cfg = write(tmp_path, TWO_DATASETS)
    ref = run_study(load_config(cfg, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'c-ref'}"]))

    class Killed(Exception):
        pass

    fed: list[int] = []

    def kill(model, b):
        fed.append(b)
        if len(fed) == kill_after:
            raise Killed

    over = [f"output_dir={tmp_path / 'run'}", f"save_every={save_every}", f"cache_dir={tmp_path / 'c-run'}"]
    with pytest.raises(Killed):
        run_study(load_config(cfg, over), on_batch=kill)
    fed.clear()
    out = run_study(load_config(cfg, over), on_batch=lambda m, b: fed.append(b))
    assert fed == resumed
    for name in ("seen_ids", "seen_labelled", "seen_masked"):
        pd.testing.assert_frame_equal(seen(out, name), seen(ref, name))


def test_a_dataset_without_what_an_analysis_needs_fails_before_any_model_loads(fixtures, tmp_path, monkeypatch):
    import vitscope.study.pool as pool

    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    text = TWO_DATASETS.replace("seen_masked: {}", "seen_masked: {dataset: photos}")
    with pytest.raises(ConfigError, match=r"needs masks, which dataset 'photos' \(cifar10-test-1k\) does not provide;"
                                          r" configured datasets that have it: shapes"):
        load_config(write(tmp_path, text))
    text = TWO_DATASETS.replace("  shapes: {name: synthetic-shapes, n_images: 10}\n", "")
    with pytest.raises(ConfigError, match="needs a dataset with masks.*formats that have it: synthetic-shapes"):
        load_config(write(tmp_path, text))
    with pytest.raises(ConfigError, match="did you mean photos"):
        load_config(write(tmp_path, TWO_DATASETS.replace("dataset: photos", "dataset: photo")))
    with pytest.raises(ConfigError, match="unknown view kind 'nosuch'"):
        load_config(write(tmp_path, TWO_DATASETS.replace("test_shift:amount=0.3", "nosuch:x=1")))
    with pytest.raises(ConfigError, match="takes no argument 'amout'"):
        load_config(write(tmp_path, TWO_DATASETS.replace("amount=0.3", "amout=0.3")))
    with pytest.raises(ConfigError, match="datasets.photos.name: unknown dataset format 'cifar10-test1k'"):
        load_config(write(tmp_path, TWO_DATASETS.replace("name: cifar10-test-1k", "name: cifar10-test1k")))


def test_a_checkpoint_list_expands_with_epochs_and_relations(fixtures, tmp_path):
    import vitscope as vs
    from vitscope.models.load import save_checkpoint

    run_dir = tmp_path / "ft" / "checkpoints"
    run_dir.mkdir(parents=True)
    for e in (0, 2, 10):
        vm = vs.load_model("vit_small_patch16_224", pretrained=False, seed=e, img_size=32, patch_size=8,
                           embed_dim=48, depth=2, num_heads=3)
        save_checkpoint(vm.model, run_dir / f"encoder_epoch{e:03d}.safetensors", vm.spec)
    text = f"""
models:
  - {{name: vit_small_patch16_224, label: pt, pretrained: false, kwargs: {TINY}}}
  - {{label: ft, checkpoints: {tmp_path / 'ft'}, finetuned_from: pt}}
dataset: {{name: synthetic-shapes, n_images: 4}}
analyses:
  seen_ids: {{}}
batch_size: 4
progress: false
"""
    cfg = load_config(write(tmp_path, text), [f"output_dir={tmp_path / 'run'}"])
    labels = [m.label for m in cfg.models]
    assert labels == ["pt", "ft@0", "ft@2", "ft@10"]
    assert [m.epoch for m in cfg.models] == [None, 0, 2, 10]
    assert all(m.finetuned_from == "pt" for m in cfg.models[1:])
    out = run_study(cfg)
    df = seen(out, "seen_ids")
    got = df.groupby("model").epoch.first().to_dict()
    assert got["ft@10"] == 10 and got["ft@2"] == 2 and pd.isna(got["pt"])
    # an explicit list: epochs from the file names, and the checkpoint's weights are what is loaded
    v0 = df[df.model == "ft@0"].sort_values("layer").value.to_numpy()
    v10 = df[df.model == "ft@10"].sort_values("layer").value.to_numpy()
    assert not np.allclose(v0, v10)
    bad = text.replace("finetuned_from: pt", "finetuned_from: pretrained")
    with pytest.raises(ConfigError, match="finetuned_from names no model of the study"):
        load_config(write(tmp_path, bad))


def test_pair_stages_see_both_models_with_gradients_reuse_a_s_products_and_are_cached(fixtures, tmp_path):
    text = f"""
models:
  - {{name: vit_small_patch16_224, label: pt, pretrained: false, seed: 1, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, label: ft1, pretrained: false, seed: 2, finetuned_from: pt, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, label: ft2, pretrained: false, seed: 3, finetuned_from: pt, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, label: other, pretrained: false, seed: 4, kwargs: {TINY}}}
dataset: {{name: synthetic-shapes, n_images: 6}}
analyses:
  pair_seen: {{}}
  seen_ids: {{}}
batch_size: 4
progress: false
"""
    import vitscope.study.pool as pool

    loads: list[str] = []
    real = pool.load_model

    def counting(*a, **k):
        loads.append(k.get("seed"))
        return real(*a, **k)

    cfg = write(tmp_path, text)
    pool.load_model = counting
    try:
        out = run_study(load_config(cfg, [f"output_dir={tmp_path / 'run'}"]))
    finally:
        pool.load_model = real
    assert sorted(loads) == [1, 2, 3, 4]  # every model loaded once, pt kept for both of its pairs
    df = seen(out, "pair_seen")
    assert set(zip(df.model, df.model_b, strict=True)) == {("pt", "ft1"), ("pt", "ft2")}
    assert (df[df.metric == "grad"].value > 0).all()  # gradients flowed through model A
    reused = df[df.metric == "reused"].groupby("model_b").value.sum()
    assert reused["ft1"] == 0 and reused["ft2"] == 6  # the second pair reused A's stored products
    calls = []
    run_study(load_config(cfg, [f"output_dir={tmp_path / 'run'}"]), on_batch=lambda m, b: calls.append(m))
    assert calls == []  # cached
    with pytest.raises(ConfigError, match="compares model pairs"):
        load_config(write(tmp_path, text.replace(", finetuned_from: pt", "")))


def test_the_shipped_cifar10_subset_has_100_images_per_class_and_its_documented_files():
    from vitscope.data.catalog import FORMATS
    from vitscope.study.config import DatasetConfig

    ds = FORMATS["cifar10-test-1k"].build(DatasetConfig(name="cifar10-test-1k"))
    assert len(ds) == 1000 and ds.data.shape == (1000, 32, 32, 3) and ds.data.dtype == np.uint8
    assert np.bincount(ds.targets).tolist() == [100] * 10
    for i in (0, 99, 100, 555, 999):  # README: item i is class i // 100, file {i % 100:04d}.jpg
        assert ds.targets[i] == i // 100
        assert ds.files[i] == f"{ds.classes[i // 100]}/{i % 100:04d}.jpg"
    assert ds.data.std() > 30  # photographs, not a constant
    src = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10" / "test"
    if src.is_dir():  # the pixels are the decoded source files
        from PIL import Image

        for i in (3, 777):
            with Image.open(src / ds.files[i]) as im:
                assert np.array_equal(np.asarray(im.convert("RGB")), ds.data[i])


def test_vitscope_datasets_lists_every_format_with_what_it_provides(capsys):
    from vitscope.data.catalog import FORMATS

    assert main(["datasets"]) == 0
    text = capsys.readouterr().out
    for name in ("synthetic-shapes", "synthetic-cue-conflict", "synthetic-videos", "synthetic-pairs",
                 "synthetic-retrieval", "imagefolder", "cifar10", "cifar10-test-1k", "coco", "partimagenet",
                 "davis2016", "davis2017", "spair71k", "roxford5k", "rparis6k"):
        assert name in FORMATS and name in text
    assert "provides: cue_conflict" in text


def test_outputs_are_exactly_the_config_s(fixtures, tmp_path):
    cfg = write(tmp_path, TWO_DATASETS)
    out = run_study(load_config(cfg, [f"output_dir={tmp_path / 'run'}"]))
    assert (out / "results" / "seen_masked.parquet").is_file()
    smaller = TWO_DATASETS.replace("  seen_masked: {}\n", "")
    out = run_study(load_config(write(tmp_path, smaller, "small.yaml"), [f"output_dir={tmp_path / 'run'}"]),
                    overwrite=True)
    assert not (out / "results" / "seen_masked.parquet").exists()
    assert "seen_masked" not in (out / "report.html").read_text()
    # killed after the manifest but before the report: the next run rebuilds the report
    (out / "report.html").write_text("stale")
    m = json.loads((out / "manifest.json").read_text())
    m["report_done"] = False
    (out / "manifest.json").write_text(json.dumps(m))
    run_study(load_config(write(tmp_path, smaller, "small.yaml"), [f"output_dir={tmp_path / 'run'}"]))
    assert (out / "report.html").read_text() != "stale"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_equals_one_process_with_two_datasets_a_view_and_default_cka_batches(tmp_path):
    text = f"""
models:
  - {{name: vit_small_patch16_224, label: tiny, pretrained: false, kwargs: {TINY}}}
datasets:
  shapes: {{name: synthetic-shapes, n_images: 100}}
  photos: {{name: cifar10-test-1k, n_images: 40}}
analyses:
  seen_ids: {{views: ["test_shift:amount=0.3"]}}
  cka: {{views: [gap]}}
  seen_labelled: {{dataset: photos}}
batch_size: 8
progress: false
"""
    cfg = write(tmp_path, text)
    script = str(Path(__file__).parent / "run_with_fixtures.py")
    subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", script, "--quiet", "run", str(cfg),
                    f"output_dir={tmp_path / 'sharded'}"], check=True, timeout=300)
    subprocess.run([sys.executable, script, "--quiet", "run", str(cfg), f"output_dir={tmp_path / 'single'}"],
                   check=True, timeout=300)
    for name in ("seen_ids", "seen_labelled", "cka"):
        a, b = seen(tmp_path / "sharded", name), seen(tmp_path / "single", name)
        assert len(a) == len(b) > 0
        assert a.value.to_numpy() == pytest.approx(b.value.to_numpy(), rel=1e-6, abs=1e-9)


def test_the_readme_study_is_a_valid_config(tmp_path):
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    assert blocks
    for text in blocks:
        cfg = load_config(write(tmp_path, text))
        from vitscope.study.plan import make_plan

        plan = {a.name: a.slots["data"] for a in make_plan(cfg).analyses}
        assert plan == {"cka": "photos", "semantics": "photos", "saliency_iou": "scenes",
                        "attention_distance": "scenes"}


def test_resume_after_an_unreadable_image_counts_every_image_once_and_keeps_the_skip_list(tmp_path):
    from PIL import Image

    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    (root / "cat" / "3.png").write_bytes(b"not a png")
    text = f"""
models:
  - {{name: vit_small_patch16_224, label: tiny, pretrained: false, kwargs: {TINY}}}
dataset: {{name: imagefolder, root: {root}, n_images: 100}}
analyses:
  attention_distance: {{}}
  svd_volume: {{}}
  cka: {{batch_size: 4, views: [gap]}}
batch_size: 4
progress: false
"""
    cfg = write(tmp_path, text)
    with pytest.warns(UserWarning):
        ref = run_study(load_config(cfg, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'c-ref'}"]))

    class Killed(Exception):
        pass

    def kill(model, b):
        if b == 2:
            raise Killed

    over = [f"output_dir={tmp_path / 'run'}", "save_every=1", f"cache_dir={tmp_path / 'c-run'}"]
    with pytest.raises(Killed), pytest.warns(UserWarning):
        run_study(load_config(cfg, over), on_batch=kill)
    with pytest.warns(UserWarning):
        out = run_study(load_config(cfg, over))
    for name in ("attention_distance", "svd_volume", "cka"):
        pd.testing.assert_frame_equal(seen(out, name), seen(ref, name))
    assert set(seen(out, "attention_distance").n_images) == {19}
    for run_dir in (ref, out):
        skipped = json.loads((run_dir / "manifest.json").read_text())["skipped_images"]
        assert [p for p, _ in skipped[next(iter(skipped))]] == [str(root / "cat" / "3.png")]
    run_study(load_config(cfg, over))  # fully cached: the skip list is still there, and in the report
    skipped = json.loads((out / "manifest.json").read_text())["skipped_images"]
    assert len(skipped[next(iter(skipped))]) == 1
    assert "1 unreadable images of imagefolder were skipped" in (out / "report.html").read_text()
