"""A user-written outer optimizer that swarms in the tests name in their spec
(`optimizer = "py:<this file>:OuterSGD"`): outer SGD without momentum, docs/guide.md's example."""

from __future__ import annotations

import meshtrain


class OuterSGD(meshtrain.OuterOptimizer):
    """Outer SGD without momentum: φ ← φ − lr · mean Δ."""

    def __init__(self, model, inner, collective, *, H, lr=1.0):
        super().__init__(model, inner, collective, H=H)
        self.lr = lr

    @classmethod
    def from_spec(cls, model, inner, collective, spec):
        return cls(model, inner, collective, H=spec.H, lr=spec.outer_lr)

    def apply(self, result, names):
        for n in names:
            self.outer_params[n].sub_(result.tensors[n], alpha=self.lr)
