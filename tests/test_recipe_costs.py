"""tools/recipe_costs.py: the count-faithful data_root it writes is read by vitscope's own formats at the real
datasets' counts (the published numbers, written out here, not taken from the tool), its files stay tiny, and a
recipe whose dry run fails becomes a row of the table instead of stopping the tool."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rc():
    spec = importlib.util.spec_from_file_location("recipe_costs", ROOT / "tools" / "recipe_costs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _read(name: str, root: Path, **kw):
    """The dataset as a recipe's config builds it."""
    from vitscope.data.catalog import build_dataset
    from vitscope.study.slots import DatasetConfig

    return build_dataset(DatasetConfig(name=name, root=str(root), **kw))


def test_linked_images_have_the_asked_size_and_share_one_file(rc, tmp_path):
    ln = rc.Linker(tmp_path / "store")
    ln.put(tmp_path / "a" / "x.jpg", (854, 480))
    ln.put(tmp_path / "b" / "y.jpg", (854, 480))
    ln.put(tmp_path / "c.png", (224, 224))
    assert Image.open(tmp_path / "a" / "x.jpg").size == (854, 480)
    assert Image.open(tmp_path / "c.png").size == (224, 224)
    assert os.stat(tmp_path / "a" / "x.jpg").st_ino == os.stat(tmp_path / "b" / "y.jpg").st_ino


def test_davis_val_is_30_videos_of_1999_frames_at_480p(rc, tmp_path):
    rc.write_davis(tmp_path, rc.Linker(tmp_path / ".images"))
    ds = _read("davis2017", tmp_path / "davis", split="val")
    assert len(ds) == 1999 and len(ds.sequences) == 30  # DAVIS-2017 val as released
    sample = ds.load(0)
    assert sample.image.shape[:2] == (480, 854) and sample.objects.max() == 1


def test_revisited_counts(rc, tmp_path):
    rc.write_revisited(tmp_path, rc.Linker(tmp_path / ".images"))
    for name, (db, q) in {"roxford5k": (4993, 70), "rparis6k": (6322, 70)}.items():
        ds = _read(name, tmp_path / "revisited" / name)
        assert (len(ds.imlist), len(ds.qimlist)) == (db, q)
        assert Image.open(tmp_path / "revisited" / name / "jpg" / f"{ds.imlist[0]}.jpg").size == (1024, 768)


def test_cifar_c_arrays_have_the_real_shape_and_take_no_disk(rc, tmp_path):
    rc.write_cifar_c(tmp_path)
    ds = _read("corrupted", tmp_path / "cifar10-c", options={"corruptions": ["fog", "snow"]})
    assert len(ds) == 2 * 5 * 10000  # CIFAR-10-C: 10,000 test images per corruption and severity
    assert sorted(ds.arrays) == ["fog", "snow"] and ds.arrays["fog"].shape == (50000, 32, 32, 3)
    assert len(list((tmp_path / "cifar100-c").glob("*.npy"))) == 19 + 1  # 19 corruptions + labels
    st = os.stat(tmp_path / "cifar10-c" / "fog.npy")
    assert st.st_size > 150_000_000 and st.st_blocks * 512 < 1_000_000  # sparse
    assert np.load(tmp_path / "cifar100-c" / "labels.npy").max() == 99


@pytest.mark.slow
def test_spair_cue_conflict_coco_counts(rc, tmp_path):
    ln = rc.Linker(tmp_path / ".images")
    rc.write_spair(tmp_path, ln)
    rc.write_cue_conflict(tmp_path, ln)
    rc.write_coco(tmp_path, ln)
    ds = _read("spair71k", tmp_path / "spair" / "SPair-71k", split="test")
    assert len(ds.pairs) == 12234 and len(ds) == 2 * 12234 and len(ds.classes) == 18  # SPair-71k test pairs
    assert len(_read("cue-conflict", tmp_path / "cue-conflict")) == 1280
    coco = _read("coco", tmp_path / "coco" / "val2017",
                 annotations=str(tmp_path / "coco" / "annotations" / "instances_val2017.json"))
    assert len(coco) in (5000, 4952)  # all of val2017, or its annotated images


def test_a_failing_recipe_is_a_row_of_the_table(rc, tmp_path):
    row = rc.recipe_cost("no-such-recipe", tmp_path / "data", tmp_path)
    assert "error" in row
    text = rc.table([row, {"recipe": "r", "models": 2, "forwards": 1234, "images": 56789, "hours": 0.0123,
                           "cache": "1.0 GiB"}])
    lines = text.splitlines()
    assert len(lines) == 4 and "dry run failed" in lines[2] and "no-such-recipe" in lines[2]
    assert lines[3] == "| r | 2 | 1,234 | 56,789 | 0.012 | 1.0 GiB |"
