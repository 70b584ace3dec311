"""``precision="64-true"`` with a strategy instance (``MatrixFSDPStrategy(...)``, ``MatrixFSDPFabricStrategy(...)``).

Lightning's connectors refuse ``64-true`` for every ``ModelParallelStrategy``, our base class:
the Trainer's when the strategy is given as an instance (its check looks at the object the user
passed; the registered name ``"matrix_fsdp"`` never met it), Fabric's for the name too (its check
looks at the strategy built). Their reason is ``ModelParallelStrategy``'s own sharding (FSDP2 and
DTensor), which this package replaces: the owner-sharded runtime reduces, steps and checkpoints
float64 as it does float32 (``tests/test_callbacks_walk.py``: bitwise DDP's float64 training).

:func:`install_double_precision` (run when the package is imported) lets the connectors accept
``64-true`` for a strategy that says it serves it (``serves_double_precision``, set on the
strategies' shared mixin) and hand it Lightning's own ``DoublePrecision`` plugin, exactly what they
give DDP. Every other strategy and precision takes Lightning's path unchanged. Where the connector
methods wrapped here are missing (another Lightning version) nothing is wrapped and Lightning's
refusal stands (docs/user-guide.md, "Precision", says to use ``strategy="matrix_fsdp"`` then).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["install_double_precision", "serves_double"]

_DOUBLE = "64-true"


def serves_double(strategy: Any) -> bool:
    """Whether ``strategy`` (an instance) trains in float64 under ``precision="64-true"``."""
    return bool(getattr(strategy, "serves_double_precision", False))


def _trainer_validation(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """The Trainer connector's ``_validate_precision_choice``, which lets ``64-true`` through for a
    strategy instance that serves it (its other checks run as before)."""
    @functools.wraps(original)
    def validate(self: Any) -> None:
        if not (serves_double(self._strategy_flag) and self._precision_flag == _DOUBLE):
            return original(self)
        self._precision_flag = "32-true"  # the one value its model-parallel check would refuse
        try:
            original(self)
        finally:
            self._precision_flag = _DOUBLE  # DoublePrecision() is chosen from it next
    validate.serves_double_precision = True  # type: ignore[attr-defined]
    return validate


def _fabric_precision(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Fabric's connector ``_check_and_init_precision``, which gives a strategy that serves ``64-true``
    Lightning's ``DoublePrecision`` where it would refuse it (a precision plugin given as such: unchanged)."""
    @functools.wraps(original)
    def choose(self: Any) -> Any:
        if serves_double(self.strategy) and self._precision_input == _DOUBLE and self._precision_instance is None:
            from lightning.fabric.plugins.precision import DoublePrecision

            return DoublePrecision()
        return original(self)
    choose.serves_double_precision = True  # type: ignore[attr-defined]
    return choose


def install_double_precision() -> None:
    """Let ``Trainer(..., precision="64-true")`` and ``Fabric(..., precision="64-true")`` accept this
    package's strategies (module docstring). Idempotent."""
    from lightning.fabric import connector as fabric_connector
    from lightning.pytorch.trainer.connectors import accelerator_connector as trainer_connector

    for cls, name, wrap in ((getattr(trainer_connector, "_AcceleratorConnector", None), "_validate_precision_choice",
                             _trainer_validation),
                            (getattr(fabric_connector, "_Connector", None), "_check_and_init_precision",
                             _fabric_precision)):
        original = getattr(cls, name, None) if cls is not None else None
        if callable(original) and not getattr(original, "serves_double_precision", False):
            setattr(cls, name, wrap(original))
