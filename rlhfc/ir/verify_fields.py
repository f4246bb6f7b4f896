"""The verifier's rules about values: the fields of the cluster, models, data sources, run settings and
graph parameters, and the attributes of stages (types, choices, ranges, shapes that divide).

Each problem is reported at the field (:func:`~rlhfc.ir.diagnostics.where`): its key in the ``.rlir`` text,
or where the ``.rlhf`` program wrote it. The message then need not name the entity (the line under it does);
without a field position it points at the entity and names it.

:func:`rlhfc.ir.verifier.verify` runs these on a whole module; lowering runs them on each declaration and
stage it builds, before building on it (see :mod:`rlhfc.frontend.lower_decls`), so a program's mistakes are
reported in these words at their ``.rlhf`` position and rules about values live here only.

Why this file is long: it is the one table of value rules for every kind of entity; split by entity, each
part would import the same helpers and the verifier would gather them again.
"""

from __future__ import annotations

import json
import keyword
import math
import sys

from rlhfc.contract.rules import tokenizer_fingerprint

from .arch import ARCH_FIELDS, ARCHS, HEADS
from .core import DATA_OPTIONS, TRUNCATE_POLICIES, Cluster, DataSource, Graph, Model, Module, RunConfig, Stage, Symbol
from .devices import DEVICE_MEMORY, GPU_KINDS
from .diagnostics import DiagnosticSink, did_you_mean, field_loc, where
from .lora import lora_problems
from .ops import OpSpec
from .plan import LAYOUT_FACTORS, OPT_LEVELS, PLACEMENTS, placement_problem, rollouts, trainers
from .plan import describe as _describe

#: the arithmetic a run may choose (``run { precision = ... }``)
PRECISIONS = ("fp32", "bf16")

#: the example value a hint suggests for each integer setting
EXAMPLES = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "vocab": 96, "max_seq": 64,
            "nodes": 2, "batch": 8, "count": 1024, "min_len": 4, "max_len": 16, "seed": 0, "steps": 100,
            "checkpoint_every": 10, "log_samples": 4}


def is_positive_int(value) -> bool:
    return _is_int(value) and value >= 1


def show(value) -> str:
    """A value as a program writes it: strings quoted, booleans ``true``/``false``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def _name(value) -> str:
    """A value meant as a name (a kind, a head, a level), unquoted."""
    return value if isinstance(value, str) else show(value)


class _Fields:
    """Reports problems with the fields of one entity: at the field when its position is known, else at the
    entity with its ``label`` in front of the message. ``ok`` turns False at the first report."""

    def __init__(self, entity, label: str, sink: DiagnosticSink):
        self.entity, self.label, self.sink, self.ok = entity, label, sink, True

    def error(self, fields: str | tuple[str, ...], message: str, hint: str) -> None:
        loc = field_loc(self.entity, *((fields,) if isinstance(fields, str) else fields))
        if loc is None:
            message, loc = f"{self.label}: {message}", where(self.entity)
        self.sink.error(message, loc, hint)
        self.ok = False


def check_attr_value(spec_attr, value) -> str | None:
    """Why ``value`` is not valid for attribute ``spec_attr``, or None."""
    kind = spec_attr.kind
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, float) and math.isfinite(value),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[kind]
    if not ok:
        return f"expects {'an' if kind == 'int' else 'a'} {kind}, got {_describe(value)}"
    if spec_attr.choices and value not in spec_attr.choices:
        return f"must be one of {', '.join(map(str, spec_attr.choices))}, got {value!r}"
    if spec_attr.min is not None and value < spec_attr.min:
        return f"must be >= {spec_attr.min}, got {value}"
    if spec_attr.max is not None and value > spec_attr.max:
        return f"must be <= {spec_attr.max}, got {value}"
    return None


def attr_hint(spec_attr, value=None) -> str:
    """What an attribute means and a valid way to write it."""
    a = spec_attr
    if a.kind == "float" and _is_int(value):
        return f"write it as a float: {a.name} = {float(value)!r}"
    if a.choices:
        allowed, example = f"one of {', '.join(map(str, a.choices))}", a.choices[0]
    elif a.kind == "bool":
        allowed, example = "true or false", "true"
    else:
        bounds = [f">= {a.min}" if a.min is not None else "", f"<= {a.max}" if a.max is not None else ""]
        allowed = {"float": "a number", "int": "an integer", "str": "a string"}.get(a.kind, a.kind)
        allowed += " " + " and ".join(filter(None, bounds)) if any(bounds) else ""
        example = a.default if a.default is not None else a.example if a.example is not None else \
            (a.min if a.min is not None else 1)
        if a.kind == "str":
            example = json.dumps(str(example))
    return f"{a.doc + ' ' if a.doc else ''}({allowed}); e.g. {a.name} = {example}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- declarations ------------------------------------------------------------------------------------------
#: the most nodes the planner takes (past any real cluster; devices per node have their own bound)
MAX_NODES = 100_000


def check_cluster(c: Cluster, sink: DiagnosticSink) -> bool:
    """Check a cluster's device kind and sizes; False if anything was reported."""
    f = _Fields(c, f"cluster @{c.name}", sink)
    if not isinstance(c.device, str) or c.device not in DEVICE_MEMORY:
        f.error("device", f"unknown device kind '{_name(c.device)}'",
                " ".join(filter(None, [did_you_mean(str(c.device), DEVICE_MEMORY),
                                       f"known kinds: {', '.join(GPU_KINDS)}"])))   # cpu: the default
    if not is_positive_int(c.nodes):
        f.error("nodes", f"nodes must be a positive integer, got {show(c.nodes)}", f"e.g. nodes = {EXAMPLES['nodes']}")
    elif c.nodes > MAX_NODES:   # the planner enumerates meshes: a cluster past any real one is a typo
        f.error("nodes", f"nodes = {c.nodes} is more than rlhfc plans for ({MAX_NODES})",
                f"e.g. nodes = {EXAMPLES['nodes']}")
    if not is_positive_int(c.per_node):
        f.error("per_node", f"per_node must be a positive integer, got {show(c.per_node)}",
                "devices per node, e.g. per_node = 2 (a program writes devices = cpu:2 or gpus_per_node = 8)")

    if c.memory is not None and not is_positive_int(c.memory):
        f.error("memory", "memory must be a size per device like \"2GB\", \"512MiB\" or a byte count",
                'e.g. memory = "2GB" (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)')
    return f.ok


