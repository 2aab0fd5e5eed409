"""One training loop for every objective of the zoo: same optimiser, same schedule, same budget.

  * budget: a number of image-views (`ZOO_BUDGET_VIEWS`; a view weighs its pixels relative to a full
    32-px view, see `vitscope.zoo.data`); steps = ceil(budget / (batch size x views per image));
    an "epoch" is ``epoch_views`` image-views (default: one per training image, i.e. 50,000 on
    CIFAR-10), so every objective is logged and checkpointed at the same numbers of views;
  * optimiser: AdamW (lr 5e-4 at batch 128, betas 0.9/0.95, weight decay 0.05 on weights only, not on
    biases, norms, tokens and position embeddings), gradient clipping at norm 3, linear warmup over the
    first 10% of the steps then cosine to 1e-6 (the recipe of DeiT / MAE / MoCo v3 / DINO, one setting
    for all);
  * determinism: network init from ``seed``; step s reads only (seed, s) (`vitscope.zoo.data.ViewStream`);
    the same seed gives the same weights, bit for bit, on the same machine and thread count;
  * resume: ``train_state.pt`` (objective incl. teachers and centres, optimiser, scheduler, RNG states,
    step, running epoch sums, log rows, wall time) is written atomically at every epoch end and every
    ``ckpt_minutes``; ``resume=True`` continues from it bit-identically;
  * log: ``log.csv`` beside the weights, one row per epoch (epoch 0 = the initialisation): mean loss,
    objective metrics, lr, views/s, and weighted 20-NN accuracy (`vitscope.zoo.knn`) on CLS and GAP;
  * export: ``encoder.safetensors`` via `vitscope.models.save_checkpoint(half=True)` (so
    ``vitscope.load_model(path)`` rebuilds it) and ``card.json``; optionally the encoder at chosen
    epochs under ``checkpoints/`` (fine-tuning dynamics);
  * device: ``TrainConfig.device`` (cpu, cuda, cuda:N) holds the objective (encoder, heads, teachers, momentum
    encoders), the views of each step and the k-NN monitor; the views and the masks are still drawn on the CPU
    from the step's generator, so every device sees the same images, crops and masks. The training state is
    written with CPU tensors and resumes onto any device (not bit for bit across devices: their arithmetic
    differs); ``device`` is not a setting that determines the weights (`_IDENTITY`).
  * the zoo's recipes (`zoo_recipes`): the six objectives and the fine-tune of zoo-random for classification
    with the shipped models' settings, at the ``default`` or the ``long`` budget (`ZOO_LONG_FACTOR` times it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitscope.errors import VitscopeError, first_line
from vitscope.host import moved
from vitscope.zoo.arch import ZOO_ARCH, ZooArch
from vitscope.zoo.base import Objective
from vitscope.zoo.data import Augment, DataSource, ViewBatch, ViewStream, load_data
from vitscope.zoo.knn import KNNMonitor
from vitscope.zoo.objectives import OBJECTIVES, build_objective

log = logging.getLogger(__name__)

ZOO_BATCH_SIZE = 128
# The common budget (docs/ZOO.md): every run must end within the session that starts it (no training state
# survives between sessions here). At 250,000 image-views the round-3 runs took 26-59 min of wall time each, on
# one thread of the 2-core machine shared by two to five runs and evaluations (their cards), so the six
# objectives fit one session; idle, one thread runs a supervised step of 128 images in 0.73 s
# (benchmarks/zoo_throughput.py --threads 1), 24 CPU-minutes for this budget.
ZOO_BUDGET_VIEWS = 250_000
# The shipped fine-tunes (zoo-*-ft-*, docs/ZOO.md and docs/INVARIANCE.md): 8 epochs of 10,000 image-views.
FINETUNE_BUDGET_VIEWS = 80_000
FINETUNE_EPOCHS = 8
ZOO_EPOCHS = 10  # the six objectives' shipped runs log 10 epochs (of 25,000 image-views)
# The named long budget (`--budget long`): this many times the shipped budget of each run.
ZOO_LONG_FACTOR = 20
BUDGETS = ("default", "long")
ZOO_OBJECTIVES = tuple(n for n in OBJECTIVES if n != "finetune")  # the six the zoo trains from scratch

STATE_FILE = "train_state.pt"
WEIGHTS_FILE = "encoder.safetensors"
CARD_FILE = "card.json"
LOG_FILE = "log.csv"
DECODER_FILE = "decoder.safetensors"  # a masked-modelling objective's decoder, for its held-out loss (zoo/evaluate.py)

# Settings that determine the weights: a resumed run must match them. Not ``device``: a run stopped on one device
# may be continued on another (the arithmetic differs, so the result is not bit for bit that of one device; the
# card lists the devices in ``devices``).
_IDENTITY = ("objective", "objective_kwargs", "arch", "budget_views", "epochs", "epoch_views", "batch_size", "lr",
             "min_lr", "weight_decay", "betas", "warmup_frac", "clip_grad", "seed", "synthetic_n", "precision",
             "adamw")

PRECISIONS = ("fp32", "bf16")  # bf16 = autocast of the forward (matmuls) to bfloat16; weights, AdamW, losses fp32
ADAMW_IMPLS = ("default", "foreach", "fused")  # torch's AdamW implementations (same update, other kernels)


@dataclass
class TrainConfig:
    """Everything a zoo run needs. ``data``: CIFAR-10 ImageFolder root, 'synthetic', or None (auto)."""

    objective: str
    out: str | Path
    data: str | None = None
    budget_views: int | None = None
    epochs: float | None = None
    epoch_views: int | None = None
    batch_size: int = ZOO_BATCH_SIZE
    lr: float = 5e-4
    min_lr: float = 1e-6
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_frac: float = 0.1
    clip_grad: float | None = 3.0
    seed: int = 0
    precision: str = "fp32"
    adamw: str = "default"
    arch: dict[str, Any] = field(default_factory=lambda: asdict(ZOO_ARCH))
    objective_kwargs: dict[str, Any] = field(default_factory=dict)
    knn_every: int = 1
    knn_train: int = 5000
    knn_test: int = 2000
    knn_k: int = 20
    knn_per_block: bool = True  # also the best block's k-NN and the smallest per-block attention distance
    ckpt_minutes: float = 10.0
    save_epochs: str | list[int] = "auto"
    synthetic_n: tuple[int, int] = (5000, 1000)
    progress: bool = True
    device: str = "cpu"  # cpu, cuda, cuda:N (`resolve_device`)

    def identity(self) -> dict[str, Any]:
        d = asdict(self)
        return json.loads(json.dumps({k: d[k] for k in _IDENTITY}, default=str))


@dataclass
class Plan:
    """Steps and epochs of a run, from the budget."""

    budget_views: int
    views_per_image: float
    views_per_step: float
    total_steps: int
    epoch_views: int
    epoch_end: dict[int, int]  # last step (exclusive) -> epoch number

    @property
    def n_epochs(self) -> int:
        return max(self.epoch_end.values())


def budget_views(budget: str, objective: str) -> int:
    """Image-views of a named budget: ``default`` is the shipped models' (`ZOO_BUDGET_VIEWS` for the six
    objectives, `FINETUNE_BUDGET_VIEWS` for a fine-tune), ``long`` `ZOO_LONG_FACTOR` times it."""
    if budget not in BUDGETS:
        raise VitscopeError(f"the budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
    base = FINETUNE_BUDGET_VIEWS if objective == "finetune" else ZOO_BUDGET_VIEWS
    return base * (ZOO_LONG_FACTOR if budget == "long" else 1)


def zoo_recipes(out: str | Path, budget: str = "default", views: int | None = None
                ) -> list[tuple[str, dict[str, Any]]]:
    """The runs of the zoo, in training order, as (label, `TrainConfig` fields): the six objectives into
    ``out/<objective>`` and the fine-tune of zoo-random for classification into ``out/finetune-cls``, each with
    its shipped model's settings (10 logged epochs and the 20-NN monitor every 2 of them on 5,000 /
    2,000 images for the six; 8 epochs, every epoch's encoder kept, the monitor every 4 on 2,000 / 1,000 images
    for the fine-tune) at the named ``budget`` (`budget_views`), or at ``views`` image-views each when given.
    An epoch is the budget over the run's number of epochs, so at the default budget it is the shipped one
    (25,000 and 10,000 image-views) and the logs and per-epoch encoders of a longer run fall at the same
    fractions of its schedule."""
    runs: list[tuple[str, dict[str, Any]]] = []
    for name in (*ZOO_OBJECTIVES, "finetune"):
        ft = name == "finetune"
        b = int(views) if views is not None else budget_views(budget, name)
        n_epochs = FINETUNE_EPOCHS if ft else ZOO_EPOCHS
        label = "finetune-cls" if ft else name
        fields: dict[str, Any] = {
            "objective": name, "out": Path(out) / label, "budget_views": b,
            "epoch_views": max(1, int(math.ceil(b / n_epochs))),
            "knn_every": 4 if ft else 2, "knn_train": 2000 if ft else 5000, "knn_test": 1000 if ft else 2000,
            "objective_kwargs": {"init": "zoo-random", "task": "classification"} if ft else {}}
        runs.append((label, fields))
    return runs


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device a run is asked to train on; one sentence when this machine does not have it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise VitscopeError(f"device {str(device)!r} is not a device torch knows; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise VitscopeError(f"device {str(device)!r}: the zoo trains on cpu or cuda (cuda:N), not {dev.type}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0 or (dev.index is not None and dev.index >= n):
        raise VitscopeError(f"device {str(device)!r} was asked for but this machine has {n} usable CUDA GPU(s); "
                            "use --device cpu" + (f" or cuda:0 to cuda:{n - 1}" if n else ""))
    return dev


def make_plan(cfg: TrainConfig, views_per_image: float, n_train: int) -> Plan:
    if cfg.budget_views is not None and cfg.epochs is not None:
        raise VitscopeError("give the budget either as image-views (budget_views) or as epochs, not both")
    epoch_views = int(cfg.epoch_views or n_train)
    if cfg.budget_views is not None:
        budget = int(cfg.budget_views)
    elif cfg.epochs is not None:
        budget = int(round(cfg.epochs * epoch_views))
    else:
        budget = ZOO_BUDGET_VIEWS
    vps = cfg.batch_size * views_per_image
    if budget < vps:
        raise VitscopeError(f"the budget ({budget} image-views) is less than one step ({vps:g} views)")
    total = int(math.ceil(budget / vps))
    n_epochs = int(math.ceil(budget / epoch_views))
    ends: dict[int, int] = {}
    for e in range(1, n_epochs + 1):
        ends[min(total, max(1, int(math.ceil(e * epoch_views / vps))))] = e
    return Plan(budget, views_per_image, vps, total, epoch_views, ends)


def lr_factor(step: int, total: int, warmup: int, floor: float) -> float:
    """Linear warmup over ``warmup`` steps, then half a cosine from 1 to ``floor``."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def param_groups(obj: Objective, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only (not biases, norms, tokens, position embeddings)."""
    decay, no_decay = [], []
    for name, p in obj.trainable_named_parameters():
        if p.ndim <= 1 or name.endswith(".bias") or "token" in name or "pos_embed" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(obj: Objective, cfg: TrainConfig, total_steps: int
                   ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its warmup + cosine schedule (stepped once per training step)."""
    if cfg.adamw not in ADAMW_IMPLS:
        raise VitscopeError(f"adamw must be one of {ADAMW_IMPLS}, got {cfg.adamw!r}")
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(cfg.adamw, {})
    opt = torch.optim.AdamW(param_groups(obj, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), **impl)
    warmup = max(1, int(round(cfg.warmup_frac * total_steps)))
    floor = cfg.min_lr / cfg.lr
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, warmup, floor))


def batch_to(batch: ViewBatch, device: torch.device) -> ViewBatch:
    """The views and labels of a step on ``device`` (the batch itself on the CPU); the generator stays on the CPU
    (the objectives draw their masks from it and move them to their views' device)."""
    if device.type == "cpu":
        return batch

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=t.is_pinned())

    return ViewBatch([to(v) for v in batch.global_views], [to(v) for v in batch.local_views], to(batch.labels),
                     batch.index, batch.generator, batch.image_views)


def train_step(obj: Objective, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               batch: ViewBatch, step: int, total: int, clip_grad: float | None, precision: str = "fp32"
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """One optimisation step of any objective: forward, backward, clip, AdamW, schedule, EMA.

    The forward runs on the device of the batch's views (`batch_to`; the objective must be there too).
    precision "bf16": the forward runs under autocast to bfloat16 on that device (matmuls and convolutions;
    the objectives compute their losses in fp32); parameters, gradients and AdamW's state stay fp32.
    """
    if precision not in PRECISIONS:
        raise VitscopeError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    device = batch.global_views[0].device
    obj.set_progress(step, total)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss, metrics = obj(batch)
    if not torch.isfinite(loss):
        raise VitscopeError(f"{obj.name}: the loss is {loss.item()} at step {step}; lower the learning rate")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    obj.before_optimizer_step(step, total)
    if clip_grad:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip_grad)
    opt.step()
    sched.step()
    obj.after_optimizer_step(step, total)
    return loss.detach(), metrics


def _save_epochs(cfg: TrainConfig, n_epochs: int) -> set[int]:
    s = cfg.save_epochs
    if s == "auto":
        return set(range(n_epochs + 1)) if cfg.objective == "finetune" else set()
    if s == "all":
        return set(range(n_epochs + 1))
    if s in ("none", "", None):
        return set()
    if isinstance(s, str):
        s = [int(x) for x in s.split(",") if x.strip()]
    return {int(x) for x in s}


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # numpy's key as a tensor: the state stays data
    return {"torch": torch.get_rng_state(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                      gauss), "python": random.getstate()}


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    kind, keys, *rest = s["numpy"]
    np.random.set_state((kind, np.asarray(keys.numpy() if isinstance(keys, torch.Tensor) else keys, np.uint32),
                         *rest))
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in s["python"]))


