"""The study's models, each loaded once and released when no later stage needs them (`ModelPool`: at most the
model in its pass and the other model of a pair stage that follows it); an ablated variant with its write-hooks.
"""

from __future__ import annotations

from typing import Any

from vitscope.models import load_model
from vitscope.study.config import StudyConfig
from vitscope.study.keys import Source, first_images, statistics_dataset
from vitscope.study.plan import Plan, label_of


class ModelPool:
    """Models loaded once per study, released when no later stage needs them (at most the model in its pass
    and the other model of a pair stage that follows it)."""

    def __init__(self, cfg: StudyConfig, plan: Plan, sources: dict[str, Source] | None = None):
        self.cfg = cfg
        self.sources = sources or {}
        self.by_label = {label_of(m): m for m in plan.models}
        order = [label_of(m) for m in plan.models]
        self.last_use = {lab: i for i, lab in enumerate(order)}
        for ap in plan.analyses:  # a pair stage runs after the later of its two models' passes
            for a, b in ap.pairs:
                later = max(order.index(a), order.index(b))
                for x in (a, b):
                    self.last_use[x] = max(self.last_use[x], later)
        self.order = order
        self.loaded: dict[str, Any] = {}

    def get(self, label: str) -> Any:
        if label not in self.loaded:
            mc = self.by_label[label]
            vm = load_model(mc.name, weights=mc.weights, pretrained=mc.pretrained,
                            checkpoint_format=mc.checkpoint_format, seed=mc.seed, device=self.cfg.device,
                            decoder=mc.decoder, **mc.kwargs)
            vm.name = label
            if mc.ablate is not None:  # an ablated variant: its write-hooks, after the statistics pass
                vm.ablation = self._ablation(mc, vm)
            self.loaded[label] = vm
        return self.loaded[label]

    def _ablation(self, mc: Any, vm: Any) -> Any:
        from vitscope.models.ablation import parse_spec, resolve

        spec = parse_spec(mc.ablate, f"model {label_of(mc)!r}: ablate")
        first = None
        if spec.needs_statistics:
            src = self.sources[statistics_dataset(spec, self.sources)]
            first = first_images(src, vm.preprocessing, self.cfg.batch_size)
        ablation = resolve(vm, spec, first, f"model {label_of(mc)!r}")
        if not ablation.heads and not ablation.mlp:
            import warnings

            from vitscope.errors import ResultWarning

            warnings.warn(f"model {label_of(mc)!r}: the ablation {spec.describe()} resolves to no head of this "
                          "model, so the variant is the clean model", ResultWarning, stacklevel=2)
        return ablation.install(vm)

    def _release(self, label: str) -> None:
        vm = self.loaded.pop(label)
        ablation = getattr(vm, "ablation", None)
        if ablation is not None:  # the hooks off: the model object as loaded
            ablation.remove()

    def done_with(self, label: str) -> None:
        now = self.order.index(label)
        for lab in list(self.loaded):
            if self.last_use[lab] <= now:
                self._release(lab)

    def clear(self) -> None:
        for lab in list(self.loaded):
            self._release(lab)
