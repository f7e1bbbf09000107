"""fp16 loss scaling with DeepSpeed's semantics (``fp16.loss_scale``, ``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``min_loss_scale``).

Dynamic scaling (``loss_scale`` 0): the loss is multiplied by the current scale before backward; a step whose
gradients overflow (inf/nan anywhere on any rank) is skipped. An overflow lowers the scale by 2x once
``hysteresis`` overflows have been absorbed since the last good window; every ``loss_scale_window``
consecutive good steps raise it by 2x and restore the hysteresis. A static ``loss_scale`` never changes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    """The current loss scale and the state that moves it. ``dynamic=False`` keeps ``scale`` fixed."""

    scale: float
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    _hysteresis_left: int = 0
    _good_steps: int = 0

    def __post_init__(self) -> None:
        self._hysteresis_left = self.hysteresis

    @classmethod
    def from_config(cls, loss_scale: float, initial_scale_power: int, window: int, hysteresis: int,
                    min_scale: float) -> "LossScaler":
        if loss_scale > 0:
            return cls(scale=float(loss_scale), dynamic=False)
        return cls(scale=float(2**initial_scale_power), window=window, hysteresis=hysteresis,
                   min_scale=float(min_scale))

    def update(self, overflow: bool) -> None:
        """Move the scale after a step (``overflow``: that step's gradients were not finite)."""
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._hysteresis_left -= 1
            return
        self._good_steps += 1
        if self._good_steps % self.window == 0:
            self.scale *= 2
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._good_steps = int(state["good_steps"])
