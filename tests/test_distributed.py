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


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_two_process_torchrun_equals_one_process(tmp_path):
    cfg = tmp_path / "study.yaml"
    cfg.write_text(YAML)
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "vitscope", "--quiet", "run", str(cfg),
                    f"output_dir={sharded}", f"cache_dir={tmp_path / 'c2'}"], check=True, timeout=240)
    subprocess.run([sys.executable, "-m", "vitscope", "--quiet", "run", str(cfg), f"output_dir={single}",
                    f"cache_dir={tmp_path / 'c1'}"], check=True, timeout=240)
    for name in ("attention_distance", "cka", "diversity"):
        a = pd.read_parquet(sharded / "results" / f"{name}.parquet")
        b = pd.read_parquet(single / "results" / f"{name}.parquet")
        assert len(a) == len(b) > 0
        assert a.value.to_numpy() == pytest.approx(b.value.to_numpy(), rel=1e-6, abs=1e-9)
    assert '"world_size": 2' in (sharded / "manifest.json").read_text()