_HEADS_HINT = "heads: lm (a policy), value (a critic), score (a reward model)"


def check_model(m: Model, models: dict[str, Model], sink: DiagnosticSink) -> bool:
    """Check one model (``models``: those an ``init = @model`` may name); False if anything was reported."""
    f = _Fields(m, f"model @{m.name}", sink)
    if not isinstance(m.arch, str) or m.arch not in ARCHS:
        f.error("arch", f"unknown architecture '{_name(m.arch)}'",
                " ".join(filter(None, [did_you_mean(str(m.arch), ARCHS), f"architectures: {', '.join(ARCHS)}"])))
        return False
    if not isinstance(m.head, str) or m.head not in HEADS:
        f.error("head", f"unknown head '{_name(m.head)}'", did_you_mean(str(m.head), HEADS) or _HEADS_HINT)
    if not isinstance(m.trainable, bool):
        f.error("trainable", f"trainable must be true or false, got {_describe(m.trainable)}",
                "write trainable = true or trainable = false")
    if not isinstance(m.source, str):
        f.error("source", f"source must be a string, got {_describe(m.source)}",
                'write source = "" for config-built models')
    bad = [k for k in ARCH_FIELDS if not is_positive_int(getattr(m, k))]
    for k in bad:
        hint = (f"a pretrained model's shape comes from the config.json in {m.source}; fix it there"
                if m.source and isinstance(m.source, str) else f"e.g. {k} = {EXAMPLES[k]}")
        f.error(k, f"{k} must be a positive integer, got {show(getattr(m, k))}", hint)
    if not bad:
        _check_shape(m, f)
    if isinstance(m.init, Symbol):
        src = models.get(m.init.name)
        if src is None:
            f.error("init", f"init copies unknown model @{m.init.name}",
                    did_you_mean(m.init.name, models) or f"models: {', '.join('@' + n for n in models)}")
        elif src.config() != m.config():
            diff = [k for k, v in m.config().items() if src.config()[k] != v]
            sink.error(f"model @{m.name} copies @{src.name} but their architectures differ ({', '.join(diff)})",
                       where(m), f"a copy must have the same {', '.join(('arch',) + ARCH_FIELDS)}; use init = "
                       "\"random\" for a model of another shape")
            f.ok = False
    elif m.init not in ("random", "pretrained"):
        f.error("init", f"init must be \"random\", \"pretrained\" or @model, got {_describe(m.init)}",
                'write init = "random", init = "pretrained" (with a source folder) or init = @actor')
    if m.init == "pretrained" and not m.source:
        f.error(("source", "init"), 'init "pretrained" needs a source folder',
                'set source = "path/to/hf_folder", or use init = "random"')
    if not isinstance(m.dropout, bool):
        f.error("dropout", f"dropout must be true or false, got {_describe(m.dropout)}",
                "write dropout = true to keep a loaded folder's dropout, or leave it out (off)")
    elif m.dropout and not m.source:
        f.error("dropout", "dropout = true keeps a loaded folder's dropout, but this model is built from a config "
                "(it has none)", 'load it with hf("folder", dropout = true), or leave dropout out')
    if m.layout is not None:
        _check_layout(m, f)
    if m.lora is not None:
        for fields, message, hint in lora_problems(m):
            f.error((fields, "lora") if fields != "lora" else fields, message, hint)
    return f.ok


