"""LoRA adapters through peft (rlhfc.runtime.models.lora): what trains, what a step changes, export and resume."""

from __future__ import annotations

import pytest
import torch

from rlhfc.ir.core import Model
from rlhfc.ir.lora import lora_params
from rlhfc.runtime import compute
from rlhfc.runtime.data.values import TokenValues
from rlhfc.runtime.models.build import build_model, copy_weights, get_weights, save_weights
from rlhfc.runtime.models.lora import lora_layers, merged_state, trainable_count
from rlhfc.runtime.train import loop

peft = pytest.importorskip("peft", reason="LoRA needs the optional extra: pip install 'rlhfc[lora]'")

LORA = {"llama": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
        "gpt2": {"rank": 4, "alpha": 8, "targets": ["c_attn", "c_proj"]}}


def _ids():
    ids = torch.tensor([[0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8]])
    return ids, torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


def _step(model, lr=1e-2):
    """One optimizer step on a loss that moves every trainable weight."""
    opt = loop.make_optimizer(model, lr=lr, weight_decay=0.0)
    ids, mask = _ids()
    model.train()
    logp = torch.log_softmax(model.forward_logits(ids, mask), -1)[:, :-1].gather(-1, ids[:, 1:, None])
    (-logp.mean()).backward()
    opt.step()
    model.eval()
    return opt


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_only_the_adapters_train_and_their_count_is_the_compilers(arch, make_spec):
    spec = make_spec(arch, lora=LORA[arch])
    model, base = build_model(spec, seed=3), build_model(make_spec(arch), seed=3)
    ir = Model("actor", arch, **{k: spec[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
                                                        "max_seq")}, trainable=True, lora=LORA[arch])
    assert trainable_count(model) == lora_params(ir) > 0
    assert {n.rsplit(".", 1)[-1] for n, _ in lora_layers(model)} == set(LORA[arch]["targets"])
    ids, mask = _ids()
    with torch.no_grad():   # B = 0: a fresh adapter model computes its base exactly; the base weights are the same
        assert torch.equal(model.forward_logits(ids, mask), base.forward_logits(ids, mask))
    assert all(torch.equal(v, get_weights(base)[k]) for k, v in merged_state(model).items())

    before = get_weights(model)
    opt = _step(model)
    after = get_weights(model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)              # only adapter weights move
    assert any(".lora_B." in k for k in changed)
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert len(opt.state) == len(adapters) and all(id(p) in {id(q) for q in adapters} for p in opt.state)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_merges_the_adapters_with_the_trainers_log_probs(arch, make_spec, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhfc.runtime.driver.export import export_model

    spec = make_spec(arch, lora=LORA[arch])
    model = build_model(spec, seed=0)
    for _ in range(2):
        _step(model, lr=5e-2)
    assert any(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if ".lora_B." in n)
    (tmp_path / "w").mkdir()
    save_weights(model, str(tmp_path / "w" / "weights.safetensors"))
    export_model(spec, str(tmp_path / "w"), str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    assert not any("lora" in k for k in hf.state_dict())                 # a plain model: adapters merged
    ids, mask = _ids()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = torch.log_softmax(model.forward_logits(ids, mask), -1)
        theirs = torch.log_softmax(hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float(), -1)
    real = mask.bool()
    assert torch.allclose(ours[real], theirs[real], atol=1e-5)
    ref = build_model(make_spec(arch), seed=9)                            # copy(actor): the merged weights
    copy_weights(model, ref)
    with torch.no_grad():
        assert torch.allclose(ref.forward_logits(ids, mask)[real], model.forward_logits(ids, mask)[real], atol=1e-5)


def test_a_resumed_lora_worker_continues_bit_for_bit(make_spec, tmp_path):
    """Checkpoint/resume keeps the adapters and their optimizer state: 2 + 2 steps equal 4."""
    from rlhfc.runtime.worker.base import ModelWorker

    spec = make_spec("llama", vocab=32, lora=LORA["llama"])
    sched = dict(lr=1e-2, epochs=1, minibatches=1, max_grad_norm=1.0, weight_decay=0.0)

    def step(worker):
        roll = worker.generate(["ab", "cd"], max_new_tokens=3, temperature=1.0, top_p=1.0)
        logp = TokenValues(worker.logprobs(roll, temperature=1.0).values, roll.mask)
        adv = TokenValues(torch.tensor([[1.0], [-1.0]]).expand(roll.mask.shape) * roll.mask, roll.mask)
        worker.train(compute.ppo_clip(roll, logp, adv, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3"),
                     **sched)

    whole = ModelWorker("actor", spec, {"kind": "random"}, seed=0)
    for _ in range(4):
        step(whole)
    first = ModelWorker("actor", spec, {"kind": "random"}, seed=0)
    for _ in range(2):
        step(first)
    first.save(str(tmp_path / "ckpt"))
    resumed = ModelWorker("actor", spec, {"kind": "random"}, seed=7)
    resumed.load(str(tmp_path / "ckpt"))
    for _ in range(2):
        step(resumed)
    want, got = whole.get_weights(), resumed.get_weights()
    assert any(".lora_B." in k and float(v.abs().max()) > 0 for k, v in got.items())
    for k, v in want.items():
        assert torch.equal(v, got[k]), k
