"""The algorithm family (rlhfc.runtime.rl.algorithms): each formula against a hand computation on fixed tensors."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlhfc.runtime import compute
from rlhfc.runtime.data.values import Rollout, TokenValues
from rlhfc.runtime.rl import algorithms, ppo
from rlhfc.runtime.rollout.generation import RolloutBatch
from rlhfc.runtime.train import loop

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def _whiten(xs):
    """(x − mean) / sqrt(var + 1e-8), var with Bessel's correction — by hand, over a flat list."""
    mean, var = statistics.mean(xs), statistics.variance(xs)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_reinforce_pp_is_the_kl_penalised_return_to_go_normalised_over_the_batch():
    scores = torch.tensor([1.0, 0.0])
    logp = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 9.0]])   # 9.0: padding, never read
    ref = torch.zeros(2, 3)
    adv = algorithms.reinforce_pp_advantages(scores, MASK, logp, ref, kl_coef=0.5, estimator="k1")
    # rewards: row 0 [-0.05, -0.1 + 1.0], row 1 [-0.15 + 0.0]; returns to go: [0.85, 0.9], [-0.15]
    want = _whiten([0.85, 0.9, -0.15])
    got = [float(adv[0, 0]), float(adv[0, 1]), float(adv[1, 0])]
    assert got == pytest.approx(want, abs=1e-6)
    assert float(adv[0, 2]) == float(adv[1, 1]) == float(adv[1, 2]) == 0.0


def test_reinforce_pp_without_kl_and_with_a_group_baseline():
    mask = torch.ones(4, 2)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    plain = algorithms.reinforce_pp_advantages(scores, mask)
    assert plain[:, 0].tolist() == pytest.approx(_whiten([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])[::2], abs=1e-6)
    based = algorithms.reinforce_pp_advantages(scores, mask, group=2, baseline=True)
    # group means 0.5 and 0.5 subtracted first: returns 0.5, -0.5, 0, 0 on both tokens of each row
    assert based[:, 1].tolist() == pytest.approx(_whiten([0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0])[::2], abs=1e-6)


def test_remax_subtracts_the_greedy_score_of_the_same_prompt():
    assert algorithms.remax_advantages(torch.tensor([0.7, 0.5, 0.2]), torch.tensor([0.4, 0.5, 0.0])).tolist() == \
        pytest.approx([0.3, 0.0, 0.2])
    two = algorithms.remax_advantages(torch.tensor([1.0, 0.0, 0.5, 0.25]), torch.tensor([0.5, 0.25]))
    assert two.tolist() == pytest.approx([0.5, -0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="one baseline score per prompt"):
        algorithms.remax_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.5, 0.25]))


def test_overlong_penalty_follows_dapo():
    # max_len 10, buffer 4: free up to 6, then (6 − len) / 4, −1 past 10
    got = algorithms.overlong_penalty(torch.tensor([5, 6, 7, 10, 11]), max_len=10, buffer=4)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -1.0, -1.0])


def test_uniform_groups_are_those_with_one_score():
    assert algorithms.uniform_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3]), 2).tolist() == [True, False, True]


@pytest.mark.parametrize("how,want", [("token_mean", 10 / 4), ("seq_mean_token_mean", (2 + 4) / 2),
                                      ("seq_mean_token_sum", (6 + 4) / 2)])
def test_loss_aggregations(how, want):
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(algorithms.aggregate(per_token, mask, how)) == pytest.approx(want)


def test_decoupled_clip_bounds():
    # token 1: ratio 1.5, A = +1 -> clipped at 1 + clip_high; token 2: ratio 0.5, A = −1 -> clipped at 1 − clip
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    sym, _ = ppo.policy_loss(logp, old, adv, mask, clip=0.2)
    dapo, _ = ppo.policy_loss(logp, old, adv, mask, clip=0.2, clip_high=0.28)
    assert float(sym) == pytest.approx((-1.2 + 0.8) / 2)
    assert float(dapo) == pytest.approx((-1.28 + 0.8) / 2)


def test_gspo_sequence_ratio_is_clipped_per_sequence_with_the_sequence_gradient():
    old = torch.zeros(2, 2)
    logp = torch.tensor([[math.log(2.0), 0.0], [0.1, -0.05]], requires_grad=True)
    adv = torch.ones(2, 2)
    mask = torch.ones(2, 2)
    loss, m = ppo.policy_loss(logp, old, adv, mask, clip=0.2, loss_agg="seq_mean_token_mean", ratio_level="sequence")
    s1, s2 = math.sqrt(2.0), math.exp(0.025)          # exp(mean log-ratio) of each row
    assert float(loss.detach()) == pytest.approx((-1.2 - s2) / 2)   # row 1 clipped at 1.2, row 2 inside the range
    assert m["ratio"] == pytest.approx((s1 + s2) / 2)
    loss.backward()
    # d/dlogp_t of −s/2 (the mean over 2 rows) with s = exp(mean_t logp_t − old): −s / (2·2); clipped row: 0
    assert logp.grad[0].tolist() == [0.0, 0.0]
    assert logp.grad[1].tolist() == pytest.approx([-s2 / 4, -s2 / 4])


