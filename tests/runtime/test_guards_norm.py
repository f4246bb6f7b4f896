"""A gradient whose entries are finite but whose norm overflows float32 stops the step (clipping would
otherwise scale it to zero and the optimizer would step on nothing, silently)."""

import pytest
import torch

from rlhfc.runtime.rl.guards import NonFiniteError
from rlhfc.runtime.train import loop


def test_overflowing_gradient_norm_stops_before_the_step():
    w = torch.nn.Parameter(torch.zeros(4))
    model = torch.nn.Module()
    model.w = w
    opt = loop.make_optimizer(model, lr=0.1)
    batch = {"x": torch.ones(2, 4), "response_mask": torch.ones(2, 4)}

    def loss_fn(m, mb):   # d loss / d w = 3e38 per entry: finite entries, an infinite norm
        return (m.w * mb["x"]).sum() * 1.5e38, {}

    with pytest.raises(NonFiniteError, match="gradient norm is inf"):
        loop.train_epochs(model, opt, batch, loss_fn, max_grad_norm=1.0)
    assert torch.equal(w.detach(), torch.zeros(4))   # no step was taken