def _check_layout(m: Model, f: _Fields) -> None:
    """A fixed layout is ``{dp, tp, pp}`` of positive integers (what the trainer can run is checked with
    the plan, :mod:`rlhfc.ir.plan.check`)."""
    if not isinstance(m.layout, dict):
        f.error("layout", f"layout must be {{dp = D, tp = T, pp = P}}, got {_describe(m.layout)}",
                "e.g. layout = {dp = 2, pp = 1, tp = 1} (in a program: layout(dp = 2))")
        return
    for key in m.layout:
        if key not in LAYOUT_FACTORS:
            f.error((f"layout.{key}", "layout"), f"unknown layout factor '{key}'",
                    did_you_mean(key, LAYOUT_FACTORS) or "factors: dp (data), tp (tensor), pp (pipeline parallel)")
    for key in LAYOUT_FACTORS:
        if key not in m.layout:
            f.error("layout", f"layout lacks '{key}'", f"give every factor, e.g. {key} = 1")
        elif not is_positive_int(m.layout[key]):
            f.error((f"layout.{key}", "layout"), f"{key} must be a positive integer, got {show(m.layout[key])}",
                    f"e.g. layout({key} = 2); a factor left out is 1")


def _check_shape(m: Model, f: _Fields) -> None:
    """Attention shapes must divide evenly (each reported at the field to change)."""
    if m.hidden % m.heads:
        divisors = [h for h in range(1, min(m.hidden, 128) + 1) if m.hidden % h == 0]
        near = sorted(divisors, key=lambda h: (abs(h - m.heads), h))[:3]
        f.error("heads", f"hidden ({m.hidden}) is not divisible by heads ({m.heads})",
                f"each head gets hidden / heads dimensions; try heads = {' or '.join(map(str, sorted(near)))}")
    if m.arch == "gpt2" and m.kv_heads != m.heads:
        f.error("kv_heads", f"gpt2 has no grouped-query attention: kv_heads ({m.kv_heads}) must equal heads "
                f"({m.heads})", "drop kv_heads for gpt2 models, or use llama")
    elif m.heads % m.kv_heads:
        f.error("kv_heads", f"heads ({m.heads}) is not divisible by kv_heads ({m.kv_heads})",
                "grouped-query attention shares each key/value head among heads / kv_heads query heads; choose "
                "kv_heads that divides heads")


def check_models(module: Module, sink: DiagnosticSink) -> None:
    for m in module.models.values():
        check_model(m, module.models, sink)
    # copy cycles: report each cycle once, at its first model in declaration order
    reported: set[str] = set()
    for m in module.models.values():
        chain = [m.name]
        cur = m
        while isinstance(cur.init, Symbol) and cur.init.name in module.models:
            cur = module.models[cur.init.name]
            if cur.name in chain:
                cycle = chain[chain.index(cur.name):]
                if not reported.intersection(cycle):
                    sink.error(f"model @{m.name}: copy cycle " + " -> ".join("@" + n for n in cycle + [cur.name]),
                               where(m), "one model in the chain must start from init = \"random\" or \"pretrained\"")
                reported.update(cycle)
                break
            chain.append(cur.name)


#: the least value of each integer data option, and what each string option holds
_DATA_MIN = {"count": 1, "min_len": 1, "max_len": 1, "seed": 0}
_DATA_TEXT = {"path": 'the prompts file, e.g. path = "prompts.jsonl"',
              "field": 'the JSON key holding the prompt, e.g. field = "prompt"'}


