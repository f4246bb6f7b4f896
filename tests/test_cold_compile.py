"""The first compile's shortcuts change no number: each fast path equals the plain computation it replaced.

(The cold search's speed: docs/benchmarks.md, "The search's rate".) Tiny inputs only."""

from __future__ import annotations

import gc
import itertools
import random

import pytest

from rlhfc.cost import sync
from rlhfc.cost.simulator import _runs
from rlhfc.ir.plan import Layout
from rlhfc.passes import recompute_choice
from rlhfc.passes.recompute_trace import BlockTrace, OpNode


def _plain_knapsack(items, budget):
    """The 0/1 knapsack as one loop per capacity (what ``_knapsack`` computes a row at a time)."""
    units = recompute_choice.UNITS
    unit = budget / units
    best, keep = [0.0] * (units + 1), []
    for n in items:
        w = int(-(-n.bytes // unit))
        row = [False] * (units + 1)
        for cap in range(units, w - 1, -1):
            if best[cap - w] + n.seconds > best[cap]:
                best[cap], row[cap] = best[cap - w] + n.seconds, True
        keep.append(row)
    save, cap = set(), units
    for n, row in zip(reversed(items), reversed(keep)):
        if row[cap]:
            save.add(n.key)
            cap -= int(-(-n.bytes // unit))
    return save


def test_knapsack_rows_equal_the_plain_loop():
    rng = random.Random(0)
    for _ in range(40):
        items = [OpNode(f"n{i}", f"mm.default#{i}", rng.randint(1, 10**6), 0, rng.random() * 1e-3, 0.0, False)
                 for i in range(rng.randint(1, 40))]
        total = sum(n.bytes for n in items)
        for budget in (rng.random() * total, total / 3, max(n.bytes for n in items)):
            fit = [n for n in items if n.bytes <= budget]
            assert recompute_choice._knapsack(fit, budget) == _plain_knapsack(fit, budget)
    # and through within(): the choice a trace gets
    nodes = tuple(OpNode(f"n{i}", f"add.Tensor#{i}", (i * 7919) % 1000 + 1, 0, ((i * 31) % 17 + 1) * 1e-5, 0.0,
                         i % 5 == 0, True) for i in range(30))
    trace = BlockTrace("llama", 2, 8, nodes, sum(n.bytes for n in nodes), 64, sum(n.seconds for n in nodes))
    chosen = recompute_choice.within(trace, trace.autograd_bytes / 2)
    assert chosen.saved_bytes <= trace.autograd_bytes / 2 and chosen.policy == "ops"


def _plain_sync_time(weight_bytes, src, dst, intra, inter, per_node):
    """Weight-sync time summed over every (destination device, source piece) pair."""
    cells = {}
    for sh in sync.shards(src):
        cells.setdefault((sh.layers, sh.cols), []).append(sh.device)
    worst = 0.0
    for want in sync.shards(dst):
        seconds = 0.0
        for (layers, cols), holders in cells.items():
            part = sync._overlap(want.layers, layers) * sync._overlap(want.cols, cols)
            if part <= 0 or want.device in holders:
                continue
            near = any(h // per_node == want.device // per_node for h in holders)
            seconds += weight_bytes * part / (intra if near else inter)
        worst = max(worst, seconds)
    return sync.RESHARD_SETUP_S + worst


def test_sync_time_equals_the_sum_over_every_source_piece():
    layouts = [Layout(first, count, count // (tp * pp), tp, pp) for first in (0, 3) for count in (2, 4, 8)
               for tp in (1, 2, 4) for pp in (1, 2) if count % (tp * pp) == 0]
    for src, dst in itertools.product(layouts, layouts):
        for per_node in (2, 8):
            args = (1.4e11, src, dst, 3e11, 2.5e10, per_node)
            assert sync._sync_time(*args) == _plain_sync_time(*args)   # bit for bit: same terms, same order


@pytest.mark.parametrize("devices", [[0, 1, 2, 3], [4, 5], [0, 1, 3, 4], [2, 1, 0], [-1], [-1, 0, 1], [6, 7, 8, 9],
                                     [], [5]])
def test_device_runs(devices):
    plain = []
    for d in devices:
        if 0 <= d < 8:
            if plain and plain[-1][1] == d:
                plain[-1][1] = d + 1
            else:
                plain.append([d, d + 1])
    assert _runs(devices, 8) == [tuple(r) for r in plain]


def test_search_collects_young_objects_less_often_and_restores_the_thresholds():
    from rlhfc.passes.search import GC_GEN0, _fewer_collections

    before = gc.get_threshold()
    with _fewer_collections():
        assert gc.get_threshold()[0] == max(GC_GEN0, before[0]) and gc.get_threshold()[1:] == before[1:]
    assert gc.get_threshold() == before


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("gpt2", "eager")])
def test_block_inputs_are_those_automodel_builds(arch, attn):
    """The traced block's inputs come from the model class itself; AutoModel's model gives the same ones."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.utils._pytree import tree_flatten

    from rlhfc.passes import recompute_trace as T

    p = T._PROXY
    cfg = T._hf_block(arch, p["heads"] * p["head_dim"], p["heads"], p["heads"], 16, 11, attn)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg)
    block = model.layers[0] if arch == "llama" else model.h[0]
    seen = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    ids = torch.ones(p["rows"], p["seq"], dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    hook.remove()
    want, want_spec = tree_flatten((seen["args"], seen["kwargs"]))
    got, got_spec = tree_flatten(T._block_inputs(arch, attn))
    assert got_spec == want_spec and len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b


# -- the traced blocks that ship with rlhfc ------------------------------------------------------------------

def _bundle():
    import json
    import os

    from rlhfc.passes.trace_cache import BUNDLED

    return {tuple(d["key"]): d for d in (json.load(open(os.path.join(BUNDLED, f), encoding="utf-8"))
                                          for f in sorted(os.listdir(BUNDLED)))}


def _bundle_versions() -> tuple:
    from rlhfc.passes.trace_cache import _versions

    made = {tuple(d["versions"]) for d in _bundle().values()}
    assert len(made) == 1, f"the shipped traces were made under several versions: {made}"
    return made.pop(), _versions()


def test_every_size_preset_ships_its_traced_block():
    from rlhfc.passes.trace_cache import bundled_keys

    assert set(_bundle()) == set(bundled_keys()) and len(bundled_keys()) == 16


def test_shipped_traces_are_what_tracing_gives_now(tmp_path, monkeypatch):
    """Read with an empty cache under the versions they were made with, they equal a fresh trace (so they are
    current): python -m rlhfc.passes.recompute_trace writes them anew."""
    made, installed = _bundle_versions()
    if made != installed:
        pytest.skip(f"shipped traces are for torch/transformers {made}, installed {installed}: not used here")
    from rlhfc.passes import trace_cache
    from rlhfc.passes.recompute_trace import traced

    monkeypatch.setenv("RLHFC_CACHE_DIR", str(tmp_path))
    for key in (("gpt2", 768, 12, 12, 3072, 50257, "bfloat16", "sdpa"),
                ("llama", 8192, 64, 8, 28672, 32000, "bfloat16", "eager")):
        assert trace_cache.load(key) == traced(key)
    assert not list(tmp_path.rglob("*.json"))     # read from the package, nothing written


def test_first_compile_of_a_preset_imports_neither_torch_nor_transformers(tmp_path):
    made, installed = _bundle_versions()
    if made != installed:
        pytest.skip(f"shipped traces are for torch/transformers {made}, installed {installed}: not used here")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = ("import sys\nfrom rlhfc.frontend import load_file\nfrom rlhfc.passes import PassManager, parse_pipeline\n"
            "from rlhfc.passes.pipelines import PIPELINES\n"
            f"m, _, _ = load_file({str(root / 'examples' / 'ppo_70b.rlhf')!r})\n"
            "p = ','.join(PIPELINES['O2']).replace('placement', 'placement{candidates=30}', 1)\n"
            "m = PassManager(parse_pipeline(p)).run(m)\n"
            "assert any(s.op == 'train' and 'recompute' in s.annotations for s in m.graph.stages)\n"
            "print(sorted(x for x in ('torch', 'transformers') if x in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RLHFC_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_squeeze_retries_skipped_as_unchanged_leave_the_plain_loops_plan(monkeypatch):
    """``layouts.apply_fitting`` (a retry that would pick the layouts of the one before is skipped, the last is
    not checked) annotates every plan as the plain loop did: apply at 1, 2, 4, 8 until it fits."""
    import os
    import random

    from rlhfc.cost import fits
    from rlhfc.frontend import load_file
    from rlhfc.passes import PassManager, parse_pipeline
    from rlhfc.passes import layouts
    from rlhfc.passes.layouts import apply, apply_fitting, model_stages
    from rlhfc.passes.pipelines import PIPELINES
    from rlhfc.passes.search import candidate_meshes
    from rlhfc.passes.strategies import flatten, interleave, separate

    calls = []
    monkeypatch.setattr(layouts, "apply", lambda *a, **k: calls.append(k["squeeze"]) or apply(*a, **k))

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rng, checked, skipped, retried = random.Random(0), 0, {True: 0, False: 0}, 0
    for name in ("ppo_70b", "ppo_7b"):
        base, _, _ = load_file(os.path.join(root, "examples", f"{name}.rlhf"))
        base = PassManager(parse_pipeline(",".join(PIPELINES["O2"][:PIPELINES["O2"].index("placement")]))).run(base)
        by_model = model_stages(base)
        meshes = candidate_meshes(base.cluster.num_devices, base.cluster.per_node)
        plans = [flatten(base), interleave(base), separate(base)]
        for _ in range(12):   # random meshes per model, as the search proposes them
            pick = {m: rng.choice(meshes) for m in by_model}
            plans.append({s.name: pick[m] for m, stages in by_model.items() for s in stages})
        for assign in plans:
            plain, fast = base.clone(), base.clone()
            tried = 0
            for squeeze in (1, 2, 4, 8):
                apply(plain, assign, squeeze=squeeze)
                tried += 1
                if fits(plain):
                    break
            calls.clear()
            apply_fitting(fast, assign, fits)
            assert [s.annotations for s in fast.graph.stages] == [s.annotations for s in plain.graph.stages]
            skipped[len(calls) < tried] += 1
            retried += len(calls) > 1
            checked += 1
    # both paths taken: retries skipped as unchanged, and retries that chose other layouts
    assert checked == 30 and skipped[True] and skipped[False] and retried
