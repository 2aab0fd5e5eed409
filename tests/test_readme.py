"""The README's code blocks run as written: every ```python block is executed, and every `vitscope ...` line of
its ```bash blocks goes through the command line, with network-free stand-ins only where the README names
things this machine cannot have (hub weights, the user's photos and checkpoint, their study file)."""

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitscope
from vitscope.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"

#: README lines not run here, and why: installing is what CI's own setup does; training and evaluating a zoo
#: model take minutes (tests/test_zoo.py runs both on tiny settings)
NOT_RUN = {
    "pip install torch==2.14.1 torchvision==0.29.1 && pip install -e \".[test]\" && vitscope run":
        "installs packages (CI's own setup); `vitscope run` alone is test_readme_default_study (slow)",
    "pip install torch==2.14.1 torchvision==0.29.1 && pip install -e \".[test]\" && python -m pytest -q":
        "the test suite itself",
    "vitscope zoo train --objective dino --out zoo/dino": "trains for minutes (test_zoo trains tiny runs)",
    "vitscope zoo evaluate zoo/dino": "needs the run that trains for minutes",
}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def commands() -> list[str]:
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            cmd = line.split("  #")[0].strip()
            if cmd:
                out.append(cmd)
    return out


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A working directory with the files the README names, and hub weights replaced by a random init of
    the same architecture (the registry entry, its taps and preprocessing are the real ones)."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    for name in ("cat.jpg", "dog.jpg", "car.jpg", "tree.jpg"):
        Image.fromarray(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)).save(name)
    import timm

    torch.save(timm.create_model("vit_small_patch16_224").state_dict(), "checkpoint.pth")
    from transformers import ViTConfig, ViTForImageClassification  # the user's fine-tuned transformers model

    ViTForImageClassification(ViTConfig(image_size=64, patch_size=16, hidden_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, intermediate_size=128, num_labels=3)
                              ).save_pretrained("my-finetuned-vit")
    real = vitscope.load_model

    def load_model(name, weights=None, **kw):
        from vitscope.models.load import resolve_spec

        if weights is None and resolve_spec(name).weights.kind not in ("none", "file"):
            kw["pretrained"] = False  # would download: the same architecture, randomly initialised
        return real(name, weights, **kw)

    monkeypatch.setattr(vitscope, "load_model", load_model)
    monkeypatch.setattr("vitscope.models.load_model", load_model)
    return tmp_path


def test_readme_has_the_blocks_this_test_runs():
    assert len(blocks("python")) >= 1
    cmds = commands()
    assert [c for c in NOT_RUN if c not in cmds] == []  # every exemption is still a README line
    assert sum(c.startswith("vitscope ") for c in cmds) >= 8


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_readme_python_block_runs(i, offline):
    code = blocks("python")[i]
    ns: dict = {}
    exec(compile(code, f"README.md python block {i}", "exec"), ns)
    if "feats" in ns:  # the Use block: what its comments promise
        assert set(ns["feats"]) == {"block3.out", "block3.attn"}
        assert ns["feats"]["block3.out"].shape[0] == 4
        # 4 images: the unbiased estimator is finite but not bounded to [0, 1]; a representation with itself is 1
        assert np.isfinite(vitscope.cka(ns["feats"]["block3.out"], ns["feats2"]))
        assert vitscope.cka(ns["feats"]["block3.out"], ns["feats"]["block3.out"]) == pytest.approx(1.0, abs=1e-6)


STUDY = """models:
  - {name: vit_small_patch16_224, label: a, pretrained: false,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
  - {name: zoo-dino}
dataset: {name: synthetic-shapes, n_images: 16}
analyses: {attention_distance: {}, cka: {batch_size: 8}}
progress: false
"""


def test_readme_commands_run(offline, capsys):
    """Each `vitscope` line of the README, in order, on a tiny study of our own for `study.yaml`; RUN_DIR is
    that study's output."""
    (offline / "study.yaml").write_text(STUDY)
    run_dir = "vitscope-runs/study"
    ran = 0
    for cmd in commands():
        if cmd in NOT_RUN:
            continue
        argv = shlex.split(cmd.replace("RUN_DIR", run_dir))
        assert argv[0] == "vitscope", cmd
        assert main(argv[1:]) == 0, cmd
        ran += 1
    out = capsys.readouterr().out
    assert ran == len(commands()) - len(NOT_RUN) >= 7
    assert "dino-b16" in out and "block11.attn" in out and "semantics" in out  # models, taps, analyses
    assert (offline / run_dir / "report.html").is_file()


@pytest.mark.slow
def test_readme_default_study(tmp_path, monkeypatch, capsys):
    """The first command's `vitscope run`: the embedded default study, offline, to its report."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "-q"]) == 0
    assert "report.html" in capsys.readouterr().out
    assert (tmp_path / "vitscope-runs" / "default" / "report.html").is_file()
