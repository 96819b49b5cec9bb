"""An exponential moving average of the trained weights (`distill.ema_decay`): evaluated, kept and exported in place
of the last step's weights, which carry the noise of the last few batches."""
from __future__ import annotations

from contextlib import contextmanager

import torch


class WeightAverage:
    """avg ← decay · avg + (1 − decay) · w after every optimizer step, over the trained parameters only (the frozen
    head rows and the target never change). A checkpointable object: accelerate saves and restores its state."""

    def __init__(self, parameters: list[torch.nn.Parameter], decay: float):
        self.parameters = parameters
        self.decay = decay
        self.average = [p.detach().clone() for p in parameters]

    @torch.no_grad()
    def update(self) -> None:
        for avg, p in zip(self.average, self.parameters):
            avg.lerp_(p.detach(), 1.0 - self.decay)

    @contextmanager
    @torch.no_grad()
    def applied(self):
        """The parameters hold the average inside the block (to evaluate or save it), the trained weights after."""
        trained = [p.detach().clone() for p in self.parameters]
        for avg, p in zip(self.average, self.parameters):
            p.copy_(avg)
        try:
            yield
        finally:
            for w, p in zip(trained, self.parameters):
                p.copy_(w)

    def state_dict(self) -> dict:
        return {"average": self.average}

    def load_state_dict(self, state: dict) -> None:
        for avg, saved in zip(self.average, state["average"]):
            avg.copy_(saved)
