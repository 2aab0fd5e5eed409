"""Run a study: every model once over the dataset, every analysis fed from that one pass.

Layout of a run directory:
  results/<analysis>.parquet   tidy tables (model, analysis, metric, layer, head, token_view, value, ...)
  state/<model>.pt             accumulator states + the key they were computed under (resume/cache)
  manifest.json                config, versions, model digests, load reports, timings
  report.html                  self-contained report
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from vitscope.analyses import Analysis, get_analysis
from vitscope.capture import stream
from vitscope.data import make_dataset
from vitscope.models import load_model
from vitscope.study.config import StudyConfig, to_yaml

log = logging.getLogger(__name__)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _key(*parts: Any) -> str:
    from vitscope import __version__

    blob = json.dumps([__version__, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def run_study(cfg: StudyConfig) -> Path:
    out = Path(cfg.output_dir)
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "state").mkdir(exist_ok=True)
    torch.manual_seed(cfg.seed)
    dataset = make_dataset(cfg.dataset)
    frames: dict[str, list[pd.DataFrame]] = defaultdict(list)
    by_analysis: dict[str, list[Analysis]] = defaultdict(list)
    manifest: dict[str, Any] = {
        "config": asdict(cfg), "versions": _versions(), "dataset": {"name": dataset.name, "n_images": len(dataset)},
        "models": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for mc in cfg.models:
        label = mc.label or mc.name
        t0 = time.perf_counter()
        vm = load_model(mc.name, weights=mc.weights, pretrained=mc.pretrained,
                        checkpoint_format=mc.checkpoint_format, seed=mc.seed, device=cfg.device, **mc.kwargs)
        vm.name = label
        analyses = [get_analysis(n)(vm, **(p or {})) for n, p in cfg.analyses.items()]
        key = _key(vm.weights_digest, asdict(cfg.dataset), cfg.batch_size, cfg.dtype,
                   sorted((n, p) for n, p in cfg.analyses.items()))
        state_file = out / "state" / f"{label.replace('/', '_')}.pt"
        cached = False
        if state_file.is_file():
            saved = torch.load(state_file, map_location="cpu", weights_only=False)
            if saved.get("key") == key:
                for a in analyses:
                    a.load_state_dict(saved["analyses"][a.name])
                cached = True
        if not cached:
            n_batches = -(-len(dataset) // cfg.batch_size)
            stream(vm, dataset.batches(cfg.batch_size, vm.preprocessing), analyses, dtype=cfg.dtype,
                   progress=cfg.progress, total=n_batches)
            _atomic_save({"key": key, "analyses": {a.name: a.state_dict() for a in analyses}}, state_file)
        for a in analyses:
            frames[a.name].append(a.finalize())
            by_analysis[a.name].append(a)
        manifest["models"][label] = {
            "source": mc.name, "weights_digest": vm.weights_digest, "family": vm.family,
            "depth": vm.depth, "heads": vm.num_heads, "grid": vm.grid_size, "patch": vm.patch_size,
            "prefix_tokens": vm.num_prefix_tokens, "from_cache": cached,
            "load_report": vm.load_report.summary() if vm.load_report else "random initialisation",
            "seconds": round(time.perf_counter() - t0, 2),
        }
        del vm
    for name, group in by_analysis.items():
        cross = type(group[0]).cross(group)
        if cross is not None and len(cross):
            frames[name].append(cross)
    for name, parts in frames.items():
        df = pd.concat([p for p in parts if len(p)], ignore_index=True) if any(len(p) for p in parts) \
            else parts[0]
        df.to_parquet(out / "results" / f"{name}.parquet", index=False)
    manifest["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    (out / "config.yaml").write_text(to_yaml(cfg))
    from vitscope.report import write_report

    write_report(out)
    return out


def _versions() -> dict[str, str]:
    import timm

    from vitscope import __version__

    return {"vitscope": __version__, "torch": torch.__version__, "timm": timm.__version__,
            "python": platform.python_version()}
