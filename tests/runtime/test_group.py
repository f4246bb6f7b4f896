"""WorkerGroup: the handle the generated step function calls (one rank, or dp > 1 data-parallel ranks)."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

from rlhfc.runtime.driver.group import WorkerGroup
from rlhfc.runtime.errors import JobError


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args, **kwargs):
        self.actor.calls.append((self.name, args, kwargs))
        return f"ref:{self.actor.tag}:{self.name}"


class FakeActor:
    """Stands in for a Ray actor handle: each method has ``.remote`` returning a fake reference."""

    METHODS = ("generate", "generate_chunks", "train", "sync_export", "sync_import", "save", "ready", "logprobs",
               "sync_open")

    def __init__(self, tag):
        self.tag, self.calls = tag, []

    def __getattr__(self, name):
        if name in self.METHODS:
            return _Method(self, name)
        raise AttributeError(name)


def test_one_rank_forwards_every_call_to_rank_0_unchanged():
    actor = FakeActor("a0")
    group = WorkerGroup("actor", [actor], model="actor")
    assert group.size == 1 and group.ranks == [actor]
    assert group.train.remote("loss", lr=0.1, epochs=1) == "ref:a0:train"
    assert group.generate_chunks.remote(["p"], carry=[], chunk=2) == "ref:a0:generate_chunks"
    assert actor.calls == [("train", ("loss",), {"lr": 0.1, "epochs": 1}),
                           ("generate_chunks", (["p"],), {"carry": [], "chunk": 2})]
    with pytest.raises(AttributeError):
        group.no_such_method          # as on the actor itself
    assert "actor" in repr(group) and "ranks=1" in repr(group)


def test_group_survives_copy_and_pickle():
    group = WorkerGroup("critic", ["handle"], model="critic")
    for clone in (copy.copy(group), pickle.loads(pickle.dumps(group))):
        assert clone.name == "critic" and clone.ranks == ["handle"]


def test_more_than_one_rank_splits_rows_or_runs_every_rank(monkeypatch):
    """dp > 1: every rank gets the call; the gather actor joins the ranks' rows (forwards) or answers with
    rank 0's result once all are done (collectives); rank 0 streams; collective syncs are refused."""
    import rlhfc.runtime.driver.group as grp

    class Task:
        def __init__(self, kind):
            self.kind = kind

        def remote(self, group, rule, refs):
            return (group, rule, tuple(refs))

    monkeypatch.setattr(grp, "_gather", lambda ray: Task("gather"))
    a0, a1 = FakeActor("a0"), FakeActor("a1")
    group = WorkerGroup("actor", [a0, a1])
    assert group.size == 2
    assert group.logprobs.remote("roll", temperature=1.0) == ("actor", "split", ("ref:a0:logprobs", "ref:a1:logprobs"))
    assert group.train.remote("loss", lr=0.1) == ("actor", "all", ("ref:a0:train", "ref:a1:train"))
    assert group.generate_chunks.remote(["p"], chunk=2) == "ref:a0:generate_chunks"
    assert group.pending == ["ref:a1:generate_chunks"]
    assert a0.calls == a1.calls
    with pytest.raises(JobError, match=r"worker group 'actor' has 2 ranks, but 'sync_open' cannot run on a "
                                       r"data-parallel group yet") as exc:
        group.sync_open.remote("sync")
    assert "object_store" in exc.value.hint


def test_empty_group_is_refused():
    with pytest.raises(ValueError, match="at least one rank"):
        WorkerGroup("actor", [])


def test_group_attributes_do_not_shadow_worker_methods():
    from rlhfc.runtime.worker.base import ModelWorker
    from rlhfc.runtime.worker.dispatch import MODES, dispatch_mode, dispatched

    worker_methods = {n for n, _ in inspect.getmembers(ModelWorker, inspect.isfunction) if not n.startswith("_")}
    group_attrs = {n for n in dir(WorkerGroup) if not n.startswith("_")} | {"name", "model", "ranks", "pending"}
    assert not worker_methods & group_attrs
    modes = dispatched(ModelWorker)
    assert set(modes) <= worker_methods and set(modes.values()) <= set(MODES)
    # the forwards split their rows; generation, training, weights and checkpoints run on every rank
    assert {m for m, how in modes.items() if how == "split"} == {"logprobs", "values", "score"}
    assert modes["generate_chunks"] == "stream"
    assert {"generate", "train", "save", "load", "get_weights", "set_weights", "sync_export", "sync_import",
            "reshard", "ready"} <= {m for m, how in modes.items() if how == "all"}
    assert dispatch_mode(ModelWorker, "sync_send") is None   # collective syncs: one-rank groups only


