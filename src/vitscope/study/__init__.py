"""Studies: config, the run loop, caching and the cross-model stage. The names are imported on first use, so a
config error is reported before the run loop (torch, timm) is imported."""

from vitscope._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "StudyConfig": "vitscope.study.config", "load_config": "vitscope.study.config", "run_study": "vitscope.study.run",
})

__all__ = ["StudyConfig", "load_config", "run_study"]