def check_data(d: DataSource, sink: DiagnosticSink) -> bool:
    """Check a data source's kind and options; False if anything was reported."""
    f = _Fields(d, f"data @{d.name}", sink)
    known = DATA_OPTIONS.get(d.kind) if isinstance(d.kind, str) else None
    if known is None:
        f.error("kind", f"unknown kind '{_name(d.kind)}'", f"kinds: {', '.join(DATA_OPTIONS)}")
        return False
    for key, value in d.options.items():
        if key not in known:
            f.error(key, f"unknown {d.kind} option '{key}'",
                    did_you_mean(key, known) or f"{d.kind} options: {', '.join(known)}")
        elif known[key] is int and (not _is_int(value) or value < _DATA_MIN.get(key, 0)):
            what = "a positive" if _DATA_MIN.get(key, 0) else "a non-negative"
            f.error(key, f"'{key}' must be {what} integer, got {show(value)}", f"e.g. {key} = {EXAMPLES.get(key, 1)}")
        elif known[key] is str and not isinstance(value, str):
            f.error(key, f"{key} must be a string", _DATA_TEXT.get(key, f'write {key} = "..."'))
        elif key == "truncate" and value not in TRUNCATE_POLICIES:
            f.error(key, f"truncate must be one of {', '.join(TRUNCATE_POLICIES)}, got {show(value)}",
                    "left drops a too-long prompt's first tokens, right its last, error stops the job")
        elif key == "fields":
            _check_field_names(f, value, d.options.get("field", "prompt"))
    lo, hi = d.options.get("min_len"), d.options.get("max_len")
    if f.ok and _is_int(lo) and _is_int(hi) and lo > hi:
        f.error(("min_len", "max_len"), f"min_len ({lo}) is larger than max_len ({hi})",
                "prompt lengths are drawn from min_len to max_len; make min_len <= max_len")
    return f.ok


def _check_field_names(f: _Fields, value, prompt_field) -> None:
    """``fields = [answer, tests]``: distinct identifiers (a rule receives them as keyword arguments), not
    the prompt's own key nor the names a rule's first two parameters take."""
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        f.error("fields", f"fields must be a list of names, got {show(value)}",
                "name the JSON keys each line carries besides the prompt, e.g. fields = [answer]")
        return
    for name in value:
        if not name.isidentifier() or keyword.iskeyword(name):
            f.error("fields", f"field {show(name)} is not a name a rule can take as a parameter",
                    "a field reaches a rule as a keyword argument: use a Python identifier such as answer")
        elif name in RESERVED_FIELDS or name == prompt_field:
            f.error("fields", f"field '{name}' clashes with what a rule already receives (prompt, response)",
                    "list only the other keys of each line; the prompt comes as the rule's first argument")
        elif value.count(name) > 1:
            f.error("fields", f"field '{name}' listed twice", "remove one")
        if not f.ok:
            return


#: parameter names a rule function receives without a data field (one sample, or a batch of them)
RESERVED_FIELDS = ("prompt", "response", "prompts", "responses")


#: ``run { processes = ... }``
PROCESSES = ("shared", "own")