def load_state(path: Path) -> dict[str, Any]:
    """A training state, read as data (``weights_only``: tensors, numbers, strings, containers), so a planted file
    cannot run code; numpy arrays (numpy's RNG key in states written before it was stored as a tensor) are
    the one addition to the allow-list."""
    reconstruct = np.zeros(1).__reduce__()[0]
    allowed = [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype"),
               (type(np.dtype(np.uint32)), "numpy.dtypes.UInt32DType"),
               *((reconstruct, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core"))]
    from vitscope.models.torchfile import check_memory

    try:
        check_memory(path, quick=True)  # a pickle asking for more memory than the file holds is refused, not loaded
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - one sentence, not the unpickler's page of advice
        raise VitscopeError(f"cannot resume from {path}: it is not a training state vitscope wrote ({first_line(e)})"
                            ) from e


def _saved_identity(st: dict[str, Any]) -> dict[str, Any]:
    """A state's settings, with architecture fields added to `ZooArch` after the state was written filled in
    with their defaults (which is what such a run was built with: e.g. ``init='timm'``)."""
    conf = dict(st["config"])
    if isinstance(conf.get("arch"), dict):
        conf["arch"] = {**json.loads(json.dumps(asdict(ZooArch()), default=str)), **conf["arch"]}
    return conf


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{dev.type}:{dev.index if dev.index is not None else torch.cuda.current_device()} " \
               f"({torch.cuda.get_device_name(dev)})"
    return str(dev)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _write_log(rows: list[dict[str, Any]], path: Path) -> None:
    import pandas as pd

    tmp = path.with_name(path.name + ".tmp")
    pd.DataFrame(rows).to_csv(tmp, index=False)
    os.replace(tmp, path)


def export_spec(obj: Objective, cfg: TrainConfig, data: DataSource, views: float):  # noqa: ANN201 - ModelSpec
    from vitscope.models.registry import ModelSpec, WeightSource

    f = obj.export_fields()
    hp = obj.hparams()
    label = "-".join([cfg.objective] + [f"{k}{hp[k]}" for k in ("lam", "task") if k in hp])
    return ModelSpec(
        name=f"zoo-{label}-s{cfg.seed}", arch=f["arch"], family=f["family"], supervision=f["supervision"],
        weights=WeightSource("none"), preprocessing=obj.preprocessing, model_kwargs=obj.export_kwargs(),
        citation=f["citation"],
        notes=f"vitscope controlled zoo: {cfg.objective}, {int(views)} image-views of {data.description['name']}, "
              f"seed {cfg.seed}")


def train(cfg: TrainConfig, resume: bool = False, stop_after_steps: int | None = None,
          announce: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train (or continue) one zoo model; returns the card (also written to ``out/card.json``).

    stop_after_steps: stop after that many steps in all (writing the training state, no export), as an
        interruption would; used to test resuming.
    announce: called once with what happens to the run before any training: "done" (finished already),
        "resumed at step k of n" or "started (n steps)".
    """
    def say(what: str) -> None:
        if announce is not None:
            announce(what)

    t0 = time.monotonic()  # wall time counts everything: data decoding, evaluations, checkpoints
    dev = resolve_device(cfg.device)  # one sentence before any work when the machine lacks it
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    if state_path.exists() and not resume:
        raise VitscopeError(f"{out} already holds a training state; pass resume=True (--resume) to continue "
                            "it, or choose another output directory")
    written = [f for f in (CARD_FILE, LOG_FILE, WEIGHTS_FILE, DECODER_FILE) if (out / f).exists()]
    if written and not (resume and state_path.exists()):  # a run that is not resumed would replace them
        raise VitscopeError(f"{out} already holds {', '.join(written)} of another training run (no training state "
                            "to resume): choose another output directory, so that they are not replaced")
    if resume and state_path.exists() and (out / CARD_FILE).exists():  # finished already: nothing to load
        card = json.loads((out / CARD_FILE).read_text())
        st = load_state(state_path)
        if _saved_identity(st) == cfg.identity() and st["step"] >= card["budget"]["steps"]:
            say("done")
            return card
    arch = ZooArch(**cfg.arch)
    data = load_data(cfg.data, size=arch.img_size, synthetic_n=tuple(cfg.synthetic_n), seed=cfg.seed)
    obj = build_objective(cfg.objective, arch, num_classes=len(data.train.classes), seed=cfg.seed,
                          **cfg.objective_kwargs)  # initialised on the CPU: the same network on every device
    obj.to(dev)
    pre = obj.preprocessing
    augment = Augment(obj.views, obj.img_size, pre.mean, pre.std, obj.patch_size)
    stream = ViewStream(data.train, obj.views, cfg.batch_size, cfg.seed, augment)
    plan = make_plan(cfg, obj.views.views_per_image(), len(data.train))
    monitor = KNNMonitor(data, augment, cfg.knn_train, cfg.knn_test, cfg.knn_k)
    save_epochs = _save_epochs(cfg, plan.n_epochs)

    opt, sched = make_optimizer(obj, cfg, plan.total_steps)

    step, elapsed, rows = 0, 0.0, []
    devices = [_device_name(dev)]
    sums: dict[str, float] = {}
    count = 0
    if resume and state_path.exists():
        st = load_state(state_path)
        if _saved_identity(st) != cfg.identity():
            diff = sorted(k for k in st["config"] if _saved_identity(st)[k] != cfg.identity().get(k))
            raise VitscopeError(f"cannot resume {out}: the run was started with other settings ({', '.join(diff)})")
        same_data = ("name", "n_train", "n_test")
        if any(st["data"].get(k) != data.description.get(k) for k in same_data):
            raise VitscopeError(f"cannot resume {out}: it was trained on {st['data']}, not {data.description}")
        obj.load_state_dict(st["objective"])  # copied into the parameters, on their device
        opt.load_state_dict(st["optimizer"])  # torch moves AdamW's moments to their parameters' device
        sched.load_state_dict(st["scheduler"])
        _set_rng_state(st["rng"])
        step, elapsed, rows, sums, count = st["step"], st["elapsed"], st["rows"], st["sums"], st["count"]
        devices = list(st.get("devices", ["cpu"]))
        if devices[-1] != _device_name(dev):
            devices.append(_device_name(dev))
        log.info("resuming %s at step %d of %d", out, step, plan.total_steps)
        if step >= plan.total_steps and (out / CARD_FILE).exists():
            say("done")
            return json.loads((out / CARD_FILE).read_text())
        say(f"resumed at step {step:,} of {plan.total_steps:,}")
    else:
        say(f"started ({plan.total_steps:,} steps)")

    last_ckpt = time.monotonic()

    def wall() -> float:
        return elapsed + time.monotonic() - t0

    def save_state() -> None:
        nonlocal last_ckpt
        _atomic_torch_save({
            "config": cfg.identity(), "data": data.description, "objective": moved(obj.state_dict(), "cpu"),
            "optimizer": moved(opt.state_dict(), "cpu"), "scheduler": sched.state_dict(), "rng": _rng_state(),
            "step": step, "total_steps": plan.total_steps, "elapsed": wall(), "rows": rows, "sums": sums,
            "count": count, "devices": devices}, state_path)
        last_ckpt = time.monotonic()

    def export_epoch(e: int) -> None:
        from vitscope.models import save_checkpoint

        ck = out / "checkpoints"
        ck.mkdir(exist_ok=True)
        save_checkpoint(obj.export(), ck / f"encoder_epoch{e:03d}.safetensors",
                        export_spec(obj, cfg, data, step * plan.views_per_step), half=True)

    if step == 0 and not rows:
        rows.append({"epoch": 0, "step": 0, "image_views": 0, "wall_s": round(wall(), 1),
                     **monitor(obj.export(), cfg.knn_per_block)})
        _write_log(rows, out / LOG_FILE)
        if 0 in save_epochs:
            export_epoch(0)

    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.total_steps, initial=step, desc=f"zoo {cfg.objective}", unit="step", dynamic_ncols=True)
    epoch_t, epoch_step0 = time.monotonic(), step
    rate_t, rate_step = time.monotonic(), step
    obj.train()
    while step < plan.total_steps:
        if stop_after_steps is not None and step >= stop_after_steps:
            break
        loss, metrics = train_step(obj, opt, sched, batch_to(stream.batch(step), dev), step, plan.total_steps,
                                   cfg.clip_grad, cfg.precision)
        step += 1
        count += 1
        for k, v in {"loss": loss.item(), **metrics}.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        if bar is not None:
            bar.update(1)
            now = time.monotonic()
            if now - rate_t > 2.0 or step == plan.total_steps:
                img_s = (step - rate_step) * cfg.batch_size / max(now - rate_t, 1e-9)
                bar.set_postfix_str(f"loss {loss.item():.4f}, {img_s:.0f} img/s, "
                                    f"{img_s * plan.views_per_image:.0f} views/s")
                rate_t, rate_step = now, step
        if step in plan.epoch_end:
            e = plan.epoch_end[step]
            speed = (step - epoch_step0) * plan.views_per_step / max(time.monotonic() - epoch_t, 1e-9)
            row: dict[str, Any] = {"epoch": e, "step": step, "image_views": int(round(step * plan.views_per_step)),
                                   **{k: v / max(count, 1) for k, v in sums.items()},
                                   "lr": opt.param_groups[0]["lr"],
                                   "views_per_s": round(speed, 1)}
            if e % max(1, cfg.knn_every) == 0 or step == plan.total_steps:
                row.update(monitor(obj.export(), cfg.knn_per_block))
            row["wall_s"] = round(wall(), 1)
            rows.append(row)
            sums, count = {}, 0
            _write_log(rows, out / LOG_FILE)
            if e in save_epochs:
                export_epoch(e)
            save_state()
            epoch_t, epoch_step0 = time.monotonic(), step
        elif time.monotonic() - last_ckpt > cfg.ckpt_minutes * 60:
            save_state()
    if bar is not None:
        bar.close()
    if step < plan.total_steps:
        save_state()
        return {"status": "stopped", "step": step, "total_steps": plan.total_steps, "out": str(out)}
    return _finish(obj, cfg, data, plan, monitor, rows, wall(), out, devices)


def _finish(obj: Objective, cfg: TrainConfig, data: DataSource, plan: Plan, monitor: KNNMonitor,
            rows: list[dict[str, Any]], wall_s: float, out: Path, devices: list[str] | None = None
            ) -> dict[str, Any]:
    from vitscope.models import save_checkpoint

    views = plan.total_steps * plan.views_per_step
    spec = export_spec(obj, cfg, data, views)
    weights = save_checkpoint(obj.export(), out / WEIGHTS_FILE, spec, half=True)
    save_parts(obj, out)
    last = rows[-1] if rows else {}
    card = {
        "name": spec.name, "objective": cfg.objective, "family": spec.family, "supervision": spec.supervision,
        "citation": spec.citation, "hparams": obj.hparams(), "seed": cfg.seed,
        "arch": {"timm": spec.arch, **{k: v for k, v in spec.model_kwargs.items() if k != "pretrained_cfg_overlay"}},
        "zoo_arch": dict(cfg.arch),  # incl. what timm's kwargs do not say: initialisation and position embedding
        "data": data.description,
        "budget": {"image_views": plan.budget_views, "views_per_image": plan.views_per_image,
                   "batch_size": cfg.batch_size, "steps": plan.total_steps, "epochs": plan.n_epochs,
                   "epoch_views": plan.epoch_views},
        "image_views": int(round(views)),
        "precision": cfg.precision,
        "devices": devices or ["cpu"],  # where it was trained (more than one: resumed on another device)
        "optimizer": {"name": "AdamW", "implementation": cfg.adamw, "lr": cfg.lr, "min_lr": cfg.min_lr,
                      "betas": list(cfg.betas),
                      "weight_decay": cfg.weight_decay, "warmup_frac": cfg.warmup_frac, "clip_grad": cfg.clip_grad,
                      "schedule": "linear warmup + cosine"},
        "final_knn": {"k": cfg.knn_k, "cls": last.get("knn_cls"), "gap": last.get("knn_gap"),
                      "n_train": len(monitor.train_idx), "n_test": len(monitor.test_idx)},
        "wall_time_s": round(wall_s, 1),
        "log": str((out / LOG_FILE).resolve()),
        "weights": str(Path(weights).resolve()),
        "versions": {"torch": torch.__version__, "timm": _timm_version(), "threads": torch.get_num_threads()},
    }
    write_card(out, card)
    return card


def save_parts(obj: Objective, out: Path) -> Path | None:
    """``out/decoder.safetensors``: the objective's trained parts besides the encoder that its own evaluation needs
    (`Objective.parts`; masked modelling: the decoder), float32; None for an objective without such parts."""
    from safetensors.torch import save_file

    parts = obj.parts()
    if parts is None:
        return None
    tmp = out / (DECODER_FILE + ".tmp")
    save_file({k: v.detach().float().cpu().contiguous() for k, v in parts.state_dict().items()}, str(tmp))
    os.replace(tmp, out / DECODER_FILE)
    return out / DECODER_FILE


def write_card(out: Path, card: dict[str, Any]) -> None:
    """``out/card.json``, written atomically (temporary file renamed into place)."""
    tmp = out / (CARD_FILE + ".tmp")
    tmp.write_text(json.dumps(card, indent=2, default=str))
    os.replace(tmp, out / CARD_FILE)


def _timm_version() -> str:
    import timm

    return timm.__version__
