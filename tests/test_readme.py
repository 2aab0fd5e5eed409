"""The README's code blocks run as written: every ```python block is executed, and every `vitscope ...` line of
its ```bash blocks goes through the command line, with network-free stand-ins only where the README names
things this machine cannot have (hub weights, the user's photos and checkpoint, their study file)."""

import ast
import re
import shlex
import warnings
from pathlib import Path

import matplotlib.figure
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

import vitscope
from vitscope.cli import main
from vitscope.errors import ResultWarning

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
    "vitscope findings RUN_DIR": "needs two contrastive models and a MIM one; the README study has one "
                                 "(tests/test_findings.py runs it on a study of its own)",
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


#: what each statement of the README's python blocks gives, as its comment documents it: a value's type, or
#: a check of it (a statement missing here fails the test: document its type here too)
DOCUMENTED = {
    "m = vs.load_model(": vitscope.ViTModel,
    "m2 = vs.load_model(": vitscope.ViTModel,
    "m.taps": lambda v: isinstance(v, list) and "block3.attn" in v and "block3.out" in v,
    "images = ": list,
    "feats = vs.extract(": lambda v: set(v) == {"block3.out", "block3.attn"} and v["block3.out"].shape[0] == 4,
    "feats2 = vs.extract(": lambda v: isinstance(v, dict) and all(isinstance(t, torch.Tensor) for t in v.values()),
    "vs.cka(": float,
    "vs.metrics.attention.attention_distance(": torch.Tensor,
    "fig = vs.plot(": matplotlib.figure.Figure,
    "fig.get_label()": lambda v: isinstance(v, str) and len(v) > 10,
    "df = pd.read_parquet(": pd.DataFrame,
}


def _statements(code: str) -> list[tuple[str, ast.stmt]]:
    return [(ast.get_source_segment(code, node), node) for node in ast.parse(code).body]


def _documented(text: str) -> object:
    keys = [k for k in DOCUMENTED if text.startswith(k)]
    assert len(keys) == 1, f"README statement without a documented type in test_readme.DOCUMENTED: {text!r}"
    return DOCUMENTED[keys[0]]


def _check(expected: object, value: object) -> bool:
    return isinstance(value, expected) if isinstance(expected, type) else bool(expected(value))


@pytest.fixture
def run_dir(offline):
    """RUN_DIR of the README's python blocks: a tiny study run here (its models: `a` and zoo-dino)."""
    (offline / "study.yaml").write_text(STUDY)
    assert main(["-q", "run", "study.yaml"]) == 0
    return "vitscope-runs/study"


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_readme_python_block_runs_and_gives_what_it_documents(i, offline, request):
    """Each statement in turn; each value (an expression's, or what an assignment binds) is of the type its
    comment documents. The CKA of 4 images warns that it is mostly noise, as the comment says."""
    code = blocks("python")[i]
    ns: dict = {"RUN_DIR": request.getfixturevalue("run_dir")} if "RUN_DIR" in code else {}
    checked = 0
    for text, node in _statements(code):
        if isinstance(node, ast.Import | ast.ImportFrom):
            exec(compile(ast.Module([node], []), f"README.md python block {i}", "exec"), ns)
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if isinstance(node, ast.Expr):
                value = eval(compile(ast.Expression(node.value), f"README.md python block {i}", "eval"), ns)
            else:
                assert isinstance(node, ast.Assign) and len(node.targets) == 1, text
                exec(compile(ast.Module([node], []), f"README.md python block {i}", "exec"), ns)
                value = ns[node.targets[0].id]
        assert _check(_documented(text), value), (text, type(value))
        checked += 1
        if text.startswith("vs.cka("):  # 4 images: warned, and the value may fall outside [0, 1]
            assert any(issubclass(w.category, ResultWarning) and "variance" in str(w.message) for w in caught)
    assert checked >= 3
    if "feats" in ns:  # the Use block: a representation with itself is 1 whatever the number of images
        with pytest.warns(ResultWarning):
            assert np.isfinite(vitscope.cka(ns["feats"]["block3.out"], ns["feats2"]))
        with pytest.warns(ResultWarning):
            assert vitscope.cka(ns["feats"]["block3.out"], ns["feats"]["block3.out"]) == pytest.approx(1.0, abs=1e-6)
    plt.close("all")


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