def check_run(r: RunConfig, sink: DiagnosticSink) -> bool:
    """Check the run settings; False if anything was reported."""
    f = _Fields(r, "run settings", sink)
    for key, lo in (("steps", 1), ("seed", 0), ("checkpoint_every", 0), ("log_samples", 0)):
        value = getattr(r, key)
        if not _is_int(value) or value < lo:
            f.error(key, f"{key} must be an integer >= {lo}, got {show(value)}", f"e.g. {key} = {EXAMPLES[key]}")
    if r.staleness is not None and (not _is_int(r.staleness) or r.staleness < 0):
        f.error("staleness", f"staleness must be an integer >= 0, got {show(r.staleness)}",
                "staleness = K lets generation run up to K steps ahead of training (0: synchronous; 1 is the "
                "usual choice, as AReaL's and verl's one-step-off)")
    if r.optimize not in OPT_LEVELS:
        f.error("optimize", f"optimize must be one of {', '.join(OPT_LEVELS)}, got {_name(r.optimize)}",
                "O0 runs no passes, O1 is the default; e.g. optimize = O2")
    if r.placement not in PLACEMENTS:
        message, hint = placement_problem(_name(r.placement))
        f.error("placement", message, hint)
    if r.trainer not in trainers():
        hint = " ".join(filter(None, [did_you_mean(str(r.trainer), trainers()),
                                      "torch runs one process per model and mesh; fsdp runs a data-parallel layout "
                                      "as FSDP2 ranks; megatron runs dp x tp x pp megatron-core ranks; auto picks "
                                      "per model"]))
        f.error("trainer", f"trainer must be one of {', '.join(trainers())}, got {_name(r.trainer)}", hint)
    if r.precision not in PRECISIONS:
        f.error("precision", f"precision must be one of {', '.join(PRECISIONS)}, got {_name(r.precision)}",
                " ".join(filter(None, [did_you_mean(str(r.precision), PRECISIONS),
                                       "fp32 computes in float32; bf16 runs forwards, generation and training "
                                       "under bf16 autocast with float32 weights"])))
    if r.rollout not in rollouts():
        f.error("rollout", f"rollout must be one of {', '.join(rollouts())}, got {_name(r.rollout)}",
                " ".join(filter(None, [did_you_mean(str(r.rollout), rollouts()),
                                       "torch decodes in rlhfc's own loop; vllm runs a vLLM engine; auto lets the cost model pick per model"])))
    if r.processes not in PROCESSES:
        f.error("processes", f"processes must be one of {', '.join(PROCESSES)}, got {_name(r.processes)}",
                " ".join(filter(None, [did_you_mean(str(r.processes), PROCESSES),
                                       "shared: colocated models that can share a worker process do (one start-up); "
                                       "own: every model's worker runs in a process of its own"])))
    mods = r.reward_modules
    if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
        f.error("reward_modules", f"reward_modules must be a list of module names, got {show(mods)}",
                'the installed modules rule() may name, e.g. reward_modules = ["my_package.rewards"]')
    else:
        for i, m in enumerate(mods):
            problem = reward_module_problem(m)
            if problem is None and m in mods[:i]:
                problem = f"reward module '{m}' is listed twice", "remove one"
            if problem is not None:
                f.error("reward_modules", *problem)
    return f.ok


#: the module of rlhfc's built-in reward rules (rule() may always name it)
BUILTIN_REWARDS = "rlhfc.runtime.rewards"
_NO_CODE_HINT = ("a rule runs only a reward function you wrote: define def f(prompt, response) -> float in a .py "
                 "file beside the program and name it rule(\"file:f\", roll), or use a built-in rule such as "
                 f"\"{BUILTIN_REWARDS}:vowel_count\"")


def reward_module_problem(name: str) -> tuple[str, str] | None:
    """(message, hint) when ``name`` cannot be listed in ``reward_modules``, else None."""
    if not name or not all(p.isidentifier() for p in name.split(".")):
        return (f"{json.dumps(name)} is not a module name",
                'write the dotted name of an installed module, e.g. reward_modules = ["my_package.rewards"]')
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return f"'{name}' is a Python standard-library module, not a reward module", _NO_CODE_HINT
    if top == "rlhfc":
        return (f"'{name}' is part of rlhfc, not a reward module",
                f"rlhfc's built-in rules ({BUILTIN_REWARDS}) need no listing; reward_modules lists installed "
                "packages of your own")
    return None


def check_params(g: Graph, sink: DiagnosticSink) -> bool:
    """Check the pipeline parameters (``batch``: prompts per step); False if anything was reported."""
    f = _Fields(g, f"graph @{g.name}", sink)
    if "batch" in g.params and not is_positive_int(g.params["batch"]):
        f.error("batch", f"batch must be a positive integer, got {show(g.params['batch'])}",
                "the number of prompts per step, e.g. pipeline ppo(batch = 32)")
    elif "batch" in g.params and g.params["batch"] > MAX_BATCH:
        f.error("batch", f"batch {g.params['batch']} is more prompts per step than rlhfc plans for (at most "
                f"{MAX_BATCH})", "split the work over more steps, e.g. pipeline ppo(batch = 1024)")
    return f.ok


#: the most prompts a step may take (plans price every sample of a step; a million is far past any real job)
MAX_BATCH = 2**20


def check_attr_values(stage: Stage, spec: OpSpec, sink: DiagnosticSink) -> bool:
    """Check the type, choices and range of each attribute ``stage`` has; False if anything was reported."""
    f = _Fields(stage, _stage_label(stage), sink)
    for a in spec.attrs:
        if a.name in stage.attrs:
            why = check_attr_value(a, stage.attrs[a.name])
            if why:
                f.error(a.name, f"'{a.name}' {why}", attr_hint(a, stage.attrs[a.name]))
    rows = stage.outputs[0].type.batch if stage.op == "generate" and stage.outputs else None
    if f.ok and isinstance(rows, int) and rows > MAX_BATCH:
        f.error("n", f"this generate makes {rows} samples a step (batch x n), more than rlhfc plans for (at most "
                f"{MAX_BATCH})", "fewer samples per prompt or a smaller batch")
    return f.ok


