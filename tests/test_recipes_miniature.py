"""Each source paper's recipe runs on a miniature: every loader, analysis and figure a recipe names, end to end.

The recipes (`src/vitscope/configs/recipes/<name>.yaml`, ``vitscope run recipe:<name> data_root=/data
ckpt_root=/ckpts``) read ImageNet, COCO, DAVIS, ... and the registry's pretrained weights, none of which is here.
So tests/miniature.py writes every dataset of the recipes' ``data_root`` contract in its real on-disk layout (a
few tiny images per class), and the `stand_ins` fixture makes each model a tiny random network of the entry's own
architecture (`miniature.stand_in_load`: the registry name, CLS, registers and head kept, sizes cut); a
recipe's ``${ckpt_root}`` checkpoints are written as tiny timm state dicts of those stand-ins. The recipe file is
run as shipped; only counts and sizes are overridden on the command line (`_small_overrides`).

What a run must give: exit status 0, a table with rows for every analysis of the recipe (or a stated reason in
``results/summary/empty.parquet``), and report.html with at least one figure in the section of every table that
has a figure function.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import miniature
import numpy as np
import pandas as pd
import pytest
import yaml

from vitscope.data.base import batch_parts
from vitscope.data.catalog import build_dataset
from vitscope.models.registry import Preprocessing

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPES_DIR = Path(__file__).resolve().parents[1] / "src" / "vitscope" / "configs" / "recipes"
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
PRE = Preprocessing(input_size=32, crop_pct=1.0)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: Any) -> Path:
    """The miniature data root, written once for the module (about 4 MB, a few seconds)."""
    return miniature.write_data_root(tmp_path_factory.mktemp("miniature") / "data")


@pytest.fixture
def stand_ins(monkeypatch: Any) -> None:
    """Every model a study loads is its tiny random stand-in (`miniature.stand_in_load`); the config checks still
    resolve the real registry names (only the study's model pool is patched). The 2-core helper process is off:
    it would load the real weights in a process this patch does not reach."""
    import vitscope.study.pool as pool_mod

    monkeypatch.setattr(pool_mod, "load_model", miniature.stand_in_load)
    monkeypatch.setenv("VITSCOPE_WORKERS", "1")


# ------------------------------------------------------------------------------------------------ the data


def _mean_image(ds: Any, i: int) -> float:
    return float(np.asarray(ds[i].image, np.float64).mean())


def test_every_miniature_dataset_builds_with_its_format(data_root):
    """Each folder of the contract is read by vitscope's own format (`build_dataset`), holds what was written, and
    gives a model-ready batch."""
    built = {k: build_dataset(miniature.dataset_config(data_root, k)) for k in miniature.MINIATURE_DATASETS}
    n50 = len(miniature.imagenet50_ids())
    n_classes = n50 + len(miniature.EXTRA_SYNSETS)
    # counts: the files on disk, counted here independently of the formats
    assert len(built["imagenet"]) == n_classes * (miniature.PER_CLASS_TRAIN + miniature.PER_CLASS_VAL)
    assert sum(built["imagenet"].is_test) == n_classes * miniature.PER_CLASS_VAL
    assert len(built["imagenet-val"]) == len(list((data_root / "imagenet" / "val").rglob("*.JPEG")))
    assert built["imagenet50"].classes == miniature.imagenet50_ids() and len(built["imagenet50"]) == \
        n50 * miniature.PER_CLASS_TRAIN
    assert len(built["coco"]) == len(list((data_root / "coco" / "val2017").glob("*.jpg")))
    assert len(built["davis"]) == 2 * miniature.DAVIS_FRAMES
    assert len(built["spair"]) == 2 * len(list((data_root / "spair" / "SPair-71k" / "PairAnnotation" / "test")
                                               .glob("*.json")))
    assert len(built["cue-conflict"]) == 2 * len(miniature.CUE_CONFLICT_CATEGORIES)
    assert len(built["cifar10"]) == 20 and len(built["cifar100"]) == 100 and len(built["cifar100"].classes) == 100
    for c in ("cifar10-c", "cifar100-c"):
        assert len(built[c]) == 5 * miniature.PER_SEVERITY * len(miniature.CIFAR_C_CORRUPTIONS)
    for key, ds in built.items():
        for part in batch_parts(next(iter(ds.batches(2, PRE)))):  # whole frames of several sizes: a part each
            assert part.images.shape[1] == 3 and np.isfinite(part.images.numpy()).all(), key
        assert _mean_image(ds, 0) > 0, key


def test_miniature_annotations_read_back_as_drawn(data_root):
    """What the formats read equals what the writer drew, checked from the files with other readers: COCO's
    masks (a polygon's box and an RLE's disk), DAVIS's object ids, SPair's keypoints (+0.5, vitscope's pixel
    centres), the revisited protocols from the pickle, cue-conflict texture labels from the file names."""
    import json
    import pickle

    from PIL import Image

    coco = build_dataset(miniature.dataset_config(data_root, "coco"))
    ann = json.loads((data_root / "coco" / "annotations" / "instances_val2017.json").read_text())
    s = coco[0]
    poly = next(a for a in ann["annotations"] if a["image_id"] == coco.image_ids[0] and a["iscrowd"] == 0
                and isinstance(a["segmentation"], list))
    x0, y0, w, h = poly["bbox"]
    inner = s.objects[int(y0) + 2:int(y0 + h) - 2, int(x0) + 2:int(x0 + w) - 2]
    assert (inner > 0).all()
    crowd = next(a for a in ann["annotations"] if a["iscrowd"])
    runs = crowd["segmentation"]["counts"]
    flat = np.repeat(np.arange(len(runs)) % 2, runs).astype(bool)  # uncompressed RLE, decoded by hand
    truth = flat.reshape(crowd["segmentation"]["size"][::-1]).T
    k = coco.image_ids.index(crowd["image_id"])
    assert (coco[k].objects[truth] > 0).all()

    davis = build_dataset(miniature.dataset_config(data_root, "davis"))
    png = np.asarray(Image.open(data_root / "davis" / "Annotations" / "480p" / "bear" / "00001.png"))
    assert np.array_equal(davis[1].objects, png) and set(np.unique(png).tolist()) == {0, 1, 2}

    spair = build_dataset(miniature.dataset_config(data_root, "spair"))
    first = sorted((data_root / "spair" / "SPair-71k" / "PairAnnotation" / "test").glob("*.json"))[0]
    rec = json.loads(first.read_text())
    np.testing.assert_allclose(spair[0].keypoints[:, :2], np.asarray(rec["src_kps"]) + 0.5)
    np.testing.assert_allclose(spair[1].keypoints[:, :2], np.asarray(rec["trg_kps"]) + 0.5)

    with open(data_root / "revisited" / "roxford5k" / "gnd_roxford5k.pkl", "rb") as f:
        gnd = pickle.load(f)  # the test's own file: plain pickle here, the format's restricted one above
    rox = build_dataset(miniature.dataset_config(data_root, "roxford5k"))
    assert rox.n_queries == len(gnd["qimlist"]) and len(rox) == len(gnd["qimlist"]) + len(gnd["imlist"])
    for q, g in enumerate(gnd["gnd"]):  # medium: easy + hard are positives; hard: easy joins the junk
        assert sorted(rox.protocols["medium"][q]["ok"]) == sorted([*g["easy"].tolist(), *g["hard"].tolist()])
        assert sorted(rox.protocols["hard"][q]["junk"]) == sorted([*g["junk"].tolist(), *g["easy"].tolist()])

    cue = build_dataset(miniature.dataset_config(data_root, "cue-conflict"))
    for f, shape, texture in zip(cue.files, cue.labels, cue.texture_labels, strict=True):
        m = re.match(r"([a-z]+)\d+-([a-z]+)\d+", f.stem)
        assert (cue.classes[shape], cue.classes[texture]) == m.groups() and shape != texture

    c100 = build_dataset(miniature.dataset_config(data_root, "cifar100-c"))
    labels = np.load(data_root / "cifar100-c" / "labels.npy")
    assert labels.max() >= 10 and sorted(c100.index_labels()) == sorted(np.tile(labels, len(
        miniature.CIFAR_C_CORRUPTIONS)).tolist())


# ------------------------------------------------------------------------------------------------ stand-ins


def _recipe_models() -> set[str]:
    names = set()
    for r in RECIPES:
        raw = yaml.safe_load((RECIPES_DIR / f"{r}.yaml").read_text()) or {}
        names |= {m["name"] for m in raw.get("models") or [] if m.get("name")}
    return names


@pytest.mark.parametrize("name", sorted({"sup-b16", "beit-b16", "dinov3-s16", "dinov2-s14-reg", "siglip2-b16"}
                                        | _recipe_models()))
def test_stand_in_is_a_tiny_model_of_the_entry_s_own_kind(name):
    """A stand-in keeps the registry name and its architecture's kind (timm class), its prefix tokens and whether
    it has a CLS, with the tiny sizes; a checkpoint written for it loads back bit for bit through vitscope's loader."""
    import tempfile

    import torch

    from vitscope.models import load_model
    from vitscope.models.load import resolve_spec

    spec = resolve_spec(name)
    real = load_model(name, pretrained=False, **({"init_values": 0.1} if spec.arch.startswith("beit") else {}),
                      **{k: v for k, v in miniature.STAND_IN_SIZE.items() if k not in ("embed_dim", "num_heads")},
                      embed_dim=64, num_heads=4)  # the entry at another width: the same kind of network
    vm = miniature.stand_in_load(name)
    assert vm.spec.name == name and type(vm.model) is type(real.model)
    assert (vm.num_prefix_tokens, vm.depth, vm.patch_size, vm.preprocessing.input_size) == \
        (real.num_prefix_tokens, 2, 8, 32)
    assert vm.has_cls_token == real.has_cls_token
    with tempfile.TemporaryDirectory() as d:  # in the entry's own release layout (SimMIM's, MoCo v3's, ...)
        f = miniature.write_checkpoint(Path(d) / "epoch3.pth", name, seed=5)
        back = miniature.stand_in_load(name, weights=str(f)).model.state_dict()
    want = load_model(name, pretrained=False, seed=5, **miniature.stand_in_kwargs(name)).model.state_dict()
    assert set(back) == set(want)
    for k, v in want.items():
        assert torch.equal(back[k], v), k


# ------------------------------------------------------------------------------------------------ runs


def _run(argv: list[str], capsys: Any) -> int:
    from vitscope.cli import main

    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    return rc


def _check_run(out: Path, analyses: list[str]) -> None:
    """Every analysis gave a table with rows or a stated reason; every table has at least one figure in its section
    of report.html (an analysis without a figure function in `vitscope.report.figures.FIGURES` fails too)."""
    results = out / "results"
    empty = results / "summary" / "empty.parquet"
    reasons = pd.read_parquet(empty) if empty.is_file() else pd.DataFrame(columns=["analysis", "reason"])
    missing = []
    for name in analyses:
        table = results / f"{name}.parquet"
        if table.is_file():
            assert len(pd.read_parquet(table)) > 0, name
        elif not (reasons["analysis"] == name).any():
            missing.append(name)
    assert not missing, f"no table and no stated reason for {missing}"
    html = (out / "report.html").read_text()
    sections = dict(re.findall(r"<h2 id='([^']+)'>(.*?)(?=<h2 id=|</body>)", html, flags=re.S))
    no_figure = [name for name in analyses if (results / f"{name}.parquet").is_file()
                 and "<figure>" not in sections.get(name, "")]
    assert not no_figure, f"tables without a figure in report.html: {no_figure}"


def _study_yaml(data_root: Path, ckpt_root: Path) -> str:
    """A study of our own over the contract's folders (what the recipes read), independent of the recipes: three
    architectures (ViT, BEiT, Eva), a checkpoint list, and an analysis on each kind of data (centre crops: a BEiT
    takes one input size, so no whole frames)."""
    d = data_root
    return f"""
models:
  - {{name: sup-b16}}
  - {{name: beit-b16}}
  - {{name: dinov3-s16}}
  - {{name: mocov3-b16, label: ft, checkpoints: ["{ckpt_root}/ft_epoch1.pth", "{ckpt_root}/ft_epoch2.pth"]}}
datasets:
  in50: {{name: imagefolder, root: {d}/imagenet/train, classes: {d}/imagenet50_classes.txt, per_class: 3}}
  coco: {{name: coco, root: {d}/coco/val2017, annotations: {d}/coco/annotations/instances_val2017.json}}
  davis: {{name: davis2017, root: {d}/davis, split: val, options: {{crop: center}}}}
  spair: {{name: spair71k, root: {d}/spair/SPair-71k, split: test, options: {{crop: center}}}}
  roxford: {{name: roxford5k, root: {d}/revisited/roxford5k, options: {{crop: center}}}}
  cue: {{name: cue-conflict, root: {d}/cue-conflict}}
analyses:
  semantics: {{dataset: in50}}
  saliency_iou: {{dataset: coco}}
  propagation: {{dataset: davis, n_last_frames: 2, radius: 2}}
  correspondence: {{dataset: spair}}
  retrieval: {{dataset: roxford}}
  attention_distance: {{dataset: cue}}
batch_size: 8
progress: false
num_workers: 0
"""


@pytest.mark.slow
def test_a_study_of_every_contract_folder_runs_on_the_miniature(tmp_path, data_root, stand_ins, capsys):
    """A hand-written study over the contract's folders and a ``checkpoints:`` list runs with the stand-ins."""
    ckpts = tmp_path / "ckpts"
    for e in (1, 2):
        miniature.write_checkpoint(ckpts / f"ft_epoch{e}.pth", "mocov3-b16", seed=e)
    (data_root / "imagenet50_classes.txt").write_text("".join(f"{c}\n" for c in miniature.imagenet50_ids()))
    study = tmp_path / "study.yaml"
    study.write_text(_study_yaml(data_root, ckpts))
    out = tmp_path / "run"
    _run(["run", str(study), f"output_dir={out}", f"cache_dir={tmp_path / 'cache'}"], capsys)
    analyses = list(yaml.safe_load(study.read_text())["analyses"])
    _check_run(out, analyses)
    sem = pd.read_parquet(out / "results" / "semantics.parquet")
    assert {"sup-b16", "beit-b16", "dinov3-s16", "ft@1", "ft@2"} <= set(sem["model"])


def _small_overrides(raw: dict[str, Any]) -> list[str]:
    """Command-line overrides that fit the recipe ``raw`` to the miniature and to a test's time, leaving the file as
    shipped: a subset's ``per_class`` to the miniature's images per class; a frame size (``options.size``) to the
    stand-ins' 32 px and dense tiles to their patch; the inversion of STIR to a few steps, once."""
    out = []
    for name, d in (raw.get("datasets") or {}).items():
        if d.get("per_class"):
            out.append(f"datasets.{name}.per_class={miniature.PER_CLASS_TRAIN}")
        if "size" in (d.get("options") or {}):
            out.append(f"datasets.{name}.options.size=32")
        if (d.get("options") or {}).get("tiling"):  # tiles cut for the stand-ins' patch
            out.append(f"datasets.{name}.options.patch={miniature.STAND_IN_SIZE['patch_size']}")
    params = raw.get("analyses") or {}
    if "stir" in params:
        out += ["analyses.stir.iterations=2", "analyses.stir.repeats=1"]
    return out


@pytest.mark.parametrize("recipe", RECIPES or [None])
def test_recipe_datasets_read_the_miniature(recipe, data_root, tmp_path):
    """Fast, no model: every dataset of the recipe, as its config resolves ``${data_root}`` to the miniature, is
    built by its format and gives a model-ready batch (the contract's folders and the recipes' paths agree)."""
    if recipe is None:
        pytest.skip(f"no recipes yet: {RECIPES_DIR} holds no <name>.yaml")
    from vitscope.study.config import load_config
    from vitscope.study.slots import study_datasets

    raw = yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())
    cfg = load_config(f"recipe:{recipe}", [f"data_root={data_root}", f"ckpt_root={tmp_path}",
                                           *_small_overrides(raw)])
    datasets = study_datasets(cfg)
    assert set(datasets) == set(raw.get("datasets") or {})
    for name, dc in datasets.items():
        assert str(dc.root).startswith(str(data_root)), name
        ds = build_dataset(dc)
        assert len(ds) > 0, name
        for part in batch_parts(next(iter(ds.batches(2, PRE)))):
            assert part.images.shape[1] == 3 and len(part) > 0, name


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES or [None])
def test_recipe_runs_on_the_miniature(recipe, tmp_path, data_root, stand_ins, capsys):
    """``vitscope run recipe:<name> data_root=... ckpt_root=...`` on the miniature with the stand-ins: exit 0, a
    table (or a stated reason) per analysis, a figure per drawn table."""
    if recipe is None:
        pytest.skip(f"no recipes yet: {RECIPES_DIR} holds no <name>.yaml")
    path = RECIPES_DIR / f"{recipe}.yaml"
    raw = yaml.safe_load(path.read_text())
    ckpts = tmp_path / "ckpts"
    miniature.write_recipe_checkpoints(path, ckpts)
    out = tmp_path / "run"
    _run(["run", f"recipe:{recipe}", f"data_root={data_root}", f"ckpt_root={ckpts}", f"output_dir={out}",
          f"cache_dir={tmp_path / 'cache'}", "progress=false", "num_workers=0", *_small_overrides(raw)], capsys)
    _check_run(out, list(raw["analyses"]))
    labels = {m.get("label") or m["name"] for m in raw["models"] if not m.get("checkpoints")}
    seen = set().union(*(set(pd.read_parquet(t)["model"]) for t in (out / "results").glob("*.parquet")
                         if "model" in pd.read_parquet(t).columns))
    assert labels <= seen, f"models without a row in any table: {sorted(labels - seen)}"
