"""The tap names and their hooks live in `vitscope.models.taps` (what a model exposes, read by `ViTModel`, below
the engine that captures them); this module keeps the old import path."""

from vitscope.models.taps import (  # noqa: F401
    BLOCK_TAPS,
    GLOBAL_TAPS,
    Getter,
    HookPoint,
    check_taps,
    expand_taps,
    hook_point,
    parse_tap,
    tap_names,
)
