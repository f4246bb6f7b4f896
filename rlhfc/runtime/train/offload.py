"""An optimizer kept on the host: float32 master weights, Adam's moments and the AdamW step in host memory, the
device holding the weights and their gradients only (the ``offload`` pass; ZeRO-Offload's split).

:class:`HostAdamW` is a ``torch.optim.AdamW`` over host copies of a model's parameters. Before each step (a
step pre-hook registered first, so the job's finite-gradient guard sees the gradients) every device gradient
is copied to its host master; after it, each updated master is copied back into the device parameter. Its
state and ``state_dict`` are AdamW's over the masters, in the parameters' order, so checkpoints keep their
form; :meth:`HostAdamW.device_param` maps a master back to the parameter it shadows (the megatron backend names
its state by parameter). The arithmetic is AdamW's in float32 on the host's copies: on a CPU device with float32
weights the result is bitwise that of AdamW on the parameters themselves (tests/runtime/test_offload.py).

The fsdp trainer does not use it: FSDP2 shards and offloads itself (``CPUOffloadPolicy``: parameters,
gradients and the optimizer step on the host), see :mod:`rlhfc.runtime.train.fsdp`. The masters are taken
when the optimizer is built (the first train call, or a checkpoint's load after its weights): weights
changed on the device in between by anything but this optimizer would be overwritten by its next step.
"""

from __future__ import annotations

import torch


class HostAdamW(torch.optim.AdamW):
    """AdamW whose masters and state live on the host (see the module docstring)."""

    def __init__(self, params, **kwargs):
        self.device_params = [p for p in params]
        masters = [p.detach().to("cpu", torch.float32).clone() for p in self.device_params]
        super().__init__(masters, **kwargs)
        self._device_of = {id(m): p for m, p in zip(masters, self.device_params)}
        self.register_step_pre_hook(lambda opt, args, kwargs: opt._to_host())
        self.register_step_post_hook(lambda opt, args, kwargs: opt._to_device())

    def device_param(self, master: torch.Tensor) -> torch.Tensor:
        """The device parameter a host master shadows (itself when it is not one of this optimizer's)."""
        return self._device_of.get(id(master), master)

    @torch.no_grad()
    def _to_host(self) -> None:
        for m, p in self._pairs():
            m.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32)

    @torch.no_grad()
    def _to_device(self) -> None:
        for m, p in self._pairs():
            if p.grad is not None:
                p.copy_(m.to(p.device, p.dtype))

    def _pairs(self):
        return [(m, self._device_of[id(m)]) for g in self.param_groups for m in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.device_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
