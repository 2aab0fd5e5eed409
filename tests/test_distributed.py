"""torchrun with 2 CPU processes gives the same tables as one process."""

import shutil
import subprocess
import sys

import pandas as pd
import pytest

YAML = """
models:
  - name: vit_small_patch16_224
    label: tiny-vit
    pretrained: false
    kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}
dataset: {name: synthetic-shapes, n_images: 20}
analyses:
  attention_distance: {}
  cka: {batch_size: 4, views: [gap]}
  diversity: {batch_size: 4}
batch_size: 4
progress: false
"""


def _sharded_and_single(cfg, tmp_path):
    """The study run by torchrun in two processes and by one process, each with its own cache; their attention
    distance, CKA and diversity tables equal to float rounding. Returns the two run directories."""
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "vitscope", "--quiet", "run", str(cfg),
                    f"output_dir={sharded}", f"cache_dir={tmp_path / 'c2'}"], check=True, timeout=240)
    subprocess.run([sys.executable, "-m", "vitscope", "--quiet", "run", str(cfg), f"output_dir={single}",
                    f"cache_dir={tmp_path / 'c1'}"], check=True, timeout=240)
    for name in ("attention_distance", "cka", "diversity"):
        a = pd.read_parquet(sharded / "results" / f"{name}.parquet")
        b = pd.read_parquet(single / "results" / f"{name}.parquet")
        assert len(a) == len(b) > 0
        assert a.value.to_numpy() == pytest.approx(b.value.to_numpy(), rel=1e-6, abs=1e-9), name
    return sharded, single


@pytest.mark.slow  # the unreadable-image variant below runs the same comparison and more
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_two_process_torchrun_equals_one_process(tmp_path):
    cfg = tmp_path / "study.yaml"
    cfg.write_text(YAML)
    sharded, single = _sharded_and_single(cfg, tmp_path)
    assert '"world_size": 2' in (sharded / "manifest.json").read_text()


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_equals_one_process_with_an_unreadable_image_in_each_ranks_shard(tmp_path):
    """Issue 32, BAD 4: the CKA groups, the image counts and the skip list of a two-rank run are those of one
    process, also when each rank meets an unreadable image (not at a shard's end)."""
    import json

    import numpy as np
    from PIL import Image

    from vitscope.data.catalog import build_dataset
    from vitscope.study import load_config
    from vitscope.study.distributed import Dist
    from vitscope.study.plan import make_plan
    from vitscope.study.run import _select_ids, _shard

    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    cfg = tmp_path / "study.yaml"
    cfg.write_text(YAML.replace("dataset: {name: synthetic-shapes, n_images: 20}",
                                f"dataset: {{name: imagefolder, root: {root}, n_images: 24}}"))
    config = load_config(cfg)
    dc = next(iter(make_plan(config).datasets.values()))
    ds = build_dataset(dc)
    ids = _select_ids(ds, dc.n_images)
    align = make_plan(config).align(dc.name, config.batch_size)
    broken = []
    for rank in range(2):
        shard, _ = _shard(ids, ds, align, Dist(rank, 2))
        broken.append(ds.files[shard[1]])  # the second image of each rank's shard: a CKA group gets shorter
    for f in broken:
        f.write_bytes(b"not a png")
    sharded, single = _sharded_and_single(cfg, tmp_path)
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (sharded, single))
    assert ma["datasets"] == mb["datasets"] and ma["dataset"] == mb["dataset"]
    assert (ma["world_size"], mb["world_size"]) == (2, 1)
    assert ma["skipped_images"] == mb["skipped_images"]
    assert sorted(p for p, _ in next(iter(ma["skipped_images"].values()))) == sorted(map(str, broken))


@pytest.mark.parametrize(("device", "local", "gpus", "want"), [
    ("cuda", 0, 4, "cuda:0"), ("cuda", 3, 4, "cuda:3"), ("cuda", 5, 4, "cuda:1"),  # each rank its own GPU
    ("cuda:1", 3, 4, "cuda:1"), ("cpu", 3, 4, "cpu"), ("cuda", None, 4, "cuda"), ("cuda", 2, 0, "cuda")])
def test_a_bare_cuda_is_each_torchrun_ranks_own_gpu(device, local, gpus, want):
    from vitscope.study.distributed import rank_device

    assert rank_device(device, local, gpus) == want


def test_ranks_on_one_machine_never_share_a_gpu_while_there_are_enough():
    from vitscope.study.distributed import rank_device

    for gpus in range(1, 9):
        for ranks in range(1, gpus + 1):
            assert len({rank_device("cuda", r, gpus) for r in range(ranks)}) == ranks


@pytest.mark.parametrize("cuda, env, local_world, gpus, want", [
    (False, "", 2, 0, "gloo"),   # no GPU: gloo
    (True, "cpu", 2, 2, "gloo"),  # a CPU study on a GPU machine
    (True, "", 2, 2, "nccl"),    # one GPU per rank
    (True, "", 8, 8, "nccl"),
    (True, "", 2, 1, "gloo"),    # two ranks on one GPU: NCCL would refuse (duplicate GPU), gloo lets them share
    (True, "", 16, 8, "gloo"),
])
def test_nccl_only_where_every_rank_on_the_machine_has_its_own_gpu(cuda, env, local_world, gpus, want):
    from vitscope.study.distributed import backend_for

    assert backend_for(cuda, env, local_world, gpus) == want
