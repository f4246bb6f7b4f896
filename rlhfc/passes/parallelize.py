"""``parallelize`` (Baidu's system parallelism): launch independent stages together.

Stages that do not depend on each other — actor log-probs ∥ reference log-probs
∥ critic values ∥ reward scores after generation; actor training ∥ critic
training at the end — are given the same ``overlap = K`` group. The generated
driver launches a group's remote calls without waiting and waits only where a
driver-side stage needs their data, so workers of different models run at the
same time.

How groups are formed: each stage gets its ASAP level in the dependency DAG
(data edges, plus "reader before writer" edges of distance-1 parameter
versions, so a stage that must read last step's weights never moves after the
train stage that overwrites them). Stages are reordered by level (stable), and
each level's remote stages (model calls) on two or more *different* models
form a group. Calls on one model stay ordered: a worker runs its calls in
submission order.

Exact: every worker computes the same calls, in the same order, on the same
inputs; only the wall-clock overlap changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from rlhfc.ir import Module, get_op, plan

from .base import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class Parallelize(Pass):
    name = "parallelize"
    description = "run independent stages on different models concurrently (overlap groups)"
    exact = True
    min_group: int = field(default=2, metadata={"doc": "smallest number of models worth a group"})

    def __post_init__(self) -> None:
        if self.min_group < 2:
            raise ValueError("min_group must be at least 2")

    def run(self, module: Module) -> Module:
        g = module.graph
        dag = nx.DiGraph()
        index = {s.name: i for i, s in enumerate(g.stages)}
        for s in g.stages:
            dag.add_node(s.name)
            for p in g.predecessors(s):
                dag.add_edge(p.name, s.name)
        for e in g.versions:
            if e.distance == 1:  # the reader must see last step's weights: keep it before the writer
                dag.add_edge(e.reader, e.writer)
        level: dict[str, int] = {}
        for name in nx.lexicographical_topological_sort(dag, key=lambda n: index[n]):
            level[name] = max((level[p] + 1 for p in dag.predecessors(name)), default=0)
        g.stages.sort(key=lambda s: (level[s.name], index[s.name]))
        for s in g.stages:
            plan.set_overlap(s, None)
        group_id = 0
        for lvl in sorted(set(level.values())):
            remote = [s for s in g.stages if level[s.name] == lvl and _remote(s)]
            if len({s.target for s in remote}) < self.min_group:
                continue
            group_id += 1
            for s in remote:
                plan.set_overlap(s, group_id)
        module.refresh_versions()
        return module


def _remote(stage) -> bool:
    spec = get_op(stage.op)
    return spec is not None and spec.model == "model"
