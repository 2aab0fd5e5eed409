"""No file vitscope reads can run code: a pickled payload planted where vitscope reads (a study cache entry,
the revisited ground truth, CIFAR's python batches, a zoo training state, a checkpoint) is refused, never
executed; and the default study cache is per user, never beside a run in a shared directory."""

import pickle
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from vitscope.errors import CheckpointError, InputError, VitscopeError
from vitscope.study import load_config, run_study
from vitscope.study.cache import Cache


class Payload:
    """What an attacker plants: unpickling it writes ``marker`` (any code could run instead)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


STUDY = """
models:
  - name: vit_small_patch16_224
    label: tiny
    pretrained: false
    kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}
dataset: {name: synthetic-shapes, n_images: 4}
analyses:
  attention_distance: {}
batch_size: 4
progress: false
"""


def test_a_payload_in_a_cache_entry_does_not_run_and_the_entry_is_recomputed(tmp_path):
    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY)
    out, overrides = tmp_path / "run", [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'c'}"]
    run_study(load_config(cfg, overrides))
    first = pd.read_parquet(out / "results" / "attention_distance.parquet")
    entries = list((tmp_path / "c").rglob("attention_distance-*.pt"))
    assert len(entries) == 1
    marker = tmp_path / "pwned"
    torch.save({"finished": True, "format": 2, "state": Payload(marker), "info": {}, "frame": None}, entries[0])
    (out / "report.html").unlink()  # so the rerun reads the entry back and rebuilds its tables

    run_study(load_config(cfg, overrides))
    assert not marker.exists()
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results" / "attention_distance.parquet"), first)
    assert Cache(entries[0].parents[1]).load(entries[0])["finished"]  # recomputed and overwritten with data


def test_cache_entries_are_data_and_keep_their_table_and_mmap(tmp_path):
    cache = Cache(tmp_path / "c")
    path = cache.path("m", "semantics", "k")
    frame = pd.DataFrame({"model": ["a", "b"], "layer": [0, None], "value": [0.5, np.nan], "head": [None, None]})
    big = torch.randn(64, 8).half()
    cache.save(path, {"finished": True, "state": {"layers": [big], "views": ("cls",), 3: None}, "frame": frame})
    assert isinstance(torch.load(path, weights_only=True)["frame"], torch.Tensor)  # data: parquet bytes
    entry = cache.load(path)
    pd.testing.assert_frame_equal(entry["frame"], frame)
    assert torch.equal(entry["state"]["layers"][0], big) and entry["state"]["views"] == ("cls",)
    assert _mapped_from(entry["state"]["layers"][0], path)  # the file is mapped, not read into memory


def _mapped_from(t: torch.Tensor, path: Path) -> bool:
    if not Path("/proc/self/maps").is_file():
        return True  # not Linux: nothing to look at
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= t.data_ptr() < hi:
                return True
    return False


def test_default_cache_is_per_user_never_beside_a_run_in_the_shared_temp_dir(tmp_path, monkeypatch):
    from vitscope.study.cache import default_cache_dir

    shared_run = Path(tempfile.gettempdir()) / "x"
    monkeypatch.delenv("VITSCOPE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir(shared_run) == tmp_path / "xdg" / "vitscope" / "states"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    d = default_cache_dir(shared_run)
    assert d == tmp_path / "home" / ".cache" / "vitscope" / "states"

    # a study run there keeps its states in the user's cache, created private to the user
    monkeypatch.setenv("VITSCOPE_CACHE_DIR", str(tmp_path / "mine"))
    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY)
    run_study(load_config(cfg, [f"output_dir={tmp_path / 'shared' / 'x'}"]))
    assert not (tmp_path / "shared" / "cache").exists()
    states = tmp_path / "mine" / "states"
    assert list(states.rglob("attention_distance-*.pt")) and states.stat().st_mode & 0o077 == 0


def test_a_payload_in_the_revisited_ground_truth_does_not_run(tmp_path):
    root = tmp_path / "roxford5k"
    (root / "jpg").mkdir(parents=True)
    marker = tmp_path / "pwned"
    gnd = {"imlist": ["d0"], "qimlist": ["q0"], "gnd": [{"bbx": [0, 0, 1, 1], "easy": [0], "x": Payload(marker)}]}
    with open(root / "gnd_roxford5k.pkl", "wb") as f:
        pickle.dump(gnd, f)
    from vitscope.data.formats.revisited import RevisitedRetrieval

    with pytest.raises(InputError, match="builtins.exec"):
        RevisitedRetrieval(tmp_path)
    assert not marker.exists()


def test_revisited_ground_truth_with_numpy_arrays_still_loads(tmp_path):
    """What the real files hold: lists of names, per query numpy index arrays and a box."""
    from PIL import Image

    from vitscope.data.formats.revisited import RevisitedRetrieval

    root = tmp_path / "roxford5k"
    (root / "jpg").mkdir(parents=True)
    for n in ("q0", "d0", "d1"):
        Image.new("RGB", (8, 8)).save(root / "jpg" / f"{n}.jpg")
    gnd = {"imlist": ["d0", "d1"], "qimlist": ["q0"],
           "gnd": [{"bbx": np.array([0.0, 0.0, 4.0, 4.0]), "easy": np.array([0]), "hard": np.array([1], np.int64),
                    "junk": np.array([], np.int64)}]}
    for protocol in (2, 5):
        with open(root / "gnd_roxford5k.pkl", "wb") as f:
            pickle.dump(gnd, f, protocol=protocol)
        ds = RevisitedRetrieval(tmp_path)
        assert ds.n_queries == 1 and len(ds) == 3


def test_a_payload_in_cifar_batches_does_not_run(tmp_path):
    from vitscope.data.formats.cifar import Cifar

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "pwned"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        with open(folder / name, "wb") as f:
            pickle.dump({"data": np.zeros((1, 3072), np.uint8), "labels": [0], "label_names": ["a"],
                         "x": Payload(marker)}, f)
    with pytest.raises(InputError, match="did not load"):
        Cifar(tmp_path)
    assert not marker.exists()


def test_a_payload_in_a_zoo_training_state_does_not_run(tmp_path):
    from vitscope.zoo.train import STATE_FILE, TrainConfig, train

    out = tmp_path / "zoo"
    out.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"config": {}, "x": Payload(marker)}, out / STATE_FILE)
    cfg = TrainConfig("supervised", out, data="synthetic", synthetic_n=(16, 8), batch_size=8, budget_views=16,
                      knn_train=8, knn_test=8, progress=False,
                      arch=dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2))
    with pytest.raises(VitscopeError, match="not a training state"):
        train(cfg, resume=True)
    assert not marker.exists()


def test_a_payload_in_a_checkpoint_does_not_run_and_gets_no_advice_to_trust_it(tmp_path):
    from vitscope.models.checkpoints import read_checkpoint

    marker = tmp_path / "pwned"
    torch.save({"pos_embed": torch.zeros(1), "x": Payload(marker)}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path / "evil.pth")
    assert not marker.exists() and "exec" in str(e.value) and "trust" not in str(e.value)
