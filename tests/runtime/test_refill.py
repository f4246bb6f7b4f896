"""DAPO's dynamic sampling with refill (rlhfc.runtime.rl.refill) on fixed rewards, and the driver it is emitted in."""

from __future__ import annotations

import os

import torch

from rlhfc.codegen import PythonEmitter
from rlhfc.frontend import load_file
from rlhfc.ir.schedule import build_schedule
from rlhfc.runtime import compute
from rlhfc.runtime.data.values import Rollout, TokenValues
from rlhfc.runtime.rl.refill import concat_rollouts, refill
from rlhfc.runtime.rollout.generation import RolloutBatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GROUP = 2


def _round(index: int, scores: list[float], prompt_len: int, width: int):
    """One sampling round's values, as the driver's ``sample_round`` returns them: prompts (one per group),
    the rollout, the scores and the filtered advantages. Round ``index`` names its texts ``r{index}.{row}``."""
    rows = len(scores)
    lengths = torch.tensor([1 + (i + index) % width for i in range(rows)])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.arange(rows * (prompt_len + width)).view(rows, -1) % 90 + 1
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.cat([torch.ones(rows, prompt_len, dtype=torch.long),
                                                                  mask], 1),
                         response_mask=mask, prompt_len=prompt_len, response_lengths=lengths,
                         prompt_lengths=torch.full((rows,), prompt_len), eos=torch.zeros(rows, dtype=torch.bool))
    prompts = [f"p{index}.{g}" for g in range(rows // GROUP)]
    roll = Rollout(batch, [prompts[i // GROUP] for i in range(rows)], [f"r{index}.{i}" for i in range(rows)],
                   "actor", 0, "char:96", list(range(rows)), [0] * rows,
                   logprobs=-torch.rand(rows, width) * mask, fields=[{"k": i} for i in range(rows)])
    s = torch.tensor(scores)
    adv = compute.group_advantages(roll, s, method="grpo", normalize_std=True, group=GROUP, filter_groups=True)
    return {"prompts": prompts, "roll": roll, "scores": s, "adv": adv}


# four rounds of 3 groups of 2: which groups score unequal (kept) differs per round
ROUNDS = [[1.0, 1.0, 0.0, 1.0, 0.5, 0.5],      # keeps group 1
          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],      # keeps none
          [0.2, 0.1, 1.0, 1.0, 0.3, 0.9],      # keeps groups 0 and 2
          [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]]      # keeps all three


def _rounds(widths=(3, 3, 3, 3), prompt_lens=(2, 2, 2, 2)):
    made = []

    def round_fn():
        i = len(made)
        made.append(_round(i, ROUNDS[i], prompt_lens[i], widths[i]))
        return made[-1]
    return round_fn, made


def test_refill_samples_rounds_until_enough_groups_with_unequal_scores():
    round_fn, made = _rounds()
    out = refill(round_fn, "adv", groups=3, group=GROUP, max_rounds=4)
    assert len(made) == 3                                    # 1 + 0 + 2 kept groups: three rounds
    roll, adv = out["roll"], out["adv"]
    assert out["prompts"] == ["p0.1", "p2.0", "p2.2"]        # the kept groups, in the order sampled
    assert roll.responses == ["r0.2", "r0.3", "r2.0", "r2.1", "r2.4", "r2.5"]
    assert roll.rows == list(range(6)) and roll.fields == [{"k": 2}, {"k": 3}, {"k": 0}, {"k": 1}, {"k": 4}, {"k": 5}]
    assert torch.equal(out["scores"], torch.tensor([0.0, 1.0, 0.2, 0.1, 0.3, 0.9]))
    src = [(0, 2), (0, 3), (2, 0), (2, 1), (2, 4), (2, 5)]
    for row, (r, i) in enumerate(src):                       # every row is its round's row, values and all
        assert torch.equal(roll.batch.input_ids[row], made[r]["roll"].batch.input_ids[i])
        assert torch.equal(adv.values[row], made[r]["adv"].values[i])
        assert torch.equal(roll.logprobs[row], made[r]["roll"].logprobs[i])
    assert (adv.dropped_groups, adv.sample_rounds, adv.sampled_groups) == (2 + 3 + 1, 3, 9)
    assert adv.keep.all() and len(adv.keep) == 6
    loss = compute.ppo_clip(roll, TokenValues(roll.logprobs, roll.mask), adv, clip=0.2, entropy_coef=0.0,
                            kl_coef=0.0, estimator="k3")
    assert loss.stats == {"dropped_groups": 6.0, "kept_samples": 6.0, "sample_rounds": 3.0, "sampled_groups": 9.0}


def test_refill_stops_at_max_rounds_and_cuts_the_surplus():
    round_fn, made = _rounds()
    short = refill(round_fn, "adv", groups=3, group=GROUP, max_rounds=2)     # rounds run out: 1 group
    assert len(made) == 2 and short["prompts"] == ["p0.1"] and short["roll"].size == 2
    assert short["adv"].sample_rounds == 2 and short["adv"].dropped_groups == 5
    round_fn, made = _rounds()
    out = refill(round_fn, "adv", groups=1, group=GROUP, max_rounds=4)       # enough at once: one round
    assert len(made) == 1 and out["prompts"] == ["p0.1"] and out["adv"].dropped_groups == 2


def test_refill_pads_rounds_of_other_prompt_and_response_widths():
    round_fn, made = _rounds(widths=(2, 3, 4, 3), prompt_lens=(2, 3, 1, 2))
    roll = refill(round_fn, "adv", groups=3, group=GROUP, max_rounds=4)["roll"]
    assert roll.batch.prompt_len == 2 and roll.batch.response_width == 4    # the widest of the kept rounds
    first, third = made[0]["roll"], made[2]["roll"]
    # round 0: same prompt width, responses right-padded; round 2: its 1-token prompts left-padded by 1
    assert torch.equal(roll.batch.input_ids[0, :4], first.batch.input_ids[2]) and roll.batch.input_ids[0, 4:].eq(0).all()
    assert torch.equal(roll.batch.input_ids[2, 1:], third.batch.input_ids[0]) and roll.batch.input_ids[2, 0] == 0
    assert roll.batch.attention_mask[2, 0] == 0 and torch.equal(roll.batch.attention_mask[2, 1:],
                                                                 third.batch.attention_mask[0])
    assert torch.equal(roll.batch.response_mask[:2, :2], first.batch.response_mask[2:4])
    assert concat_rollouts([first]).size == first.size


def test_the_driver_repeats_the_sampling_round_and_trains_after_it():
    module, _, _ = load_file(os.path.join(ROOT, "examples", "dapo_tiny.rlhf"))
    r = build_schedule(module).refill
    assert r.round == ("prompts", "roll", "raw", "scores", "adv")     # the policy's log-probs come after
    assert (r.filter, r.groups, r.group, r.max_rounds) == ("adv", 8, 4, 4)
    driver = PythonEmitter(module, source=None, opt_level="O0", passes=[]).emit()
    body = driver[driver.index("def sample_round"):]
    assert body.index("job.next_prompts") < body.index("job.refill('adv', sample_round, w, groups=8, group=4, "
                                                       "max_rounds=4)") < body.index("w.actor.logprobs") \
        < body.index("w.actor.train")
    compile(driver, "main.py", "exec")


def test_explain_says_the_price_assumes_one_sampling_round():
    from rlhfc.explain.report import build_report

    module, _, _ = load_file(os.path.join(ROOT, "examples", "dapo_tiny.rlhf"))
    note = next(n for n in build_report(module).notes if "refills" in n)
    assert "assumes one sampling round" in note and "up to 3 more rounds" in note
