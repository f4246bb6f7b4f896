"""``recompute``: which activations each trained model keeps for backward, and which it recomputes.

For every ``train`` stage (after ``placement``, so its devices, layout and micro-batch are known) the pass
traces the model's transformer block with ``torch.fx`` at the stage's micro-batch shape
(:mod:`rlhfc.passes.recompute_trace`: bytes autograd keeps per op, time to recompute each op) and chooses
(:mod:`rlhfc.passes.recompute_choice`):

- ``policy = auto`` (default) — keep everything (no recomputation) when the stage fits its devices' memory;
  else the least recompute time whose kept bytes fit what the device has left for the blocks' activations
  (capacity − the weights and training state resident there − logits − one block's recompute working set),
  by a knapsack over the block's ops;
- ``none`` / ``full`` / ``selective`` (Megatron's: recompute the core attention only) — that policy, traced;
- ``budget`` — the knapsack under ``budget`` bytes per device for the kept activations of all its blocks.

The decision is the stage's ``recompute`` annotation (:class:`rlhfc.ir.plan.Recompute`: the aten calls whose
outputs are kept, bytes kept per block before → after, seconds added); ``none`` leaves no annotation. The cost
model prices memory and time from those numbers, ``explain`` shows them, and the trainers apply them
(:mod:`rlhfc.runtime.models.recompute`; megatron: ``full``/``selective``, the nearest its settings express). A block that
cannot be traced (an unsupported architecture, a model from a folder) gets a located warning and the coarse
policy placement chose.

Exact: recomputation replays the same ops on the same inputs; gradients are unchanged (bitwise on CPU).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass, field

from rlhfc.cost import CostModel, ProfileError, fits, load_profile
from rlhfc.cost import formulas as F
from rlhfc.cost.hardware import device_spec
from rlhfc.cost.model import hw_numbers
from rlhfc.cost.profile import model_key
from rlhfc.cost.simulator import resident_bytes
from rlhfc.ir import Module, error, plan
from rlhfc.ir.plan import Recompute

from . import recompute_choice as choice
from .base import Pass, register_pass
from .recompute_prices import measured_dispatch, measured_ops, spec_costs, with_measured_ops, with_replay_costs
from .recompute_trace import trace_block

POLICIES = ("auto", "none", "full", "selective", "budget")


@register_pass
@dataclass(frozen=True)
class RecomputePass(Pass):
    name = "recompute"
    description = "per trained model, which block activations to keep vs recompute (torch.fx trace + knapsack)"
    exact = True
    policy: str = field(default="auto", metadata={"doc": "auto, none, full, selective or budget"})
    budget: int = field(default=0, metadata={"doc": "bytes per device for kept activations (policy budget)"})
    profile: str = field(default="", metadata={
        "doc": "measured profile whose rates price a recompute (a path, as explain's --profile; empty: catalog)"})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if self.policy == "budget" and self.budget <= 0:
            raise ValueError("policy budget needs budget = <bytes per device> (e.g. recompute{policy=budget,"
                             "budget=1000000})")

    def run(self, module: Module) -> Module:
        rates = replay_spec(module, self.profile)
        trains = []
        for s in [s for s in module.graph.stages if s.op == "train" and s.target in module.models]:
            why = traceable(module.models[s.target])
            if why is None:
                trains.append(s)
            else:   # said once; the stage keeps placement's coarse policy
                warnings.warn(f"{s.loc or module.models[s.target].loc or s.name}: warning: {why}; recompute keeps "
                              f"placement's coarse choice ({plan.recompute(s)})", stacklevel=2)
        # auto: each stage's budget is what its devices have left beside resident state; stages that overlap
        # on a device share it, so budgets tighten (1/2, 1/4, ...) until the plan fits or nothing is left
        for squeeze in ((1, 2, 4, 8, 16) if self.policy == "auto" else (1,)):
            for stage in trains:
                decision = decide(module, stage, self.policy, self.budget or None, squeeze=squeeze, rates=rates)
                if decision is not None:
                    plan.set_recompute(stage, decision)
            if self.policy != "auto" or fits(module):
                break
        return module


def traceable(model) -> str | None:
    """Why ``model``'s block cannot be traced (None when it can). A model from a Hugging Face folder is traced
    as a config-built one of its shape when its ``config.json`` builds the block the tracer builds (the same
    activation, biases, head width, attention variant and, with ``dropout = true``, no dropout): the runtime
    loads it into the same block class, whose ops the trace then names."""
    if model.arch not in ("llama", "gpt2"):
        return f"no block tracer for arch '{model.arch}'"
    if model.source:
        differs = block_config_differs(model.arch, model.source, model.heads, model.hidden,
                                       keeps_dropout=bool(getattr(model, "dropout", False)))
        if differs is not None:
            return (f"model '{model.name}' comes from a folder ({model.source}) whose config.json sets {differs}, "
                    "a block the tracer does not build; its block is not traced")
    return None


#: the block-building settings of a config.json, and the value the block tracer builds with
#: (:func:`rlhfc.passes.recompute_trace._hf_block`: the transformers config classes' defaults)
BLOCK_SETTINGS = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    "gpt2": {"activation_function": "gelu_new", "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
             "reorder_and_upcast_attn": False, "add_cross_attention": False},
}
#: dropout settings: the runtime zeroes them unless the model keeps the folder's (``dropout = true``)
DROPOUT_SETTINGS = {"llama": ("attention_dropout",), "gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop")}


def block_config_differs(arch: str, folder: str, heads: int, hidden: int, *, keeps_dropout: bool = False) -> str | None:
    """The first setting of ``folder``'s config.json that builds another block than the tracer's (``"hidden_act =
    'gelu'"``), or None when none does (a setting left out takes the transformers default, the tracer's)."""
    import json

    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return "nothing readable (config.json)"
    for key, default in BLOCK_SETTINGS[arch].items():
        if key in cfg and cfg[key] != default:
            return f"{key} = {cfg[key]!r}"
    head_dim = cfg.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != hidden:
        return f"head_dim = {head_dim!r} (not hidden / heads)"
    if keeps_dropout:
        for key in DROPOUT_SETTINGS[arch]:
            if cfg.get(key):
                return f"{key} = {cfg[key]!r} with dropout = true"
    return None


def replay_spec(module: Module, profile: str):
    """The device spec a recompute is priced with: the profile's (``rlhfc profile``: kind rates, fresh-output
    and checkpoint costs) when one is given for the cluster's device kind, else None (the cost model's)."""
    if not profile:
        return None
    try:
        prof = _load_profile(profile, os.path.getmtime(profile) if os.path.exists(profile) else 0.0)
    except ProfileError as exc:
        raise error(f"recompute: {exc}", None, "give a file `rlhfc profile` wrote, or no profile") from None
    return device_spec(module.cluster.device, prof) if prof.device_kind == module.cluster.device else None


@functools.lru_cache(maxsize=4)
def _load_profile(path: str, mtime: float):   # the search runs this pass on every candidate: read the file once
    return load_profile(path)


def stage_trace(module: Module, stage, cm=None, rates=None):
    """(trace of the stage's block at its micro-batch shape, cost model, the stage's price inputs);
    ``rates``: the device spec to price ops at (:func:`replay_spec`; None: the cost model's)."""
    cm = cm or CostModel(module)
    model = module.models[stage.target]
    layout = cm.layout(stage)
    inp = cm.price_inputs(stage, [layout])
    work, lay = inp.work, inp.lay
    rows = max(1, math.ceil(work["rows"] / work["minibatches"] / (float(lay["dp"][0]) * float(lay["mb"][0]))))
    seq = max(2, math.ceil(work["seq"]))
    spec = rates or cm.spec
    hw = hw_numbers(spec)
    scale = float(lay["f_scale"][0])
    bw = hw["BW"] * min(scale, 4.0)
    dims = (model.arch, model.hidden, model.heads, model.kv_heads, model.ffn, model.vocab)
    prices = dict(dtype="float32" if cm.spec.is_cpu else "bfloat16", flops_per_s=hw["F_train"] * scale,
                  bytes_per_s=bw, kind_bw=tuple((k, bw * eff) for k, eff in spec.kind_eff))
    # what the replay pays beyond the ops' work (fresh outputs, the checkpoint itself): measured by a profile
    key = model_key(model)
    costs = spec_costs(spec)
    own_call = measured_dispatch(spec, key)
    if own_call is not None:   # a selective checkpoint's forward call, measured on this model's block at its shape
        costs["ckpt_forward_op_s"] = own_call
    trace = with_replay_costs(trace_block(*dims, rows, seq, **prices), **costs)
    own = measured_ops(spec, key)
    if own is not None:   # the ops as measured on this block at its training shape (`rlhfc profile` with the program)
        one = dict(prices, flops_per_s=hw["F_train"], bytes_per_s=hw["BW"],   # measured at one thread
                   kind_bw=tuple((k, hw["BW"] * eff) for k, eff in spec.kind_eff))
        trace = with_measured_ops(trace, with_replay_costs(trace_block(*dims, own[0], own[1], **one), **costs), own[2])
    return trace, cm, inp


def train_shapes(module: Module) -> dict[str, tuple[int, int]]:
    """``{model key: (rows, seq)}``: the micro-batch each trained, traceable model's block trains at under
    ``module``'s plan (what ``rlhfc profile`` measures the checkpoint's costs at; the first stage's where a model
    trains in several)."""
    out: dict[str, tuple[int, int]] = {}
    for s in module.graph.stages:
        model = module.models.get(s.target)
        if s.op != "train" or model is None or traceable(model) is not None:
            continue
        try:
            trace = stage_trace(module, s)[0]
        except Exception:   # an untraceable block: nothing to measure (the pass warns when it compiles)
            continue
        out.setdefault(model_key(model), (trace.rows, trace.seq))
    return out


def block_budget(module: Module, stage, trace, cm, inp, recompute: bool) -> float:
    """Bytes one block may keep per micro-batch (its input aside) so that the stage fits its devices."""
    n = module.cluster.nodes * module.cluster.per_node
    resident = resident_bytes(module, {s.name: cm.stage_cost(s) for s in module.graph.stages}, n, cm)
    layout = cm.layout(stage)
    held = {id(resident[d]): resident[d] for d in layout.devices if d < n}   # runs of devices share one dict
    static = max((sum(h.values()) for h in held.values()), default=0.0)
    capacity = cm.spec.memory
    work = dict(inp.work, rc_kept=0.0, rc_autograd=float(trace.autograd_bytes), rc_seconds=1.0 if recompute else 0.0)
    base = float(F.traced_train_activation_bytes(__import__("numpy"), inp.hw, inp.arch, work, inp.lay)[0])
    lay = inp.lay
    blocks = inp.arch["L"] / float(lay["pp"][0]) * min(float(lay["mb"][0]), float(lay["pp"][0])) / float(lay["tp"][0])
    return (capacity - static - base) / blocks


#: knapsack answers by (trace, budget): a placement search asks again for every candidate plan that leaves a stage
#: the same layout and memory (the trace is kept beside its answer, so its id is not reused)
_WITHIN: dict[tuple[int, float], tuple] = {}


def _within(trace, budget: float):
    """:func:`rlhfc.passes.recompute_choice.within`, memoised (it is pure)."""
    key = (id(trace), budget)
    if key not in _WITHIN:
        if len(_WITHIN) > 4096:
            _WITHIN.clear()
        _WITHIN[key] = (trace, choice.within(trace, budget))
    return _WITHIN[key][1]


def decide(module: Module, stage, policy: str, budget: float | None = None, squeeze: int = 1,
           rates=None) -> Recompute | None:
    """The decision for one train stage (None: leave the stage as it is); ``squeeze``: auto's budget is
    1/squeeze of what the stage's devices have left; ``rates``: :func:`replay_spec`."""
    model = module.models[stage.target]
    if traceable(model) is not None:
        return None
    try:
        trace, cm, inp = stage_trace(module, stage, rates=rates)
    except Exception as exc:   # a block torch.fx cannot trace: say where, keep the coarse policy
        warnings.warn(f"{stage.loc or stage.name}: warning: tracing the block of '{model.name}' failed "
                      f"({type(exc).__name__}: {exc}); recompute keeps placement's coarse choice "
                      f"({plan.recompute(stage)})", stacklevel=2)
        return None
    plan.set_recompute(stage, Recompute("none"))   # price the stage afresh, without any earlier decision
    fit = None
    if policy in ("none", "full", "selective"):
        chosen = choice.choose(trace, policy)
    elif policy == "budget":
        lay = inp.lay
        blocks = inp.arch["L"] / float(lay["pp"][0]) * min(float(lay["mb"][0]), float(lay["pp"][0]))
        fit = budget / blocks
        chosen = choice.within(trace, fit)
    else:   # auto: no recomputation when everything fits, else the knapsack under what is left
        fit = block_budget(module, stage, trace, cm, inp, recompute=False) / squeeze
        if trace.autograd_bytes <= fit:
            return Recompute("none")
        fit = block_budget(module, stage, trace, cm, inp, recompute=True) / squeeze
        chosen = _within(trace, max(fit, 0.0))
    if chosen.policy == "none":
        return Recompute("none")   # nothing recomputed: no annotation
    return Recompute(chosen.policy, chosen.save, int(chosen.saved_bytes),
                     int(trace.autograd_bytes), float(f"{chosen.recompute_s:.4g}"),
                     None if fit is None else max(0, int(fit)))
