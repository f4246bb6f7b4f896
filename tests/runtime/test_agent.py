"""Multi-turn, tool-using rollouts (rlhfc.runtime.rollout.agent): token-in/token-out trajectories whose tool
tokens carry no loss, log-probs equal to one forward of the same tokens, GAE and the KL reward over the
policy's tokens only."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import pytest
import torch

from rlhfc.runtime.data.tokenizer import CharTokenizer
from rlhfc.runtime.rl import ppo
from rlhfc.runtime.rollout.agent import AgentLoop, parse_call
from rlhfc.runtime.rollout.decoding import FinishedSample
from rlhfc.runtime.worker.base import ModelWorker


def test_a_turn_calls_a_tool_by_its_name_then_a_space():
    tools = ("calc", "calc2", "look")
    assert parse_call("calc 12 plus 30", tools) == ("calc", "12 plus 30")
    assert parse_call("  calc2  7 ", tools) == ("calc2", "7")
    assert parse_call("look", tools) == ("look", "")
    assert parse_call("calculate 3", tools) is None     # a longer word is not the name
    assert parse_call("the answer is 42", tools) is None


@dataclass
class _Result:
    output: str
    kind: str = "ok"


class _Tool:
    """A tool outside any sandbox (the loop only needs ``call``)."""

    def __init__(self, fn, kind="ok"):
        self.fn, self.kind, self.args = fn, kind, []

    def call(self, args):
        self.args += args
        return [_Result(self.fn(a), self.kind) for a in args]


def _scripted(turns: dict[int, list[str]], tok):
    """A decode function that answers row keys with scripted turns (each ending with EOS), log-prob -0.5 each."""
    def decode(rows, *, budgets, resumed, row_keys):
        for i, (key, budget) in enumerate(zip(row_keys, budgets)):
            script = turns[key]
            done = _scripted.count.setdefault(key, 0)
            _scripted.count[key] = done + 1
            ids = (tok.encode(script[done]) + [tok.eos_id])[:budget]
            yield FinishedSample(i, tuple(rows[i]), tuple(ids), ids[-1] == tok.eos_id, len(ids) - 1,
                                 tuple([-1.0] * resumed[i] + [-0.5] * len(ids)), float(len(ids)))
    _scripted.count = {}
    return decode


def test_the_loop_appends_tool_results_as_tokens_the_policy_did_not_sample():
    tok = CharTokenizer(64)
    calc = _Tool(lambda a: str(sum(int(x) for x in a.split(" plus "))))
    loop = AgentLoop({"calc": calc}, max_turns=3, turn_tokens=16)
    decode = _scripted({0: ["calc 12 plus 30", "42"], 1: ["7"], 2: ["calc 1 plus 1", "calc 2 plus 2", "x"]}, tok)
    trajs, _ = loop.run(decode, [[1, 5], [1, 6], [1, 7]], width=40, keys=[0, 1, 2], tokenizer=tok, want_logprobs=True)
    a, b, c = trajs
    call, result, answer = tok.encode("calc 12 plus 30") + [tok.eos_id], tok.encode("42"), tok.encode("42") + [tok.eos_id]
    assert a.tokens == call + result + answer                     # token in, token out: no re-tokenized text
    assert a.policy == [True] * len(call) + [False] * len(result) + [True] * len(answer)
    assert a.logprobs == [-0.5] * len(call) + [0.0] * len(result) + [-0.5] * len(answer)
    assert (a.turns, a.calls, a.tool_tokens, a.eos, a.done) == (2, 1, 2, True, True)
    assert b.tokens == tok.encode("7") + [tok.eos_id] and b.calls == 0 and b.turns == 1   # an answer ends it
    assert c.turns == 3 and c.calls == 2          # the third turn is the last (max_turns), whatever it says
    assert calc.args == ["12 plus 30", "1 plus 1", "2 plus 2"]
    stats = AgentLoop.stats(trajs)
    assert stats["tool_calls"] == 3 and stats["turns_mean"] == 2 and stats["tool_tokens"] == 2 + 1 + 1


def test_a_trajectory_never_passes_its_width_and_errors_are_counted():
    tok = CharTokenizer(64)
    broken = _Tool(lambda a: "error: timed out after 2 s", kind="timeout")
    loop = AgentLoop({"calc": broken}, max_turns=4, turn_tokens=8)
    decode = _scripted({0: ["calc 1", "calc 2", "calc 3", "9"]}, tok)
    (t,), _ = loop.run(decode, [[1]], width=20, keys=[0], tokenizer=tok, want_logprobs=False)
    assert len(t.tokens) == 20 and t.done
    assert t.timeouts == t.calls >= 1 and not t.eos
    assert t.logprobs == [0.0] * 20


TOOL = textwrap.dedent('''
    def bee(text):
        return "bc"
''')


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory, make_spec):
    """A tiny random policy (vocab 8: the characters a-e) whose one-token turns call tool 'a' when they say
    "a": the real torch decoder, the real sandbox, four turns, 8 samples of 4 prompts."""
    folder = tmp_path_factory.mktemp("tools")
    (folder / "tools.py").write_text(TOOL)
    worker = ModelWorker("actor", make_spec(vocab=8, max_seq=64), {"kind": "random"}, seed=3)
    spec = {"name": "a", "path": str(folder / "tools.py"), "function": "bee", "timeout": 2.0, "memory_mb": 256,
            "max_output": 64}
    roll = worker.generate(["ab", "cd", "e", "bd"], max_new_tokens=12, temperature=1.0, top_p=1.0, n=8,
                           logprobs=True, tools=[spec], max_turns=4, turn_tokens=1)
    return worker, roll


def test_tool_tokens_are_masked_out_of_the_loss(trajectories):
    worker, roll = trajectories
    tok = worker.tokenizer
    assert roll.engine["tool_calls"] > 0 and roll.engine["turns_mean"] > 1
    calls = 0
    for row, ids in enumerate(roll.batch.response_token_lists()):
        mask = roll.batch.response_mask[row, :len(ids)].tolist()
        assert roll.batch.response_mask[row, len(ids):].sum() == 0
        k = 0
        while k < len(ids):                    # each one-token turn "a" is followed by the tool's "bc", masked
            assert mask[k] == 1
            if ids[k] == tok.encode("a")[0] and k + 1 < len(ids):
                assert ids[k + 1:k + 3] == tok.encode("bc")[:len(ids) - k - 1] and mask[k + 1:k + 3] == [0] * len(
                    ids[k + 1:k + 3])
                calls += 1
                k += 3
            else:
                k += 1
    assert calls == roll.engine["tool_calls"]


def test_a_trajectorys_sampling_logprobs_equal_one_forward_of_its_tokens(trajectories):
    worker, roll = trajectories
    forward = worker.logprobs(roll)
    mask = roll.batch.response_mask.bool()
    assert torch.allclose(forward.values[mask], roll.logprobs[mask], atol=1e-5)
    assert (roll.logprobs[~mask] == 0).all()


def test_the_policy_loss_has_no_gradient_on_tool_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 10, requires_grad=True)
    tokens = torch.randint(0, 10, (2, 6))
    logp = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 1, 0]])
    adv = torch.randn(2, 6)
    loss, _ = ppo.policy_loss(logp, logp.detach() - 0.1, adv, mask, clip=0.2)
    loss.backward()
    off = ~mask.bool()
    assert logits.grad[off].abs().max() == 0 and logits.grad[mask.bool()].abs().max() > 0


def test_gae_and_the_kl_reward_run_over_the_policys_tokens_only():
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]])
    rewards, values = torch.randn(2, 7), torch.randn(2, 7)
    adv, ret = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for row in range(2):   # the same as GAE over the row's policy tokens alone
        keep = mask[row].bool()
        a, r = ppo.gae(rewards[row, keep][None], values[row, keep][None], torch.ones(1, int(keep.sum())),
                       gamma=0.9, lam=0.8)
        assert torch.allclose(adv[row, keep], a[0]) and torch.allclose(ret[row, keep], r[0])
        assert (adv[row, ~keep] == 0).all()
    scores = torch.tensor([2.0, 3.0])
    tok = ppo.kl_penalized_rewards(scores, torch.zeros(2, 7), torch.zeros(2, 7), mask, 0.1)
    assert tok[0, 5] == 2.0 and tok[1, 3] == 3.0 and tok.sum() == 5.0   # the last policy token, not len - 1


class _Steps:
    """An environment rewarding each step: 0.25 for "?" (and answering "7"), 1.0 for any other answer."""

    def reset(self, record):
        return ""

    def step(self, action):
        if action == "?":
            return "7", 0.25, False
        return "", 1.0, True


def test_per_turn_rewards_land_on_the_last_token_of_the_turn_they_answer():
    """``env_turn_rewards``: each step's reward at the response column of its turn's last policy token; the row
    sums equal ``env_reward``; kl_penalty adds -coef·KL on the policy's tokens only; with gamma < 1 the
    look-up turn's own reward reaches its advantage undiscounted."""
    from rlhfc.runtime import compute
    from rlhfc.runtime.data.values import TokenValues
    from rlhfc.runtime.rollout.agent import ENV_REWARD, ENV_TURN_REWARDS

    tok = CharTokenizer(64)
    loop = AgentLoop({}, max_turns=3, turn_tokens=4, env=_Steps, env_name="steps")
    decode = _scripted({0: ["?", "x"], 1: ["ab"]}, tok)
    trajs, _ = loop.run(decode, [[1], [1]], width=12, keys=[0, 1], tokenizer=tok, want_logprobs=False,
                        records=[{"prompt": "p"}, {"prompt": "q"}])
    a, b = trajs
    # a: "?" EOS (cols 0-1), "7" from the environment (col 2), "x" EOS (cols 3-4)
    assert a.tokens == tok.encode("?") + [tok.eos_id] + tok.encode("7") + tok.encode("x") + [tok.eos_id]
    assert a.turn_rewards == [(1, 0.25), (4, 1.0)] and a.reward == 1.25
    assert b.turn_rewards == [(2, 1.0)]       # "ab" EOS: one turn, its reward on the EOS

    class _Roll:
        prompts = ["p", "q"]
        mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
        fields = [{ENV_REWARD: t.reward, ENV_TURN_REWARDS: [list(x) for x in t.turn_rewards]} for t in trajs]

    per = compute.env_turn_rewards(_Roll)
    assert per.values.tolist() == [[0, 0.25, 0, 0, 1.0, 0], [0, 0, 1.0, 0, 0, 0]]
    assert per.values.sum(-1).tolist() == compute.env_reward(_Roll).tolist() == [1.25, 1.0]
    logp = TokenValues(torch.full((2, 6), -1.0), _Roll.mask)
    ref = TokenValues(torch.full((2, 6), -1.5), _Roll.mask)
    tokens = compute.kl_penalty(per, logp, ref, coef=0.1, estimator="k1")
    assert torch.allclose(tokens.values, per.values - 0.1 * 0.5 * _Roll.mask)
    zero = torch.zeros(2, 6)
    adv, _ = ppo.gae(per.values, zero, _Roll.mask, gamma=0.5, lam=1.0)
    # row 0 over its policy tokens (cols 0, 1, 3, 4), backwards: A4 = 1; A3 = 0.5·A4 = 0.5; A1 = 0.25 (its own
    # turn's reward) + 0.5·A3 = 0.5; A0 = 0.5·A1 = 0.25
    assert adv[0].tolist() == [0.25, 0.5, 0.0, 0.5, 1.0, 0.0]
    with pytest.raises(ValueError, match="env_turn_rewards needs a rollout whose generate acts in an environment"):
        compute.env_turn_rewards(type("R", (), {"fields": [{}], "mask": _Roll.mask, "prompts": ["p"]}))