def test_token_mean_is_todays_default_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    a, _ = ppo.policy_loss(logp, old, adv, mask)
    b, _ = ppo.policy_loss(logp, old, adv, mask, loss_agg="token_mean", ratio_level="token")
    direct = ppo.masked_mean(torch.maximum(-adv * torch.exp(logp - old),
                                           -adv * torch.clamp(torch.exp(logp - old), 0.8, 1.2)), mask)
    assert float(a) == float(b) == float(direct)


def test_lr_schedules():
    linear = [algorithms.lr_factor(s, "linear", warmup=2, total=6) for s in range(6)]
    assert linear == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    cosine = [algorithms.lr_factor(s, "cosine", warmup=2, total=6) for s in range(6)]
    assert cosine == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                    0.5 * (1 + math.cos(3 * math.pi / 4))])
    assert [algorithms.lr_factor(s, "constant", warmup=3, total=6) for s in range(5)] == \
        pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0])


def _rollout(rows: int, width: int = 3) -> Rollout:
    lengths = torch.tensor([1 + i % width for i in range(rows)])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    batch = RolloutBatch(input_ids=torch.ones(rows, 2 + width, dtype=torch.long),
                         attention_mask=torch.cat([torch.ones(rows, 2, dtype=torch.long), mask], 1),
                         response_mask=mask, prompt_len=2, response_lengths=lengths,
                         prompt_lengths=torch.full((rows,), 2), eos=torch.zeros(rows, dtype=torch.bool))
    return Rollout(batch, [f"p{i // 2}" for i in range(rows)], [f"r{i}" for i in range(rows)], "actor", 0,
                   "char:96", list(range(rows)), [0] * rows)


def test_filter_groups_drops_the_uniform_groups_before_the_loss():
    roll = _rollout(6)
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])   # groups of 2: the first and last are uniform
    adv = compute.group_advantages(roll, scores, method="grpo", normalize_std=True, group=2, filter_groups=True)
    assert adv.keep.tolist() == [False, False, True, True, False, False] and adv.dropped_groups == 2
    logp = TokenValues(torch.randn(6, 3) * roll.mask, roll.mask)
    loss = compute.ppo_clip(roll, logp, adv, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3",
                            clip_high=0.28, loss_agg="seq_mean_token_mean")
    assert loss.rollout.size == 2 and loss.rollout.responses == ["r2", "r3"] and loss.rollout.rows == [2, 3]
    assert torch.equal(loss.old_logp, logp.values[2:4]) and torch.equal(loss.advantages, adv.values[2:4])
    assert (loss.clip, loss.clip_high, loss.loss_agg) == (0.2, 0.28, "seq_mean_token_mean")
    assert loss.stats == {"dropped_groups": 2.0, "kept_samples": 2.0}


def test_overlong_and_remax_stages():
    roll = _rollout(4)    # response lengths 1, 2, 3, 1
    shaped = compute.overlong(roll, torch.ones(4), max_len=3, buffer=2)
    assert shaped.tolist() == pytest.approx([1.0, 0.5, 0.0, 1.0])
    adv = compute.remax(roll, torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0.5, 0.25]))
    assert adv.values[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.25, 0.25])
    assert bool((adv.values * (1 - roll.mask)).eq(0).all())   # nothing past each response


def test_sequence_loss_units_weigh_pieces_by_rows():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(algorithms.loss_units(mask)) == 4.0
    assert float(algorithms.loss_units(mask, "seq_mean_token_mean")) == 2.0


