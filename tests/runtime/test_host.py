"""A process hosting several models (rlhfc.runtime.worker.host): what a process of one's own guarantees.

One Ray session, one ModelHost with two tiny models, the calls made through the driver's handles
(HostedRank) as the generated code makes them: each model's calls run in the order they were made, even when
an earlier call waits for its argument; another model's calls run meanwhile; a failed upstream stage fails
the call that takes its result and the model's later calls still run; streamed generation through the host
yields what the worker yields in-process; the process killed, every hosted model's next call fails.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from rlhfc.runtime.driver.cluster import import_ray
from rlhfc.runtime.driver.group import WorkerGroup
from rlhfc.runtime.worker.base import ModelWorker
from rlhfc.runtime.worker.host import MAX_CALLS, HostedRank, ModelHost, streams

pytestmark = pytest.mark.e2e


def _spec(make_spec, head):
    return {**make_spec("llama", head=head, vocab=64, layers=1, max_seq=32), "source": None}


def _host(ray, make_spec) -> SimpleNamespace:
    """A ModelHost with two tiny models, actor and critic, and the driver's groups of them."""
    host = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=MAX_CALLS)(ModelHost).remote(None)
    ready = [host.add.remote(name, (name, _spec(make_spec, head), {"kind": "random"}, 5), {"threads": 1})
             for name, head in (("actor", "lm"), ("critic", "value"))]
    infos = ray.get(ready)
    assert infos[0]["pid"] == infos[1]["pid"] and [i["name"] for i in infos] == ["actor", "critic"]
    return SimpleNamespace(**{name: WorkerGroup(name, [HostedRank(host, name)]) for name in ("actor", "critic")})


@pytest.fixture(scope="module")
def ray_session():
    ray = import_ray()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_host(ray_session, make_spec):
    return ray_session, _host(ray_session, make_spec)


def test_generator_methods_are_the_streamed_ones():
    assert streams("generate_chunks") and not streams("generate") and not streams("train")


def test_a_models_calls_run_in_order_and_other_models_run_meanwhile(ray_host, tmp_path):
    ray, w = ray_host
    go = tmp_path / "go"

    @ray.remote(num_cpus=0)
    def when_told(value, path):
        while not os.path.exists(path):
            time.sleep(0.02)
        return value

    blocked = when_told.remote(7, str(go))
    first = w.actor.set_version.remote(blocked)   # waits for its argument ...
    second = w.actor.get_version.remote()         # ... and the actor's next call waits for it, as on an actor
    other = w.critic.set_version.remote(3)        # another model's call does not wait
    assert ray.get(other, timeout=60) == 3
    assert ray.wait([first, second], num_returns=1, timeout=0.5)[0] == []
    go.write_text("")
    assert ray.get(second, timeout=60) == 7 and ray.get(first) == 7


def test_a_failed_argument_fails_the_call_and_the_model_goes_on(ray_host):
    ray, w = ray_host

    @ray.remote(num_cpus=0, max_retries=0)
    def broken():
        raise ValueError("no rollout")

    with pytest.raises(ray.exceptions.RayTaskError) as exc:
        ray.get(w.critic.set_version.remote(broken.remote()), timeout=60)
    assert "ValueError" in str(exc.value) and "no rollout" in str(exc.value)
    assert ray.get(w.critic.set_version.remote(11), timeout=60) == 11


def test_streamed_generation_through_the_host_equals_the_worker_in_process(ray_host, make_spec):
    ray, w = ray_host
    local = ModelWorker("actor", _spec(make_spec, "lm"), {"kind": "random"}, 5, threads=1)
    prompts = ["ab", "cde", "f", "gh"]
    args = dict(chunk=2, max_new_tokens=5, temperature=1.0, top_p=1.0, n=1)
    got = [ray.get(ref) for ref in w.actor.generate_chunks.remote(prompts, **args)]
    want = list(local.generate_chunks(prompts, **args))
    assert [(c.rows, c.responses) for c in got] == [(c.rows, c.responses) for c in want] and len(got) == 2


def test_the_process_killed_every_hosted_model_is_gone(ray_session, make_spec):
    ray, w = ray_session, _host(ray_session, make_spec)
    w.critic.kill()
    for _ in range(600):   # ray.kill is asynchronous: a call sent at once may still reach the process
        try:
            ray.get(w.actor.get_version.remote(), timeout=30)   # the actor's calls go to the killed process too
            time.sleep(0.05)
        except ray.exceptions.RayActorError:
            break
    for group in (w.actor, w.critic):
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(group.get_version.remote(), timeout=60)


def test_each_hosted_model_draws_from_its_own_state_of_the_process_generator(make_spec, tmp_path):
    """In-process (no Ray): around a stage the host swaps in the model's state of torch's process-wide generator,
    so a model draws what it would in a process of its own, whatever the other model drew between; other calls
    leave the generator be; a checkpoint saves the model's own state and a load restores it."""
    import torch

    from rlhfc.runtime.worker.base import derive_seed

    host = ModelHost(None)
    for name, head in (("actor", "lm"), ("critic", "value")):
        host.build(name, (name, _spec(make_spec, head), {"kind": "random"}, 5), {"threads": 1})

    def draw(name, method="logprobs"):
        with host._random_state(name, method):
            return torch.rand(3)

    a1, c1, a2 = draw("actor"), draw("critic"), draw("actor")
    own = torch.Generator().manual_seed(derive_seed(5, "actor", "global"))
    assert torch.equal(torch.cat([a1, a2]), torch.rand(6, generator=own))
    assert torch.equal(c1, torch.rand(3, generator=torch.Generator().manual_seed(derive_seed(5, "critic", "global"))))
    before = torch.get_rng_state()
    with host._random_state("actor", "get_version"):   # not a stage: the process's generator is not swapped
        assert torch.equal(torch.get_rng_state(), before)
    host.workers["actor"].save(str(tmp_path / "actor"))
    a3 = draw("actor")
    host.workers["actor"].load(str(tmp_path / "actor"))
    assert torch.equal(draw("actor"), a3)   # restored to the state the checkpoint saved