# -- prompt lengths and tokenizers ----------------------------------------------------------------------
#: a built-in (character) tokenizer of at least this vocabulary gives every character exactly one token
#: (its first 27 characters are the lowercase letters and space, and any other character becomes a space)
CHAR_VOCAB_EXACT = 30


def tokenizer_key(m: Model) -> tuple:
    """Which tokenizer a model uses: its folder's (``hf(...)``, by content: the same files in two folders are one
    tokenizer, :func:`rlhfc.contract.rules.tokenizer_fingerprint`), else the built-in one of its vocabulary."""
    if m.source:
        return ("hf", tokenizer_fingerprint(m.source) or m.source)
    return ("char", m.vocab)


def tokenizer_text(m: Model) -> str:
    return f"the tokenizer in {m.source}" if m.source else f"the built-in tokenizer with vocab {show(m.vocab)}"


def prompt_tokens(m: Model, chars: int) -> int | None:
    """Tokens (BOS included) of a prompt of ``chars`` characters for ``m``, when known without its tokenizer
    (the built-in tokenizer of a large enough vocabulary), else None."""
    if m.source or not _is_int(m.vocab) or m.vocab < CHAR_VOCAB_EXACT:
        return None
    return chars + 1


def rollout_readers(g: Graph, rollout) -> list[Stage]:
    """The stages on a model that read ``rollout``'s token ids: forwards, and trains on a loss built from it."""
    out = []
    for s in g.stages:
        if s.target is None or s.op in ("generate", "load", "sync"):
            continue
        if any(v is rollout for v in s.inputs):
            out.append(s)
        elif s.op == "train" and s.inputs:
            try:
                loss = g.producer(s.inputs[0])
            except KeyError:
                continue
            if loss.inputs and loss.inputs[0] is rollout:
                out.append(s)
    return out


def check_prompt_lengths(module: Module, sink: DiagnosticSink, longest: dict[str, tuple[int, str]]) -> bool:
    """The longest prompt of each data source in ``longest`` (``{data: (characters, where it is)}``) plus a
    generate's ``max_new_tokens`` must fit the ``max_seq`` of the generating model and of every model of the
    same tokenizer that reads the rollout. Checked where the token count is known without a tokenizer;
    the runtime checks the rest when the job starts. False if anything was reported."""
    ok = True
    g = module.graph
    for s in g.stages:
        if s.op != "generate" or not s.inputs or not s.outputs:
            continue
        try:
            load = g.producer(s.inputs[0])
        except KeyError:
            continue
        new = s.attrs.get("max_new_tokens")
        if load.op != "load" or load.target not in longest or not is_positive_int(new):
            continue
        chars, what = longest[load.target]
        gen = module.models.get(s.target or "")
        if gen is None:
            continue
        names = [gen.name] + [r.target for r in rollout_readers(g, s.outputs[0])]
        for name in dict.fromkeys(names):
            m = module.models.get(name)
            if m is None or tokenizer_key(m) != tokenizer_key(gen) or not is_positive_int(m.max_seq):
                continue
            tokens = prompt_tokens(m, chars)
            if tokens is None or tokens + new <= m.max_seq:
                continue
            fixes = [f"lower max_new_tokens to {m.max_seq - tokens}"] if m.max_seq > tokens else []
            fixes.append(f"raise max_seq of '{name}' to {tokens + new}" if not m.source else
                         f"use a model with a longer context than '{name}'")
            sink.error(f"max_new_tokens ({new}) + the longest prompt ({tokens} tokens with BOS; {what}) = "
                       f"{tokens + new} tokens, more than max_seq {m.max_seq} of model '{name}'",
                       where(s, "max_new_tokens"), ", ".join(fixes) + ", or shorten the prompts")
            ok = False
            break
    return ok


def _stage_label(stage: Stage) -> str:
    return f"stage %{stage.name} ({stage.op})" if stage.outputs else f"a {stage.op} stage"


__all__ = ["BUILTIN_REWARDS", "CHAR_VOCAB_EXACT", "RESERVED_FIELDS", "check_prompt_lengths", "prompt_tokens", "reward_module_problem",
           "rollout_readers", "tokenizer_key", "tokenizer_text", "EXAMPLES", "attr_hint", "check_attr_value", "check_attr_values", "check_cluster", "check_data",
           "check_model", "check_models", "check_params", "check_run", "is_positive_int", "show"]
