"""Studies: config, the run loop, caching and the cross-model stage."""

from vitscope.study.config import StudyConfig, load_config
from vitscope.study.run import run_study

__all__ = ["StudyConfig", "load_config", "run_study"]
