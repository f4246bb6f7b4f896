"""The ``offload`` pass's runtime (issue #40): a training worker whose optimizer state and step live on the
host trains exactly as one whose optimizer lives beside its weights — on the torch trainer
(:class:`~rlhfc.runtime.train.offload.HostAdamW`), the megatron trainer (the same, on its pieces) and the fsdp
trainer (FSDP2's ``CPUOffloadPolicy``, gloo ranks). On this CPU the host is the device, so the numbers must be
bitwise equal, through a checkpoint and its resume too; what offload saves on a GPU is priced by the cost
model (tests/cost/test_offload_pass.py), not measurable here."""

from __future__ import annotations

import pytest
import torch

from rlhfc.runtime.data.values import PolicyLossInput
from rlhfc.runtime.train.backend import open_store
from rlhfc.runtime.train.offload import HostAdamW
from rlhfc.runtime.worker.base import ModelWorker
from spawned import run_spawned   # tests/runtime/spawned.py

PROMPTS = ["abc", "hello there", "x", "the quick brown", "fox", "jumps over", "a lazy", "dog!"]
GEN = dict(max_new_tokens=8, temperature=1.0, top_p=1.0)
TRAIN = dict(lr=1e-2, epochs=1, minibatches=2, max_grad_norm=1.0, weight_decay=0.01)


def _loss(roll, seed: int) -> PolicyLossInput:
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(roll.mask.shape, generator=g) * roll.mask
    old = torch.randn(roll.mask.shape, generator=g) * 0.1 - 2.0
    return PolicyLossInput(roll, old, adv, None, clip=0.2, entropy_coef=0.01, kl_coef=0.0, estimator="k3",
                           temperature=1.0)


def _train(worker: ModelWorker, steps: int = 2) -> list[dict]:
    out = []
    for k in range(steps):
        roll = worker.generate(PROMPTS, **GEN)
        out.append(worker.train(_loss(roll, k), **TRAIN))
    return out


def test_host_adamw_steps_bitwise_like_adamw_and_keeps_its_state_form():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
    b.load_state_dict(a.state_dict())
    plain = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    host = HostAdamW(list(b.parameters()), lr=1e-2, weight_decay=0.1, foreach=False)
    seen = []
    host.register_step_pre_hook(lambda opt, *_: seen.append(all(m.grad is not None for g in opt.param_groups
                                                                 for m in g["params"])))
    for _ in range(4):
        x = torch.randn(3, 6)
        for model, opt in ((a, plain), (b, host)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    assert seen == [True] * 4   # a guard registered after it sees the gradients on the host
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    sa, sb = plain.state_dict(), host.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
    assert all(m.device.type == "cpu" for g in host.param_groups for m in g["params"])
    assert host.device_param(host.param_groups[0]["params"][0]) is next(b.parameters())
    host.zero_grad()
    assert all(p.grad is None for p in b.parameters())


def test_torch_trainer_with_its_optimizer_on_the_host_trains_bitwise_alike_and_resumes(tmp_path, make_spec):
    spec = make_spec("llama")
    plain = ModelWorker("actor", spec, {"kind": "random"}, seed=7)
    host = ModelWorker("actor", spec, {"kind": "random"}, seed=7, offload=True)
    assert isinstance(host.optimizer, type(None)) and host.backend.offload
    assert _train(plain) == _train(host)
    assert isinstance(host.optimizer, HostAdamW)
    assert all(torch.equal(v, host.get_weights()[k]) for k, v in plain.get_weights().items())
    host.save(str(tmp_path / "ckpt"))
    resumed = ModelWorker("actor", spec, {"kind": "random"}, seed=99, offload=True)
    resumed.load(str(tmp_path / "ckpt"))
    assert isinstance(resumed.optimizer, HostAdamW)
    assert _train(plain, 1) == _train(resumed, 1)
    assert all(torch.equal(v, resumed.get_weights()[k]) for k, v in plain.get_weights().items())


def _rank(rank: int, world: int, store, spec: dict, trainer: str, offload: bool) -> dict:
    torch.set_num_threads(1)
    worker = ModelWorker("actor", spec, {"kind": "random"}, seed=7, trainer=trainer, rank=rank, world=world,
                         store=store, offload=offload)
    roll = worker.generate(PROMPTS, **GEN)   # a collective on a group: every rank calls it
    import torch.distributed as dist

    box = [roll]
    dist.broadcast_object_list(box, src=0)
    metrics = [worker.train(_loss(box[0], k), **TRAIN) for k in range(2)]
    state = worker.backend.optimizer_state()[0]
    return {"metrics": metrics, "weights": worker.get_weights(), "opt": state}


def _group(world: int, spec: dict, trainer: str, offload: bool) -> list[dict]:
    store = open_store()
    return run_spawned([(_rank, (r, world, store, spec, trainer, offload)) for r in range(world)],
                       what=f"{trainer} rank (offload={offload})", timeout=300)


@pytest.mark.parametrize("trainer,world", [("fsdp", 2), ("megatron", 1)])
def test_group_trainers_offloaded_train_bitwise_alike(trainer, world, make_spec):
    spec = make_spec("gpt2")
    plain, host = _group(world, spec, trainer, False), _group(world, spec, trainer, True)
    assert plain[0]["metrics"] == host[0]["metrics"]
    for k, v in plain[0]["weights"].items():
        assert torch.equal(v, host[0]["weights"][k]), k
    assert plain[0]["opt"].keys() == host[0]["opt"].keys()
    for k, v in plain[0]["opt"].items():
        assert torch.equal(v, host[0]["opt"][k]), k
