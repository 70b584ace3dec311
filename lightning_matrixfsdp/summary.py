"""Model summary with true global parameter counts.

Lightning's summary counts local ``numel``; owner placeholders are empty, so it
would under-report on every rank but the owners.  Counts here come from the
placement metadata (the global shape) of each resident parameter.
"""

from __future__ import annotations

from collections import OrderedDict

from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary

from lightning_matrixfsdp.runtime.tags import global_numel


class MatrixFSDPLayerSummary(LayerSummary):
    @property
    def num_parameters(self) -> int:
        return sum(global_numel(p) for p in self._module.parameters())


class MatrixFSDPSummary(ModelSummary):
    def summarize(self) -> "OrderedDict[str, LayerSummary]":  # type: ignore[override]
        summary = OrderedDict((name, MatrixFSDPLayerSummary(module)) for name, module in self.named_modules)
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[k]
        return summary

    @property
    def total_parameters(self) -> int:
        return sum(global_numel(p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(global_numel(p) for p in self._model.parameters() if p.requires_grad)
