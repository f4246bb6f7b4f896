"""Rule rewards: deterministic ``fn(prompt: str, response: str) -> float``.

A pipeline names one as ``rule("module:function")``; ``resolve_rule`` finds it
and ``rule_scores`` applies it to a batch. A rule comes from this module (the
built-in rules below), from a ``.py`` file in the program's folder (loaded from
its path; the driver learns the folder from ``plan.json``), or from an installed
module the program lists in ``reward_modules``; nothing else is imported, so a
job runs no code but the reward functions its program named. A rule that raises,
returns something other than a number, or returns NaN/inf stops the run with an
error naming the function, the sample and its prompt. The built-in rules (all in
[0, 1], all 0 for an empty response unless stated):

* ``vowel_count``     ``min(#vowels in response, 8) / 8``: the recommended reward
  for ``SyntheticPrompts``; a random 2-layer width-64 policy starts near 0.17
  and PPO lifts it to about 0.4-0.6 within 20-40 steps on CPU (no length shortcut:
  a short response cannot score high).
* ``vowel_fraction``  share of response characters in ``aeiou``.
* ``digit_fraction``  share of response characters in ``0123456789``.
* ``target_length``   ``max(0, 1 - |len(response) - 8| / 8)``: 1 at exactly
  8 characters (an empty response scores 0).
* ``prompt_letters``  share of response characters that also occur in the prompt.
* ``echo_prompt``     share of the prompt's positions where the response has the
  same character (response compared position by position with the prompt).

Verifiable rewards, for data that carries the reference answer as a field (``fields = [answer]``):

* ``exact_match``     1 when the response, stripped, equals ``answer`` (as text, stripped), else 0.
  Pair it with an extractor: ``rule("rlhfc.runtime.rewards:exact_match", roll, extract = "last_number")``.
* ``numeric_match``   1 when the response and ``answer`` parse to the same number (within a relative
  1e-6; ``"1,000"``, ``"3/4"`` and JSON numbers are numbers), else 0.
* ``answer_format``   1 when the response (after the stage's extractor) holds an answer at all — a format
  reward: with ``extract = "boxed"`` it rewards answering inside ``\boxed{}``.

How a rule is called: once per sample as ``fn(prompt, response, **fields)`` with the data fields its
signature names (a parameter ``answer`` receives the sample's field ``answer``; ``**kw`` receives them all);
or, when its first two parameters are named ``prompts, responses``, once per batch with lists (each field a
list too), returning one number per sample. ``extract`` replaces each response by its extracted answer
(:mod:`rlhfc.runtime.data.answers`) before the call.

Responses are the decoded texts (special tokens such as EOS removed).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import zlib
from types import ModuleType
from typing import Callable, Sequence

import torch

from rlhfc.runtime.data.answers import extract_answer, parse_number
from rlhfc.runtime.rl.guards import NonFiniteError, RewardError, check_finite, short

__all__ = [
    "vowel_count",
    "vowel_fraction",
    "digit_fraction",
    "target_length",
    "prompt_letters",
    "echo_prompt",
    "exact_match",
    "numeric_match",
    "answer_format",
    "BUILTIN_RULES",
    "configure",
    "resolve_rule",
    "rule_scores",
    "RuleError",
    "RewardError",
    "NonFiniteError",
]

#: the rules ``rule("rlhfc.runtime.rewards:NAME", ...)`` may name (the compiler reads this list from the source)
BUILTIN_RULES = ("vowel_count", "vowel_fraction", "digit_fraction", "target_length", "prompt_letters", "echo_prompt",
                 "exact_match", "numeric_match", "answer_format")


class RuleError(ValueError):
    """A rule reference that names no usable function (unknown, refused, or of the wrong signature)."""


#: where resolve_rule looks by default (:func:`configure`), and the modules it loaded
_CONFIG: dict = {"program_dir": None, "allowed": ()}
_MODULES: dict[tuple, ModuleType] = {}

RuleFn = Callable[[str, str], float]

VOWELS = frozenset("aeiou")
DIGITS = frozenset("0123456789")
TARGET_LENGTH = 8
VOWEL_CAP = 8


def vowel_count(prompt: str, response: str) -> float:
    """Number of lowercase vowels in the response, capped at 8, divided by 8."""
    return min(sum(c in VOWELS for c in response), VOWEL_CAP) / VOWEL_CAP


def vowel_fraction(prompt: str, response: str) -> float:
    """Share of response characters that are lowercase vowels."""
    if not response:
        return 0.0
    return sum(c in VOWELS for c in response) / len(response)


def digit_fraction(prompt: str, response: str) -> float:
    """Share of response characters that are decimal digits."""
    if not response:
        return 0.0
    return sum(c in DIGITS for c in response) / len(response)


def target_length(prompt: str, response: str, target: int = TARGET_LENGTH) -> float:
    """1 at ``len(response) == target``, falling linearly to 0 at 0 and 2 * target."""
    return max(0.0, 1.0 - abs(len(response) - target) / target)


def prompt_letters(prompt: str, response: str) -> float:
    """Share of response characters that occur somewhere in the prompt."""
    if not response:
        return 0.0
    allowed = set(prompt)
    return sum(c in allowed for c in response) / len(response)


def echo_prompt(prompt: str, response: str) -> float:
    """Share of prompt positions i with ``response[i] == prompt[i]`` (0 for an empty prompt)."""
    if not prompt:
        return 0.0
    return sum(1 for a, b in zip(prompt, response) if a == b) / len(prompt)


def exact_match(prompt: str, response: str, answer) -> float:
    """1.0 when ``response`` (stripped) is ``answer`` (as text, stripped), else 0.0."""
    return float(response.strip() == str(answer).strip())


def numeric_match(prompt: str, response: str, answer) -> float:
    """1.0 when ``response`` and ``answer`` are the same number (relative tolerance 1e-6), else 0.0."""
    got, want = parse_number(response), parse_number(answer)
    if got is None or want is None:
        return 0.0
    return float(abs(got - want) <= 1e-6 * max(1.0, abs(want)))


def answer_format(prompt: str, response: str) -> float:
    """1.0 when the response (after the rule stage's extractor) holds an answer, i.e. is not blank."""
    return float(bool(response.strip()))


def configure(program_dir: str | None, allowed: Sequence[str] = ()) -> None:
    """Where :func:`resolve_rule` looks by default: the program's folder and the ``reward_modules`` a job's
    plan allows (the driver calls this when it loads ``plan.json``)."""
    _CONFIG["program_dir"] = program_dir
    _CONFIG["allowed"] = tuple(allowed or ())


def resolve_rule(ref: str, program_dir: str | None = None, allowed: Sequence[str] | None = None) -> RuleFn:
    """The rule function ``ref`` names (``"module:function"``; a bare name is a built-in rule).

    The module is rlhfc's built-in rewards (this module: only :data:`BUILTIN_RULES`), an installed module
    listed in ``allowed`` (the program's ``reward_modules``), or a ``.py`` file (or package) in
    ``program_dir``, the program's folder, loaded from its path. Anything else is refused: a job runs no
    code but the reward functions its program named. The function must be a plain Python function
    defined in that module and callable as ``fn(prompt, response)``. Defaults: :func:`configure`'s."""
    program_dir = _CONFIG["program_dir"] if program_dir is None else program_dir
    allowed = tuple(_CONFIG["allowed"] if allowed is None else allowed)
    module_name, sep, attr = ref.partition(":")
    if not sep:
        module_name, attr = __name__, ref
    if not module_name or not attr:
        raise RuleError(f"a rule reference is 'module:function', got {ref!r}")
    if module_name == __name__:
        if attr not in BUILTIN_RULES:
            raise RuleError(f"rule {ref!r}: {attr!r} is not a built-in rule (built-in: {', '.join(BUILTIN_RULES)})")
        return globals()[attr]
    key = (module_name, program_dir, module_name in allowed)
    module = _MODULES.get(key)
    if module is None:
        module = _import_rule_module(ref, module_name, program_dir, allowed)
        _MODULES[key] = module
    fn = module.__dict__.get(attr)
    if fn is None:
        raise RuleError(f"rule {ref!r}: module {module_name!r} has no function {attr!r}")
    if not inspect.isfunction(fn) or getattr(fn, "__module__", None) != module.__name__:
        raise RuleError(f"rule {ref!r}: {attr!r} is not a plain Python function defined in module {module_name!r} "
                        f"(it is {type(fn).__name__})")
    try:
        inspect.signature(fn).bind("prompt", "response", **{k: None for k in field_params(fn)[0]})
    except (TypeError, ValueError):
        raise RuleError(f"rule {ref!r}: the function must take (prompt, response) and data fields by name, but "
                        f"it is {attr}{inspect.signature(fn)}") from None
    return fn


def is_batched(fn: RuleFn) -> bool:
    """A rule scores a whole batch at once when its first two parameters are named ``prompts, responses``."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[:2] == ["prompts", "responses"]


def field_params(fn: RuleFn) -> tuple[list[str], bool]:
    """The parameters after the first two (the data fields the rule takes by name), and whether it takes
    ``**kwargs`` (then every field)."""
    params = list(inspect.signature(fn).parameters.values())
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return [p.name for p in named[2:]], any(p.kind == p.VAR_KEYWORD for p in params)


def module_file(module_name: str, program_dir: str | None, allowed) -> str | None:
    """The ``.py`` file of ``module_name`` found as a rule's module is — an installed module listed in
    ``allowed`` (the program's ``reward_modules``), else a file in ``program_dir`` — without importing it."""
    top = module_name.split(".")[0]
    if module_name in tuple(allowed or ()) and top not in sys.stdlib_module_names and top != "rlhfc":
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            return spec.origin
    return _local_source(program_dir, module_name) if program_dir else None


def _import_rule_module(ref: str, module_name: str, program_dir: str | None, allowed: tuple) -> ModuleType:
    top = module_name.split(".")[0]
    if module_name in allowed and top not in sys.stdlib_module_names and top not in sys.builtin_module_names \
            and top != "rlhfc":
        try:
            return importlib.import_module(module_name)
        except Exception as e:
            raise RuleError(f"rule {ref!r}: cannot import reward module {module_name!r} "
                            f"({type(e).__name__}: {e})") from None
    path = _local_source(program_dir, module_name) if program_dir else None
    if path is None:
        where = f"the program's folder {program_dir}" if program_dir else "the program's folder (not known)"
        raise RuleError(f"rule {ref!r}: module {module_name!r} is not in {where}, not rlhfc's built-in rewards and "
                        "not listed in reward_modules; a job runs no other code")
    name = f"_rlhfc_rule_{zlib.crc32(os.path.abspath(path).encode()):08x}_{module_name.replace('.', '_')}"
    if name in sys.modules:
        return sys.modules[name]
    package = [os.path.dirname(path)] if os.path.basename(path) == "__init__.py" else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=package)
    module = importlib.util.module_from_spec(spec)
    if program_dir not in sys.path:
        sys.path.append(program_dir)   # its own helper modules (last: it never shadows an installed module)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RuleError(f"rule {ref!r}: loading {path} raised {type(e).__name__}: {e}") from None
    return module


def _local_source(program_dir: str, module_name: str) -> str | None:
    """``a.b`` in the program's folder: ``a/b.py`` or ``a/b/__init__.py``."""
    base = os.path.join(program_dir, *module_name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def rule_scores(fn: RuleFn, prompts: Sequence[str], responses: Sequence[str], name: str | None = None,
                fields: Sequence[dict] | None = None, extract: str = "") -> torch.Tensor:
    """``fn`` applied to each sample -> float32 tensor [B] (on CPU): ``fn(prompt, response, **its fields)``,
    or one call with lists when ``fn`` is batched (:func:`is_batched`). ``fields``: per sample its data
    fields (the rule gets those its signature names); ``extract``: how the answer is cut out of each response
    first (:mod:`rlhfc.runtime.data.answers`). A call that raises or returns something other than a finite number
    stops with a :class:`RewardError` / :class:`NonFiniteError` naming the function (``name``), the sample
    index and its prompt."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    name = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    fields = list(fields) if fields else [{} for _ in prompts]
    if extract:
        responses = [extract_answer(r, extract) for r in responses]
    wanted, every = field_params(fn)
    required = {p.name for p in inspect.signature(fn).parameters.values() if p.default is p.empty}

    def kwargs_of(i: int) -> dict:
        have = fields[i] if i < len(fields) else {}
        missing = [k for k in wanted if k in required and k not in have]
        if missing:
            raise RewardError(f"reward function {name} takes the data field '{missing[0]}', but sample {i} "
                              f"(prompt {short(prompts[i])}) has no such field (its fields: "
                              f"{', '.join(have) or 'none'}); declare it on the data source: fields = "
                              f"[{missing[0]}]")
        return dict(have) if every else {k: have[k] for k in wanted if k in have}

    if is_batched(fn):
        return _batched_scores(fn, prompts, responses, name, [kwargs_of(i) for i in range(len(prompts))])
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        kwargs = kwargs_of(i)
        try:
            value = fn(p, r, **kwargs)
        except Exception as e:
            raise _raised(name, e, f"on sample {i}, prompt {short(p)}") from None
        out.append(_number(value, name, f"on sample {i}, prompt {short(p)}"))
    scores = torch.tensor(out, dtype=torch.float32)   # a double beyond float32's range becomes inf: refused too
    return check_finite(scores, f"the reward of {name}", prompts=prompts)


def _batched_scores(fn, prompts, responses, name: str, kwargs: list[dict]) -> torch.Tensor:
    """One call ``fn(prompts, responses, field=[...], ...)`` returning one number per sample."""
    keys = list(kwargs[0]) if kwargs else []
    columns = {k: [kw.get(k) for kw in kwargs] for k in keys}
    where = f"on a batch of {len(prompts)} samples (first prompt {short(prompts[0]) if prompts else '-'})"
    try:
        values = fn(list(prompts), list(responses), **columns)
    except Exception as e:
        raise _raised(name, e, where) from None
    try:
        values = list(values.tolist() if hasattr(values, "tolist") else values)
    except TypeError:
        raise RewardError(f"batched reward function {name} returned {type(values).__name__}, not a list of "
                          f"numbers, {where}") from None
    if len(values) != len(prompts):
        raise RewardError(f"batched reward function {name} returned {len(values)} scores for {len(prompts)} "
                          "samples; a batched rule (parameters prompts, responses, ...) returns one number "
                          "per sample, in order")
    out = [_number(v, name, f"on sample {i}, prompt {short(prompts[i])}") for i, v in enumerate(values)]
    return check_finite(torch.tensor(out, dtype=torch.float32), f"the reward of {name}", prompts=prompts)


def _raised(name: str, e: Exception, where: str) -> RewardError:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return RewardError(f"reward function {name} raised {type(e).__name__}: {e} (at "
                       f"{os.path.basename(frame.filename)}:{frame.lineno}) {where}")


def _number(value, name: str, where: str) -> float:
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise RewardError(f"reward function {name} returned {value!r}, not a number, {where}") from None
