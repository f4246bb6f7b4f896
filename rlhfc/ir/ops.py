"""Signatures of every stage op: operands, attributes and result types.

One table serves the frontend (type checking a program) and the verifier
(checking IR after every pass), so the two can never disagree. Passes that
introduce new ops (``sync``, ``offload`` …) register their spec here with
:func:`register_op`.

An op is named ``family`` or ``family.kind`` (``generate``, ``forward.logprobs``,
``compute.gae``). The language spells them as calls: ``actor.generate(...)`` →
``generate``, ``actor.logprobs(...)`` → ``forward.logprobs``, ``gae(...)`` →
``compute.gae``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import ALL_KINDS, ValueType

#: attribute kinds (a ``float`` attribute holds a Python float; the language also accepts sizes like ``4K`` for ints)
ATTR_KINDS = ("int", "float", "str", "bool")


@dataclass(frozen=True)
class Operand:
    """A positional input. ``kinds``: the value types accepted; ``optional`` operands come last."""

    name: str
    kinds: tuple[str, ...]
    optional: bool = False
    doc: str = ""


@dataclass(frozen=True)
class Attr:
    """A keyword attribute. ``default`` None with ``required`` means the program must give it."""

    name: str
    kind: str
    default: object = None
    required: bool = False
    choices: tuple = ()
    min: float | None = None
    max: float | None = None
    doc: str = ""
    #: left out of a stage while it holds its default (lowering drops it; the verifier does not ask for it;
    #: codegen passes only what the stage holds, so the runtime function's keyword default must equal
    #: ``default``): options added after the IR's first version leave existing IR, plans and jobs unchanged
    omit_default: bool = False
    #: a value a hint may suggest (for an attribute without a default)
    example: object = None


#: how code generation runs an op (:class:`Emit` kinds)
EMIT_KINDS = ("worker", "compute", "load", "sync")


@dataclass(frozen=True)
class Emit:
    """How a compiled job runs an op — the emit rule, registered with the op's spec.

    ``kind``: ``worker`` (a call of ``target``, a method of the model's worker group), ``compute`` (a
    driver-side function ``target`` = ``"module:function"``, called with the operands' values and the
    attributes as keywords), ``load`` (prompts drawn on the driver) or ``sync`` (a weight transfer).
    ``flags``: boolean plan annotations passed to the call as keywords when set (``unpad``, ``logprobs``).
    """

    kind: str
    target: str = ""
    flags: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def function(self) -> str:
        return self.target.partition(":")[2]


#: where the built-in driver-side ops live at run time
COMPUTE_MODULE = "rlhfc.runtime.compute"


def default_emit(op: str, model: str | None) -> Emit | None:
    """The emit rule of an op that registers none: model ops call the worker method named after the op
    (``forward.logprobs`` -> ``logprobs``); ``compute.X`` calls ``rlhfc.runtime.compute:X``."""
    family, _, kind = op.partition(".")
    if op == "load":
        return Emit("load")
    if op == "sync":
        return Emit("sync")
    if model == "model":
        return Emit("worker", kind or family)
    if family == "compute" and kind:
        return Emit("compute", f"{COMPUTE_MODULE}:{kind}")
    return None


@dataclass(frozen=True)
class OpSpec:
    """How an op is typed.

    ``model``: ``None`` (no model), ``"model"`` (a model call) or ``"data"`` (a data source).
    ``head``: the model head the op needs (``lm``/``value``/``score``), if any.
    ``trains``: the op updates the model's weights (needs a ``trainable`` model).
    ``results``: result type kinds; ``batch_from``: how result batch sizes follow
    (``"operand0"`` — the first operand's; ``"attr:batch"`` — an attribute;
    ``"operand0*attr:n"`` — first operand's batch times attribute ``n``).
    ``pure``: no side effect, so the stage may be removed when its results are unused.
    ``emit``: how a compiled job runs it (:class:`Emit`; None: :func:`default_emit`), so a plugin op
    compiles, not only checks.
    """

    op: str
    operands: tuple[Operand, ...]
    attrs: tuple[Attr, ...]
    results: tuple[str, ...]
    model: str | None = None
    head: str | None = None
    trains: bool = False
    batch_from: str = "operand0"
    pure: bool = True
    doc: str = ""
    internal_attrs: tuple[str, ...] = field(default=())
    emit: Emit | None = None

    @property
    def emit_rule(self) -> Emit | None:
        return self.emit or default_emit(self.op, self.model)

    @property
    def family(self) -> str:
        return self.op.split(".", 1)[0]

    def attr(self, name: str) -> Attr | None:
        return next((a for a in self.attrs if a.name == name), None)

    def min_operands(self) -> int:
        return sum(1 for o in self.operands if not o.optional)

    def result_types(self, operand_types: list[ValueType], attrs: dict) -> list[ValueType]:
        """The result types for these operands/attrs (call after operands are checked)."""
        batch: int | None = None
        if self.batch_from == "operand0" and operand_types:
            batch = operand_types[0].batch
        elif self.batch_from.startswith("attr:"):
            batch = int(attrs[self.batch_from[5:]])
        elif self.batch_from.startswith("operand0*attr:") and operand_types:
            batch = (operand_types[0].batch or 0) * int(attrs.get(self.batch_from.split(":", 1)[1], 1))
        return [ValueType(k, None if k == "Metrics" else batch) for k in self.results]


_OPS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    """Make an op known to the frontend and verifier. Re-registering the same name replaces it.

    Raises ValueError for a malformed spec (unknown attribute kind, result type
    or ``model`` value, a required operand after an optional one).
    """
    for a in spec.attrs:
        if a.kind not in ATTR_KINDS:
            raise ValueError(f"op {spec.op}: attribute '{a.name}' has unknown kind {a.kind!r} "
                             f"(kinds: {', '.join(ATTR_KINDS)})")
    for k in spec.results + tuple(t for o in spec.operands for t in o.kinds):
        if k not in ALL_KINDS:
            raise ValueError(f"op {spec.op}: unknown value type {k!r} (types: {', '.join(ALL_KINDS)})")
    if spec.model not in (None, "model", "data"):
        raise ValueError(f"op {spec.op}: model must be None, 'model' or 'data', got {spec.model!r}")
    rule = spec.emit_rule
    if rule is not None and (rule.kind not in EMIT_KINDS or (rule.kind == "compute" and not
                                                              (rule.module and rule.function))):
        raise ValueError(f"op {spec.op}: emit rule {rule} must have a kind in {', '.join(EMIT_KINDS)}; a compute "
                         "rule names its function as 'module:function'")
    optional = [o.optional for o in spec.operands]
    if optional != sorted(optional):
        raise ValueError(f"op {spec.op}: optional operands must come last")
    _OPS[spec.op] = spec
    return spec


def get_op(name: str) -> OpSpec | None:
    return _OPS.get(name)


def all_ops() -> dict[str, OpSpec]:
    return dict(_OPS)


_TF = ("TokenFloat",)
#: group_advantages methods
GROUP_METHODS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
#: policy-loss aggregations (token_mean: every token of the minibatch weighs the same — the default)
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
#: learning-rate schedules of train
LR_SCHEDULES = ("constant", "linear", "cosine")
#: ops whose operands may have different batch sizes
MIXED_BATCH_OPS = ("train", "compute.remax")
_KL = Attr("estimator", "str", "k1", choices=("k1", "k2", "k3"),
           doc="KL estimator: k1 = logp-ref, k2 = (logp-ref)^2/2, k3 = exp(ref-logp)-1-(ref-logp)")

register_op(OpSpec(
    "load", (), (Attr("batch", "int", required=True, min=1, doc="prompts per step"),),
    ("Prompts",), model="data", batch_from="attr:batch",
    doc="draw the next batch of prompts from a data source"))

register_op(OpSpec(
    "generate", (Operand("prompts", ("Prompts",)),),
    (Attr("max_new_tokens", "int", 32, min=1, doc="longest response"),
     Attr("temperature", "float", 1.0, min=0.0, doc="sampling temperature (0 = greedy)"),
     Attr("top_p", "float", 1.0, min=0.0, max=1.0, doc="nucleus sampling mass"),
     Attr("n", "int", 1, min=1, max=4096, doc="samples per prompt (GRPO/RLOO groups)"),
     Attr("chat", "bool", False, omit_default=True,
          doc="wrap each prompt as a user turn in the model's chat template (its local HF tokenizer's)"),
     Attr("tools", "str", "", omit_default=True,
          doc="the declared tools the policy may call, comma-separated (a multi-turn generate)"),
     Attr("env", "str", "", omit_default=True,
          doc="the declared environment each trajectory acts in (a multi-turn generate)"),
     Attr("max_turns", "int", 1, min=1, max=64, omit_default=True,
          doc="policy turns per trajectory (tool results between them); the whole trajectory fits max_new_tokens"),
     Attr("turn_tokens", "int", 0, min=0, omit_default=True,
          doc="most tokens one turn decodes (0 = max_new_tokens)")),
    ("Rollout",), model="model", head="lm", batch_from="operand0*attr:n",
    emit=Emit("worker", "generate", flags=("unpad", "logprobs")),
    pure=False,  # sampling advances the worker's RNG stream: removing an unused generate would change later samples
    doc="sample responses to prompts"))

register_op(OpSpec(
    "forward.logprobs", (Operand("rollout", ("Rollout",)),),
    (Attr("temperature", "float", 1.0, min=0.0, doc="divide logits by this before log-softmax"),),
    _TF, model="model", head="lm", doc="log-probability of each response token"))

register_op(OpSpec(
    "forward.values", (Operand("rollout", ("Rollout",)),), (),
    _TF, model="model", head="value", doc="value estimate at each response token"))

register_op(OpSpec(
    "forward.score", (Operand("rollout", ("Rollout",)),), (),
    ("SeqFloat",), model="model", head="score", doc="reward-model score of each sequence"))

register_op(OpSpec(
    "compute.rule", (Operand("rollout", ("Rollout",)),),
    (Attr("fn", "str", required=True, doc="'module:function' taking (prompt, response, data fields) -> float"),
     Attr("extract", "str", "", doc="how the answer is cut out of each response before the rule sees it: "
                                    "strip, first_line, last_line, first_number, last_number, boxed, "
                                    "after:MARK, re:PATTERN ('' = the whole response)", omit_default=True)),
    ("SeqFloat",), doc="score each sequence with a Python rule function"))

register_op(OpSpec(
    "compute.sample_logprobs", (Operand("rollout", ("Rollout",)),),
    (Attr("temperature", "float", 1.0, min=0.0, doc="the generate's temperature (log-softmax of logits / T)"),),
    _TF, doc="the log-probs the generating model's sampling kept (generate annotated logprobs = true; "
             "inserted by reuse_logprobs in place of the generating model's forward.logprobs)"))

register_op(OpSpec(
    "compute.kl_penalty",
    (Operand("scores", ("SeqFloat", "TokenFloat"), doc="sequence scores, or per-token rewards (env_turn_rewards)"),
     Operand("logp", _TF), Operand("ref_logp", _TF)),
    (Attr("coef", "float", 0.05, min=0.0, doc="KL coefficient"), _KL),
    _TF, doc="per-token rewards: -coef*KL on every token, plus the score on the last (or each token's reward)"))

register_op(OpSpec(
    "compute.gae",
    (Operand("rewards", ("SeqFloat", "TokenFloat"), doc="sequence scores or per-token rewards"),
     Operand("values", _TF),
     Operand("logp", _TF, optional=True), Operand("ref_logp", _TF, optional=True)),
    (Attr("gamma", "float", 1.0, min=0.0, max=1.0, doc="discount"),
     Attr("lam", "float", 0.95, min=0.0, max=1.0, doc="GAE lambda"),
     Attr("kl_coef", "float", 0.05, min=0.0, doc="KL penalty when logp/ref_logp are given"),
     _KL,
     Attr("whiten", "bool", True, doc="whiten advantages over the batch")),
    ("TokenFloat", "TokenFloat"),
    doc="generalised advantage estimation -> (advantages, returns)"))

register_op(OpSpec(
    "compute.group_advantages",
    (Operand("rollout", ("Rollout",)), Operand("scores", ("SeqFloat",)),
     Operand("logp", _TF, optional=True, doc="with ref_logp: token-level KL in the reward (reinforce_pp)"),
     Operand("ref_logp", _TF, optional=True)),
    (Attr("method", "str", "grpo", choices=GROUP_METHODS,
          doc="grpo: (s-mean)/std; rloo: leave-one-out baseline; reinforce_pp: return-to-go normalised over the "
              "batch; reinforce_pp_baseline: the same after subtracting the group mean"),
     Attr("normalize_std", "bool", True, doc="divide by the group std (grpo)"),
     Attr("group", "int", 1, min=1, doc="samples per prompt; set from the generate stage's n"),
     Attr("kl_coef", "float", 0.01, min=0.0, omit_default=True,
          doc="token-level KL penalty in the reward when logp/ref_logp are given (reinforce_pp)"),
     Attr("estimator", "str", "k1", choices=("k1", "k2", "k3"), omit_default=True,
          doc="KL estimator of the reward's KL term (reinforce_pp)"),
     Attr("filter_groups", "bool", False, omit_default=True,
          doc="DAPO's dynamic-sampling filter: drop the groups whose scores are all equal (no signal)"),
     Attr("max_refill", "int", 0, min=0, max=64, omit_default=True,
          doc="with filter_groups: up to this many extra rounds of sampling (next prompts, generate, rewards) "
              "per step until the batch holds `batch` groups with unequal scores (DAPO's refill); 0: no refill")),
    _TF, doc="group-relative advantages (GRPO / RLOO / REINFORCE++), broadcast to response tokens",
    internal_attrs=("group",)))

register_op(OpSpec(
    "compute.remax",
    (Operand("rollout", ("Rollout",)), Operand("scores", ("SeqFloat",)),
     Operand("baseline", ("SeqFloat",), doc="the scores of greedy responses to the same prompts")),
    (), _TF, doc="ReMax advantages: each sample's score minus its prompt's greedy-response score"))

register_op(OpSpec(
    "compute.env_reward", (Operand("rollout", ("Rollout",)),), (),
    ("SeqFloat",), doc="each trajectory's summed reward from its environment (a generate with env = ...)"))

register_op(OpSpec(
    "compute.env_turn_rewards", (Operand("rollout", ("Rollout",)),), (),
    _TF, doc="per-token rewards of a generate with env = ...: each environment step's reward on the last token of "
             "the policy turn it answered (for gae or kl_penalty)"))

register_op(OpSpec(
    "compute.overlong",
    (Operand("rollout", ("Rollout",)), Operand("scores", ("SeqFloat",))),
    (Attr("max_len", "int", required=True, min=1, example=16,
          doc="response length (tokens) from which the full penalty −1 applies, e.g. the generate's max_new_tokens"),
     Attr("buffer", "int", required=True, min=0, example=4,
          doc="the soft zone before max_len over which the penalty grows from 0 to −1")),
    ("SeqFloat",), doc="DAPO's overlong reward shaping: scores plus a length penalty"))

register_op(OpSpec(
    "compute.ppo_clip",
    (Operand("rollout", ("Rollout",)), Operand("logp", _TF), Operand("advantages", _TF),
     Operand("ref_logp", _TF, optional=True, doc="adds a KL term to the loss (GRPO)")),
    (Attr("clip", "float", 0.2, min=0.0, doc="ratio clip range"),
     Attr("entropy_coef", "float", 0.0, min=0.0, doc="entropy bonus"),
     Attr("kl_coef", "float", 0.0, min=0.0, doc="KL-in-loss coefficient (with ref_logp)"),
     Attr("estimator", "str", "k3", choices=("k1", "k2", "k3"), doc="KL estimator for the loss term"),
     Attr("clip_low", "float", None, min=0.0, omit_default=True, doc="lower ratio clip (default: clip)"),
     Attr("clip_high", "float", None, min=0.0, omit_default=True, doc="upper ratio clip (default: clip; DAPO)"),
     Attr("loss_agg", "str", "token_mean", choices=LOSS_AGGS, omit_default=True,
          doc="how per-token losses average over a minibatch"),
     Attr("ratio", "str", "token", choices=("token", "sequence"), omit_default=True,
          doc="token: PPO's per-token ratio; sequence: GSPO's length-normalised sequence ratio"),
     Attr("tis_cap", "float", None, min=0.0, omit_default=True,
          doc="truncated importance sampling between the rollout engine's and the trainer's old log-probs: "
              "each token's loss is weighted by min(exp(old_logp - rollout_logp), tis_cap) (rollout = vllm)")),
    ("PolicyLoss",), doc="clipped PPO policy loss"))

register_op(OpSpec(
    "compute.value_loss",
    (Operand("rollout", ("Rollout",)), Operand("values", _TF), Operand("returns", _TF)),
    (Attr("clip", "float", 0.2, min=0.0, doc="value clip range"),),
    ("ValueLoss",), doc="clipped value loss"))

register_op(OpSpec(
    "train", (Operand("loss", ("PolicyLoss", "ValueLoss")),),
    (Attr("lr", "float", 1e-5, min=0.0, doc="AdamW learning rate"),
     Attr("epochs", "int", 1, min=1, doc="passes over the batch"),
     Attr("minibatches", "int", 1, min=1, doc="optimizer steps per epoch"),
     Attr("max_grad_norm", "float", 1.0, min=0.0, doc="gradient clipping (0 = off)"),
     Attr("weight_decay", "float", 0.0, min=0.0, doc="AdamW weight decay"),
     Attr("lr_schedule", "str", "constant", choices=LR_SCHEDULES, omit_default=True,
          doc="lr over the run's train steps after warmup: constant, linear or cosine decay to 0"),
     Attr("warmup_steps", "int", 0, min=0, omit_default=True, doc="train steps of linear lr warmup"),
     Attr("total_steps", "int", 0, min=0, omit_default=True,
          doc="train steps of the schedule; set from the run's steps"),
     Attr("micro_batch", "int", 0, min=0, omit_default=True,
          doc="rows per forward/backward within a minibatch, gradients accumulated (0 = the whole minibatch)")),
    ("Metrics",), model="model", trains=True, pure=False, batch_from="none", internal_attrs=("total_steps",),
    emit=Emit("worker", "train", flags=("unpad",)), doc="update the model's weights on a loss"))

register_op(OpSpec(
    "sync", (Operand("after", ("Metrics",), doc="the train stage whose new weights are sent"),),
    (Attr("bucket_mb", "int", 64, min=1, doc="transfer bucket size (MiB)"),
     Attr("to_first", "int", 0, min=0, doc="first device of the destination mesh"),
     Attr("to_count", "int", 1, min=1, doc="devices of the destination mesh"),
     Attr("transport", "str", "object_store", choices=("object_store", "collective"),
          doc="object_store: buckets through Ray's object store; collective: broadcast in a two-rank "
              "process group (NCCL on GPUs, gloo on CPU)")),
    ("Metrics",), model="model", pure=False, batch_from="none",
    doc="copy a model's freshly trained weights to its copy on another mesh (inserted by realloc)"))

#: which loss type trains which head
LOSS_FOR_HEAD = {"lm": "PolicyLoss", "value": "ValueLoss"}

#: language spelling -> op name
METHOD_OPS = {"generate": "generate", "logprobs": "forward.logprobs", "values": "forward.values",
              "score": "forward.score", "train": "train"}
BUILTIN_OPS = {"rule": "compute.rule", "kl_penalty": "compute.kl_penalty", "gae": "compute.gae",
               "group_advantages": "compute.group_advantages", "ppo_clip": "compute.ppo_clip",
               "remax": "compute.remax", "overlong": "compute.overlong", "env_reward": "compute.env_reward",
               "env_turn_rewards": "compute.env_turn_rewards",
               "value_loss": "compute.value_loss"}
