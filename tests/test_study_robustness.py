"""What a study does with bad input: one line before any model loads where the input allows it, a stop naming
the model and tap when a model produces NaN, and the same numbers whatever else the study computes."""

import errno
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from study_fixtures import one_line_error, tiny_study_yaml

from vitscope.errors import ConfigError
from vitscope.study import load_config, run_study

YAML = tiny_study_yaml(depth=3)


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "study.yaml"
    p.write_text(YAML)
    return p




def _random_file(path: Path, n: int = 4096) -> Path:
    path.write_bytes(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes())
    return path


@pytest.mark.parametrize("overrides,needle", [
    (["analyses.cka.view=[gap]"], "has no parameter 'view'; did you mean views?"),
    (["analyses.cka.batch_size=four"], "'batch_size' of analysis 'cka' must be an integer"),
    (["analyses.semantics.ks=10"], "'ks' of analysis 'semantics' must be a list of integers"),
    (["save_every=0"], "save_every must be at least 1"),
    (["dtype=fp8"], "unknown dtype 'fp8'"),
    (["models.0.kwargs.trust_checkpoint=true"], "trust_checkpoint cannot be set from a study config"),
    (["models.0.kwargs.weights=x.pth"], "set weights instead"),
])
def test_config_mistakes_are_one_line_before_any_model_loads(config, tmp_path, capsys, no_model, overrides, needle):
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", *overrides])
    assert needle in err


def test_the_dtype_names_config_checks_before_torch_are_the_engine_s():
    from vitscope.capture.engine import DTYPES
    from vitscope.study.config import DTYPE_NAMES

    assert tuple(DTYPES) == DTYPE_NAMES


def test_invalid_yaml_is_one_line_saying_where(tmp_path, capsys, no_model):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: vit_small_patch16_224\n analyses: [\n")
    err = one_line_error(capsys, ["run", str(bad)])
    assert "invalid YAML in bad.yaml at line 3" in err
    err = one_line_error(capsys, ["run", str(bad.with_name("x.yaml")), "batch_size=[1,"])
    assert "does not exist" in err  # a missing file first, then the overrides' own syntax:
    good = tmp_path / "good.yaml"
    good.write_text(YAML)
    assert "invalid YAML in the overrides" in one_line_error(capsys, ["run", str(good), "batch_size=[1,"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line(config, tmp_path, capsys, no_model):
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", "device=cuda"])
    # no driver at all: said before torch is imported (config._gpu_driver); a driver without a GPU: torch says
    assert ("no GPU driver" in err or "0 usable CUDA GPU(s)" in err) and "device=cpu" in err


def test_cuda_on_a_machine_without_a_gpu_driver_is_refused_before_torch(monkeypatch):
    import vitscope.study.config as config_mod

    cfg = config_mod.StudyConfig(device="cuda:1")
    monkeypatch.setattr(config_mod, "_gpu_driver", lambda: False)
    with pytest.raises(ConfigError, match=r"device 'cuda:1' was asked for but this machine has no GPU driver"):
        config_mod._check_dtype_and_device(cfg)
    monkeypatch.setattr(config_mod, "_gpu_driver", lambda: True)  # a driver: torch decides, later
    config_mod._check_dtype_and_device(cfg)


def test_an_output_dir_that_is_a_file_or_read_only_is_one_line(config, tmp_path, capsys, no_model):
    (tmp_path / "file").write_text("x")
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'file'}"])
    assert "is a file, not a directory" in err
    if os.geteuid() == 0:  # root writes through permissions; /sys takes no new directories, even from root
        read_only = Path("/sys/vitscope-test-run")
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        read_only = tmp_path / "ro" / "run"
    err = one_line_error(capsys, ["run", str(config), f"output_dir={read_only}"])
    assert "cannot be written to" in err and str(read_only) in err


def test_corrupt_and_random_checkpoints_are_one_line_without_advice_to_trust_them(config, tmp_path, capsys, no_model):
    corrupt = _random_file(tmp_path / "model.safetensors")
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", f"models.0.name={corrupt}",
                                   "models.0.pretrained=true"])  # a file is weights (pretrained: false takes none)
    assert "not a valid safetensors file" in err and "models[0]" in err
    noise = _random_file(tmp_path / "weights.pth")
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", f"models.0.weights={noise}",
                                   "models.0.pretrained=true"])
    assert "is not a checkpoint" in err and "trust" not in err


def test_a_full_disk_names_the_directory_and_leaves_no_partial_files(config, tmp_path, capsys, monkeypatch):
    import vitscope.files

    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, b):  # some bytes land, then the device is full
            self.f.write(bytes(b)[:100])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    cache = tmp_path / "cache"  # the cache's device is full (the run directory's marker manifest is written first)
    monkeypatch.setattr(vitscope.files, "open", lambda p, mode="r": FullDisk(real_open(p, mode))
                        if str(p).startswith(str(cache)) else real_open(p, mode), raising=False)
    err = one_line_error(capsys, ["run", str(config), f"output_dir={tmp_path / 'out'}", f"cache_dir={cache}"])
    assert "no space left on the device of" in err and str(cache) in err
    assert [p for p in tmp_path.rglob("*.tmp")] == []  # the half-written file is gone
    from vitscope.study.cache import Cache

    kept = list(cache.rglob("*.pt"))  # what is kept is whole: states a rerun resumes from once there is space
    assert all(Cache(cache).load(p) is not None for p in kept)


def test_nan_weights_stop_the_study_naming_the_model_and_the_first_tap(tmp_path, capsys):
    import vitscope as vs
    from vitscope.models import save_checkpoint

    vm = vs.load_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48, depth=3,
                       num_heads=3)
    with torch.no_grad():
        vm.model.blocks[1].attn.qkv.weight[0, 0] = float("nan")
    ckpt = save_checkpoint(vm.model, tmp_path / "nan.safetensors", vm.spec)
    cfg = tmp_path / "study.yaml"
    cfg.write_text(YAML.replace("analyses:\n", "analyses:\n  attention_distance: {}\n")
                   .replace("name: vit_small_patch16_224", f"name: {ckpt}").replace("label: tiny", "label: broken")
                   .replace("pretrained: false", "pretrained: true"))  # a file is weights
    out = tmp_path / "out"
    err = one_line_error(capsys, ["run", str(cfg), f"output_dir={out}"])
    assert "model 'broken'" in err and "tap block1.attn" in err and "non-finite" in err
    assert not (out / "results" / "cka.parquet").exists()


def test_a_cka_entry_is_the_same_alone_and_beside_attention_analyses(config, tmp_path):
    alone = run_study(load_config(config, [f"output_dir={tmp_path / 'a'}"]))
    beside = run_study(load_config(config, [f"output_dir={tmp_path / 'b'}", "analyses.attention_distance={}",
                                            "analyses.aligned_attention_maps={}", f"cache_dir={tmp_path / 'c2'}"]))
    a, b = (pd.read_parquet(d / "results" / "cka.parquet") for d in (alone, beside))
    assert len(a) > 0
    pd.testing.assert_frame_equal(a, b, check_exact=True)  # bit for bit, not within rounding
