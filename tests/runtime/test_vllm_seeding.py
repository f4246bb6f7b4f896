"""One seed per vLLM generate call (issue #15): the call's generator state is swapped in as the process's
default generator around each engine step (vLLM draws unseeded requests' noise from it), so the steps of a
call draw exactly what a default generator seeded with the call's seed would, whatever runs in between, and
the process's own random state is left as it was. No vLLM needed: a step here is a draw from the default
generator, as vLLM's CPU sampler makes one."""

from __future__ import annotations

import torch

from rlhfc.runtime.rollout.vllm import _StepGenerators, batch_seed


def test_a_calls_steps_draw_the_seeded_stream_and_leave_the_process_state_alone():
    gen = _StepGenerators(batch_seed(range(100, 108)), "cpu")
    torch.manual_seed(1)
    outer = torch.get_rng_state()
    steps = []
    for _ in range(3):
        steps.append(gen.run(lambda: torch.randint(0, 2**31, (4,))))
        torch.rand(5)   # the process draws in between (another stage, the worker's own code)
    after = torch.rand(5)
    torch.set_rng_state(outer)
    torch.rand(15)
    assert torch.equal(after, torch.rand(5))   # the process's stream went on as if no step had drawn
    torch.manual_seed(batch_seed(range(100, 108)))
    assert all(torch.equal(s, torch.randint(0, 2**31, (4,))) for s in steps)


def test_the_seed_follows_the_row_keys_in_order_and_no_seed_leaves_the_state_untouched():
    assert batch_seed([1, 2, 3]) == batch_seed((1, 2, 3)) != batch_seed([3, 2, 1])
    assert 0 <= batch_seed(range(10**6, 10**6 + 512)) < 2**63
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(_StepGenerators(None, "cpu").run(lambda: torch.rand(3)), expected)