def test_lr_schedule_reaches_the_optimizer_and_resumes_exactly(make_spec, tmp_path):
    """A worker's train uses lr × the schedule at its train step, reports it as ``lr``, and a worker loaded
    from a checkpoint continues the same lr sequence and the same weights."""
    from rlhfc.runtime.worker.base import ModelWorker

    spec = make_spec("gpt2", vocab=32)
    sched = dict(lr=1e-2, epochs=1, minibatches=1, max_grad_norm=1.0, weight_decay=0.0, lr_schedule="cosine",
                 warmup_steps=1, total_steps=4)

    def step(worker):
        roll = worker.generate(["ab", "cd"], max_new_tokens=3, temperature=1.0, top_p=1.0)
        logp = TokenValues(worker.logprobs(roll, temperature=1.0).values, roll.mask)
        adv = TokenValues(torch.tensor([[1.0], [-1.0]]).expand(roll.mask.shape) * roll.mask, roll.mask)
        loss = compute.ppo_clip(roll, logp, adv, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3")
        return worker.train(loss, **sched)["lr"]

    whole = ModelWorker("actor", spec, {"kind": "random"}, seed=0)
    lrs = [step(whole) for _ in range(4)]
    assert lrs == pytest.approx([1e-2 * algorithms.lr_factor(s, "cosine", 1, 4) for s in range(4)])
    assert lrs[:3] == pytest.approx([1e-2, 1e-2, 0.75e-2]) and lrs[3] == pytest.approx(0.25e-2)   # cos(π/3), cos(2π/3)

    first = ModelWorker("actor", spec, {"kind": "random"}, seed=0)
    head = [step(first) for _ in range(2)]
    first.save(str(tmp_path / "ckpt"))
    resumed = ModelWorker("actor", spec, {"kind": "random"}, seed=7)
    resumed.load(str(tmp_path / "ckpt"))
    assert head + [step(resumed) for _ in range(2)] == lrs
    for k, v in whole.get_weights().items():
        assert torch.equal(v, resumed.get_weights()[k]), k


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_sum"])
def test_data_parallel_shares_weigh_a_sequence_mean_by_rows(loss_agg):
    """Two data-parallel ranks, each weighting its share by its tokens (token_mean) or rows (a sequence mean),
    average to the whole minibatch's gradient (SGD: the mean of the ranks' updates is the full update)."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]])   # any split: 5 vs 2 tokens
    target = torch.arange(16.0).view(4, 4) / 10

    def loss_fn(model, mb):
        per_token = (model.w * mb["x"] - mb["y"]) ** 2
        return algorithms.aggregate(per_token, mb["response_mask"], mb["loss_agg"]), {}

    def run(shard):
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.tensor(0.5))
        batch = {"x": torch.ones(4, 4), "y": target, "response_mask": mask, "loss_agg": loss_agg}
        loop.train_epochs(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loss_fn, max_grad_norm=None,
                         generator=torch.Generator().manual_seed(0), shard=shard)
        return float(model.w.detach()) - 0.5

    whole = run(None)
    assert whole != 0.0
    assert (run((0, 2)) + run((1, 2))) / 2 == pytest.approx(whole, rel=1e-6)


def test_truncated_importance_weights_scale_the_clipped_loss():
    """ppo_clip(tis_cap = C) under rollout = vllm: the advantages carry w = min(exp(logp - rollout_logp), C),
    which gives the loss of weighting each token's clipped surrogate by w (Yao et al. 2025); the gap between
    the engine's and the trainer's log-probs is reported over response tokens only."""
    from rlhfc.runtime.compute import ppo_clip
    from rlhfc.runtime.data.values import Rollout, TokenValues
    from rlhfc.runtime.rl.algorithms import rollout_logprob_gap
    from rlhfc.runtime.rl.ppo import policy_loss
    from rlhfc.runtime.rollout.generation import RolloutBatch

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    old = torch.randn(2, 4, generator=g) * mask
    engine = (old + 0.5 * torch.randn(2, 4, generator=g)) * mask
    engine[0, 3] = 9.0   # past the response: never counted
    adv = torch.randn(2, 4, generator=g) * mask
    new = old + 0.3 * torch.randn(2, 4, generator=g)
    weight, stats = rollout_logprob_gap(old, engine, mask, tis_cap=1.5)
    want = torch.where(mask.bool(), torch.exp(old - engine).clamp(max=1.5), torch.ones_like(old))
    assert torch.allclose(weight, want) and float(weight.max()) <= 1.5
    gap = (engine - old).abs()[mask.bool()]
    assert stats["rollout_logprob_diff_max"] == pytest.approx(float(gap.max()))
    assert stats["rollout_logprob_diff_mean"] == pytest.approx(float(gap.mean()))
    # weighting the advantages == weighting each token's clipped surrogate
    loss_w, _ = policy_loss(new, old, adv * weight, mask, clip=0.2)
    ratio = torch.exp(new - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * weight
    assert float(loss_w) == pytest.approx(float((per_token * mask).sum() / mask.sum()), rel=1e-6)
    # through ppo_clip: only a rollout of the vLLM engine carries the weights
    batch = RolloutBatch(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long), mask, 2,
                         mask.sum(1), torch.tensor([2, 2]), torch.tensor([False, False]))
    roll = Rollout(batch, ["a", "b"], ["x", "y"], "actor", 0, "char:96", [0, 1], [0, 0], logprobs=engine,
                   rollout_engine="vllm")
    settings = dict(clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3", tis_cap=1.5)
    loss = ppo_clip(roll, TokenValues(old, mask), TokenValues(adv, mask), **settings)
    assert torch.allclose(loss.advantages, adv * weight) and loss.stats["tis_weight_mean"] <= 1.5
    from dataclasses import replace

    plain = ppo_clip(replace(roll, rollout_engine="torch"), TokenValues(old, mask), TokenValues(adv, mask), **settings)
    assert torch.equal(plain.advantages, adv) and plain.stats == {}