def test_job_module_keeps_its_names_and_runtime_imports_no_compiler_code():
    import ast
    import os

    import rlhfc.runtime as rt
    from rlhfc.runtime.job import Job, main, run_job  # noqa: F401
    from rlhfc.runtime.job import JobError as JobError2

    assert JobError2 is JobError
    folder = os.path.dirname(rt.__file__)
    compiler = ("rlhfc.ir", "rlhfc.frontend", "rlhfc.passes", "rlhfc.cost", "rlhfc.codegen", "rlhfc.explain",
                "rlhfc.cli")
    for fname in sorted(os.listdir(folder)):
        if not fname.endswith(".py"):
            continue
        path = os.path.join(folder, fname)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        assert len(text.splitlines()) < 500 or "Why this file is long:" in text[:3000], f"{fname} is over 500 lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                mods = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for m in mods:
                assert not m.startswith(compiler) and not m.startswith(".."), f"{fname} imports {m}"


@pytest.mark.e2e
def test_group_answers_and_fails_fast_naming_the_rank(tmp_path):
    """The group's answer task joins the ranks that answer (None: no share) and fails as soon as one rank
    dies or raises — not when the ranks blocked on the failed one time out."""
    import time

    from rlhfc.runtime.driver.cluster import import_ray
    from rlhfc.runtime.driver.group import RankFailed

    class _Rank:   # defined here: Ray pickles it by value
        """A stand-in rank: answers, dies, or blocks as a rank waiting in a collective does."""

        def __init__(self, rank):
            self.rank = rank

        def logprobs(self, how):
            import os
            import time

            if how[self.rank] == "die":
                os._exit(1)
            if how[self.rank] == "raise":
                raise ValueError("the loss is nan")
            if how[self.rank] == "block":
                time.sleep(120)
            return None if how[self.rank] == "none" else torch.full((1, 2), float(self.rank))

    ray = import_ray()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        cls = ray.remote(num_cpus=0, max_restarts=0)(_Rank)
        group = WorkerGroup("critic", [cls.remote(i) for i in range(3)])
        joined = ray.get(group.logprobs.remote(("ok", "none", "ok")))
        assert joined.tolist() == [[0.0, 0.0], [2.0, 2.0]]
        for how, said in ((("block", "die", "block"), r"rank 1 of worker group 'critic' died"),
                          (("block", "block", "raise"), r"rank 2 of worker group 'critic' failed: ValueError: "
                                                        r"the loss is nan")):
            group = WorkerGroup("critic", [cls.remote(i) for i in range(3)])
            t0 = time.perf_counter()
            with pytest.raises(ray.exceptions.RayTaskError) as exc:
                ray.get(group.logprobs.remote(how), timeout=60)
            assert isinstance(exc.value.cause, RankFailed)
            assert __import__("re").search(said, str(exc.value.cause))
            assert time.perf_counter() - t0 < 30
    finally:
        ray.shutdown()


def test_the_gather_actor_is_one_per_ray_session(monkeypatch):
    """One gather actor answers every group call of a Ray session; a Ray started again in the same process (a
    benchmark's next job, the next test module) gets its own — the old one went with the old Ray."""
    import rlhfc.runtime.driver.group as grp

    made = []

    class FakeRay:
        node = "n1"

        def get_runtime_context(self):
            return type("C", (), {"get_node_id": lambda _: FakeRay.node, "get_job_id": lambda _: "01000000"})()

        def remote(self, **options):
            assert options["num_cpus"] == 0 and options["max_concurrency"] > 100
            def wrap(cls):
                def start():
                    made.append(cls)
                    return type("Handle", (), {"gather": len(made)})()
                return type("A", (), {"remote": staticmethod(start)})
            return wrap

    monkeypatch.setattr(grp, "_GATHERERS", {})
    ray = FakeRay()
    first = grp._gather(ray)
    assert grp._gather(ray) == first and len(made) == 1
    FakeRay.node = "n2"   # ray.shutdown(); ray.init(): the same job id on a new node
    assert grp._gather(ray) != first and len(made) == 2 and made[-1] is grp._Gatherer
