"""Multi-turn, tool-using rollouts: the loop that turns each prompt into a trajectory of turns.

A **trajectory** is token-in/token-out: the token ids the policy sampled, turn after turn, with the tokens
of each tool result appended between its turns — never re-tokenized from text, so the trainer's forward
sees exactly the ids that were generated. A per-token **loss mask** marks the policy's own tokens (1) and
the tools' (0); the rollout's ``response_mask`` is that mask, so the tool tokens get no log-prob loss, no
KL, no entropy and no advantage, and GAE steps over them (:func:`rlhfc.runtime.rl.ppo.gae`). The whole
trajectory fits the generate's ``max_new_tokens`` columns (as verl's ``response_length``): a turn decodes at
most ``turn_tokens`` of what is left, a tool result is cut to what is left, and a trajectory with no room
for another turn ends.

**Two tool-call formats** (:class:`PlainText`, :class:`ChatTemplate`). With a chat template (a generate with
``chat = true`` on an HF model whose template writes tool calls) the prompt is the template's user turn with
the tools' schemas, a call is what the template writes for one — Hermes' (Qwen 2.5/3, Hermes)
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` in the policy's turn, several a turn, or Llama
3.1-3.3's whole turn ``{"name": ..., "parameters": ...}``, one a turn, or Mistral's (7B v0.3, Nemo, Small)
``[TOOL_CALLS] [{"name": ..., "arguments": ..., "id": ...}, ...]``, several a turn, each result naming its call's
id (:func:`rlhfc.contract.rules.tool_call_format` tells which from the template) — and a result is appended as the tokens the template writes for a ``tool`` message (an
environment's observation: a ``user`` message) through the opening of the next assistant turn — computed from
the template, never by re-tokenizing the conversation. Otherwise, **the plain-text convention** (any tokenizer): a
policy turn ends at EOS or at its turn budget. A turn whose text, leading spaces stripped, is a declared
tool's name alone or followed by a space calls that tool, the rest of the text (stripped) being its
argument: ``calc 12 plus 30`` calls ``calc("12 plus 30")``. The result text is appended as its tokens
exactly as the tool returned it (the tool adds any separators it wants), then the policy's next turn
starts. Any other turn is the answer and ends the trajectory; so does the ``max_turns``-th turn. A tool
that fails gives an error observation (``error: ...``, :mod:`rlhfc.runtime.rollout.sandbox`), counted in
the step's metrics.

Every row keeps one random-stream key for the whole trajectory (its token positions continue across
turns), so a trajectory's tokens depend on its prompt and key only, not on which other rows were still
running — the same as single-turn decoding. Rows waiting for their tools leave the decode batch; the next
turn re-prefills each row's prompt and trajectory so far (the KV cache is not kept across a tool call).
"""

from __future__ import annotations

import ast
import json
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from rlhfc.contract.rules import tool_call_format

from .decoding import FinishedSample, PartialSample


@dataclass
class Trajectory:
    """One row's trajectory so far."""

    prompt_ids: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)      # policy and tool tokens, in order
    policy: list[bool] = field(default_factory=list)     # per token: sampled by the policy
    logprobs: list[float] = field(default_factory=list)  # per token: its sampling log-prob (0 for tool tokens)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    tool_tokens: int = 0
    eos: bool = False
    done: bool = False
    reward: float = 0.0     # the environment's rewards, summed over the turns
    rewards: list[float] = field(default_factory=list)   # ... per environment step
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)   # (column of the turn's last token, reward)
    steps: int = 0          # decoding steps over all turns
    computed: float = 0.0   # tokens the engine computed for it
    segments: list[tuple[str, int]] = field(default_factory=list)   # (who: "policy", a tool's name or "env", tokens)

    def add(self, ids: Sequence[int], *, policy: bool, logprobs: Sequence[float] = (), who: str = "") -> None:
        self.tokens += list(ids)
        self.policy += [policy] * len(ids)
        self.logprobs += list(logprobs) if policy and logprobs else [0.0] * len(ids)
        if ids:
            self.segments.append(("policy" if policy else who, len(ids)))

    def turns_text(self, tokenizer) -> list[list[str]]:
        """``[[who, text], ...]``: the trajectory as the policy's turns and what tools and the environment
        appended (``samples.jsonl`` shows it so)."""
        out, at = [], 0
        for who, n in self.segments:
            out.append([who, tokenizer.decode(self.tokens[at:at + n])])
            at += n
        return out


def parse_call(text: str, tools: Iterable[str]) -> tuple[str, str] | None:
    """``(tool, argument)`` when ``text`` calls one of ``tools`` by the plain-text convention, else None."""
    stripped = text.lstrip()
    for name in sorted(tools, key=len, reverse=True):   # the longest name first: "calc2" before "calc"
        if stripped == name or stripped.startswith(name + " "):
            return name, stripped[len(name):].strip()
    return None


class PlainText:
    """The plain-text tool-call convention (module docstring): a call is the tool's name and its argument, a result
    or an observation is appended as its text's tokens; prompts are encoded as the generate encodes them."""

    def prompt(self, prompt_ids: Sequence[int], text: str, observation: str, tokenizer) -> tuple[list[int], list[int]]:
        """(the trajectory's prompt ids, the tokens of the environment's first observation before the first turn)."""
        return list(prompt_ids), (tokenizer.encode(observation) if observation else [])

    def parse(self, ids: Sequence[int], tokenizer, tools: Iterable[str]) -> list[tuple[str, str]]:
        """The turn's tool calls, ``[(tool, argument)]``: at most one in plain text."""
        call = parse_call(tokenizer.decode(ids), tools)
        return [call] if call else []

    def observe(self, text: str, tokenizer, who: str) -> list[int]:
        return tokenizer.encode(text) if text else []

    def results(self, outputs: Sequence[tuple[str, str]], tokenizer) -> list[int]:
        """The tokens of a turn's tool results ``[(tool, text)]``, in call order."""
        return [i for name, text, *_ in outputs for i in self.observe(text, tokenizer, name)]


#: what opens Mistral's tool calls in a policy turn
MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral_call_id(given: Any, name: str, arguments: Any, k: int) -> str:
    """The id a Mistral tool result names: the call's own when it is nine letters and digits (what Mistral's
    templates accept), else nine drawn from the call itself (its name, arguments and place in the turn), so the
    same call always gets the same id."""
    if isinstance(given, str) and _MISTRAL_ID.fullmatch(given):
        return given
    n = zlib.crc32(json.dumps([name, arguments, k, given], sort_keys=True, default=str).encode())
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    for _ in range(9):
        n, r = divmod(n * 2654435761 + 97, 36)
        out += digits[r]
    return out


#: a Hermes-style tool call in a policy turn
_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _argument(arguments: Any) -> str:
    """A one-argument tool's text from a call's ``arguments``: the text itself, the one value of a one-key object
    (its text, or its JSON), else the object's JSON."""
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, dict) and len(arguments) == 1:
        (value,) = arguments.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(arguments)


@dataclass(frozen=True)
class ChatTemplate:
    """Tool calls in the chat template's own format (Hermes: module docstring). ``schemas``: the tools as the
    template's ``tools`` argument takes them (:func:`tool_schema`)."""

    schemas: tuple = ()
    #: the template's call format (:func:`rlhfc.contract.rules.tool_call_format`): ``hermes``, ``json`` or
    #: ``mistral``
    style: str = "hermes"

    @classmethod
    def of(cls, tokenizer, schemas: tuple) -> "ChatTemplate":
        """The format of ``tokenizer``'s chat template (Hermes where it names none: the compiler's check has
        refused a template with no format it reads)."""
        template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
        return cls(tuple(schemas), tool_call_format(template if isinstance(template, str) else "") or "hermes")

    def prompt(self, prompt_ids: Sequence[int], text: str, observation: str, tokenizer) -> tuple[list[int], list[int]]:
        content = f"{text}\n\n{observation}" if observation else text   # the first observation joins the user turn
        return tokenizer.chat_ids([{"role": "user", "content": content}], tools=list(self.schemas)), []

    def parse(self, ids: Sequence[int], tokenizer, tools: Iterable[str]) -> list[tuple[str, str]]:
        """Every well-formed call of a declared tool in the turn, in order, as ``(tool, argument)`` — ``(tool,
        argument, id)`` in Mistral's format (:func:`mistral_call_id`) — (one that is not JSON, or names no declared
        tool, is left out; none: the turn is an answer)."""
        names, out = set(tools), []
        if self.style == "mistral":   # [TOOL_CALLS] then a JSON list of calls (or one call), each with its id
            text = tokenizer.decode(ids, keep_special=True)
            at = text.find(MISTRAL_CALLS)
            if at < 0:
                return out
            try:
                calls, _ = json.JSONDecoder().raw_decode(text[at + len(MISTRAL_CALLS):].lstrip())
            except ValueError:
                return out
            for k, call in enumerate(calls if isinstance(calls, list) else [calls]):
                name = call.get("name") if isinstance(call, dict) else None
                if name in names:
                    arguments = call.get("arguments", call.get("parameters", ""))
                    out.append((name, _argument(arguments), mistral_call_id(call.get("id"), name, arguments, k)))
            return out
        if self.style == "json":   # Llama 3.x: the turn is one JSON call (after <|python_tag|> if written)
            text = tokenizer.decode(ids).strip()
            text = text[len("<|python_tag|>"):].lstrip() if text.startswith("<|python_tag|>") else text
            try:
                call, _ = json.JSONDecoder().raw_decode(text)
            except ValueError:
                return out
            name = call.get("name") if isinstance(call, dict) else None
            if name in names:
                out.append((name, _argument(call.get("parameters", call.get("arguments", "")))))
            return out
        for found in _HERMES_CALL.finditer(tokenizer.decode(ids, keep_special=True)):
            try:
                call = json.loads(found.group(1))
            except ValueError:
                continue
            name = call.get("name") if isinstance(call, dict) else None
            if name in names:
                out.append((name, _argument(call.get("arguments", call.get("parameters", "")))))
        return out

    def observe(self, text: str, tokenizer, who: str) -> list[int]:
        if who == "env":
            return tokenizer.chat_suffix([{"role": "user", "content": text}])
        return self.results([(who, text)], tokenizer)

    def results(self, outputs: Sequence[tuple[str, str]], tokenizer) -> list[int]:
        """A turn's tool results ``[(tool, text)]`` (``[(tool, text, call id)]`` where the format names calls by
        id) as the template writes them: one ``tool`` message each, then the next assistant turn's opening."""
        return tokenizer.chat_suffix([{"role": "tool", "name": name, "content": text,
                                       **({"tool_call_id": more[0]} if more else {})}
                                      for name, text, *more in outputs])


def tool_schema(name: str, path: str, function: str) -> dict:
    """The JSON schema a chat template shows for tool ``name`` (``function`` in the file ``path``, read, not
    imported): its docstring's first paragraph as the description, its one parameter a string."""
    param, doc = "text", ""
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
                args = node.args.posonlyargs + node.args.args
                param = args[0].arg if args else param
                doc = (ast.get_docstring(node) or "").split("\n\n", 1)[0].strip()
    except (OSError, SyntaxError, ValueError):
        pass
    return {"type": "function", "function": {"name": name, "description": doc or f"the tool {name}",
                                             "parameters": {"type": "object",
                                                            "properties": {param: {"type": "string"}},
                                                            "required": [param]}}}


#: the sample field holding a trajectory's summed environment reward (not an identifier: no data field clashes)
ENV_REWARD = "@env_reward"
#: the sample field holding a trajectory's per-turn environment rewards as ``[[column, reward], ...]``: each step's
#: reward at the column (of the response) of the last token of the policy turn it answered
ENV_TURN_REWARDS = "@env_turn_rewards"
#: the sample field holding a trajectory's turns as ``[[who, text], ...]`` (``Trajectory.turns_text``)
TURNS = "@turns"



class EnvError(RuntimeError):
    """An environment's ``reset`` or ``step`` raised, timed out or killed its process (the program's own code: the
    run stops naming it)."""


def _env_failure(exc: Exception) -> str:
    """What went wrong in an environment's call: its sandbox's account (which names the exception, a timeout or
    the process's death), else the exception."""
    return str(exc) if type(exc).__name__ == "EnvCallError" else f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class AgentLoop:
    """How a generate runs its turns: the tools it may call (name -> an object with ``call(args: list[str])
    -> list`` of results having ``output`` and ``kind``), the number of policy turns, each turn's budget, and
    the environment (``env``: a class, one instance per trajectory, ``env_name`` naming it in errors)."""

    tools: Mapping[str, Any]
    max_turns: int
    turn_tokens: int
    env: Callable[[], Any] | None = None
    env_name: str = ""
    format: Any = PlainText()

    def _env_call(self, env, method: str, arg, prompt: str):
        try:
            return getattr(env, method)(arg)
        except Exception as exc:   # noqa: BLE001 - the program's own code: named, with the sample's prompt
            raise EnvError(f"environment '{self.env_name}' failed in {method}() for prompt {prompt!r}: "
                           f"{_env_failure(exc)}") from None

    def _env_calls(self, calls: list[tuple]) -> list:
        """``env.method(arg)`` for each ``(env, method, arg, prompt)``, in order: in one exchange where the
        instances are a sandbox's (their ``batch``), else one by one; the first that failed stops the run."""
        batch = getattr(calls[0][0], "batch", None) if calls else None
        if batch is None:
            return [self._env_call(env, method, arg, prompt) for env, method, arg, prompt in calls]
        outs = batch([(env, method, arg) for env, method, arg, _ in calls])
        for (_, method, _, prompt), out in zip(calls, outs):
            if isinstance(out, Exception):
                raise EnvError(f"environment '{self.env_name}' failed in {method}() for prompt {prompt!r}: "
                               f"{_env_failure(out)}")
        return outs

    def _env_new(self):
        try:
            return self.env()
        except Exception as exc:   # noqa: BLE001 - the program's own code, or its sandbox not starting
            raise EnvError(f"environment '{self.env_name}' could not make an instance: {_env_failure(exc)}") from None

    def run(self, decode: Callable[..., Iterable[FinishedSample | PartialSample]], prompts: Sequence[Sequence[int]],
            *, width: int, keys: Sequence[int], tokenizer, want_logprobs: bool,
            records: Sequence[Mapping[str, Any]] = ()) -> tuple[list[Trajectory], float]:
        """Run every prompt's trajectory. ``decode(rows, budgets=, resumed=, row_keys=)`` is the engine's
        stream over token rows (each row's prompt then its trajectory so far; ``resumed``: how many of its
        last tokens are that trajectory); ``width``: the response columns a trajectory may fill; ``records``:
        each row's data record (``{"prompt": text, **fields}``), what an environment's ``reset`` gets.
        Returns the trajectories and the seconds spent waiting for tools."""
        trajs, seconds = [], 0.0
        for trajs, _, seconds in self.iterate(decode, prompts, width=width, keys=keys, tokenizer=tokenizer,
                                              want_logprobs=want_logprobs, records=records):
            pass
        return trajs, seconds

    def iterate(self, decode: Callable[..., Iterable[FinishedSample | PartialSample]],
                prompts: Sequence[Sequence[int]], *, width: int, keys: Sequence[int], tokenizer, want_logprobs: bool,
                records: Sequence[Mapping[str, Any]] = ()) -> Iterator[tuple[list[Trajectory], list[int], float]]:
        """:meth:`run`'s loop, one turn at a time (what a streamed generate hands on as trajectories end): after
        the prompts and after each turn it yields (the trajectories, the rows whose trajectory ended since the
        last yield — in the order they ended — and the seconds spent waiting for tools so far). Every row has
        ended by the last yield; the trajectories are the same whether the caller hands them on early or not."""
        seconds = 0.0
        handed = [False] * len(prompts)

        def ended(order: Sequence[int]) -> list[int]:
            out = [i for i in order if trajs[i].done and not handed[i]]
            for i in out:
                handed[i] = True
            return out
        records = [records[i] if i < len(records) else {} for i in range(len(prompts))]
        envs = [self._env_new() for _ in prompts] if self.env is not None else []
        firsts = []
        observed = self._env_calls([(env, "reset", dict(r), r.get("prompt", "")) for env, r in zip(envs, records)])
        for i, record in enumerate(records):
            got = observed[i] if envs else None
            obs = "" if got is None else str(got)
            firsts.append(self.format.prompt(prompts[i], record.get("prompt", ""), obs, tokenizer))
        trajs = [Trajectory(tuple(ids)) for ids, _ in firsts]
        for t, (_, first) in zip(trajs, firsts):
            self._observe(t, first, width, "env")
        yield trajs, ended(range(len(trajs))), seconds
        for turn in range(self.max_turns):
            live = [i for i, t in enumerate(trajs) if not t.done]
            if not live:
                break
            order: list[int] = []   # the turn's rows in the order their decode finished
            budgets = [min(self.turn_tokens, width - len(trajs[i].tokens)) for i in live]
            rows = [list(trajs[i].prompt_ids) + trajs[i].tokens for i in live]
            calls: dict[int, list[tuple]] = {}   # trajectory -> its turn's calls (tool, argument[, id]), in order
            acts: list[tuple[int, str, bool]] = []   # (trajectory, its action, room for more) in finishing order
            for item in decode(rows, budgets=budgets, resumed=[len(trajs[i].tokens) for i in live],
                               row_keys=[keys[i] for i in live]):
                if isinstance(item, PartialSample):   # no stop_after here: every row finishes its turn
                    raise RuntimeError("a multi-turn generate's engine stopped a turn early")
                i = live[item.index]
                order.append(i)
                t = trajs[i]
                new = list(item.response_ids)
                lps = list(item.logprobs[len(item.logprobs) - len(new):]) if want_logprobs else []
                t.add(new, policy=True, logprobs=lps)
                t.turns += 1
                t.steps += item.step + 1
                t.computed += item.computed
                t.eos = item.eos
                text = tokenizer.decode(new)
                found = self.format.parse(new, tokenizer, self.tools) if self.tools else []
                room = width - len(t.tokens) > 0
                if not found and envs:   # the turn is the environment's action (stepped with the turn's others)
                    acts.append((i, text, room))
                    continue
                if not found or turn + 1 == self.max_turns or not room:
                    t.done = True
                    continue
                calls[i] = found
            # the turn's environment steps, in the order the rows finished it (one exchange with a sandbox)
            outs = self._env_calls([(envs[i], "step", text, records[i].get("prompt", "")) for i, text, _ in acts])
            for (i, _, room), out in zip(acts, outs):
                t = trajs[i]
                out = tuple(out) if isinstance(out, list) else out
                obs, reward, done = out if isinstance(out, tuple) and len(out) == 3 else (None, None, None)
                if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                    raise EnvError(f"environment '{self.env_name}': step() must return (observation, reward, "
                                   f"done) with a number for reward, got {out!r}")
                t.reward += float(reward)
                t.rewards.append(float(reward))
                t.turn_rewards.append((max(len(t.tokens) - 1, 0), float(reward)))
                if done or turn + 1 == self.max_turns or not room:
                    t.done = True
                else:
                    self._observe(t, self.format.observe("" if obs is None else str(obs), tokenizer, "env"),
                                  width, "env")
            t0 = time.perf_counter()
            by_tool: dict[str, list[tuple[int, int, str]]] = {}   # each tool's calls of the turn: one batch
            for i, found in calls.items():
                for k, (name, arg, *_) in enumerate(found):
                    by_tool.setdefault(name, []).append((i, k, arg))
            got: dict[tuple[int, int], Any] = {}
            for name, todo in by_tool.items():
                for (i, k, _), result in zip(todo, self.tools[name].call([arg for _, _, arg in todo])):
                    got[(i, k)] = result
            for i, found in calls.items():
                t = trajs[i]
                outputs = []
                for k, (name, _, *call_id) in enumerate(found):
                    result = got[(i, k)]
                    t.calls += 1
                    t.errors += result.kind == "error"
                    t.timeouts += result.kind == "timeout"
                    outputs.append((name, result.output, *call_id))
                self._observe(t, self.format.results(outputs, tokenizer), width, "+".join(n for n, *_ in found))
            seconds += time.perf_counter() - t0
            yield trajs, ended(order), seconds
        yield trajs, [i for i in range(len(trajs)) if not handed[i]], seconds   # none: every row ended above

    @staticmethod
    def _observe(t: Trajectory, ids: Sequence[int], width: int, who: str) -> None:
        """Append a tool's or the environment's tokens, which the policy did not sample (cut to the room left;
        a trajectory with no room for the policy's next turn ends)."""
        ids = list(ids)[: width - len(t.tokens)]
        t.add(ids, policy=False, who=who)
        t.tool_tokens += len(ids)
        if ids:
            t.eos = False
        if len(t.tokens) >= width:
            t.done = True

    @staticmethod
    def stats(trajs: Sequence[Trajectory], tool_s: float = 0.0, env: bool = False) -> dict[str, float]:
        """The step's metrics of a rollout's trajectories: policy turns per trajectory, tool calls, calls that
        failed or timed out, tokens appended by tools and the environment, the seconds the decoding waited for
        tools, and (``env``) the environment's mean reward per trajectory."""
        n = max(len(trajs), 1)
        return {"turns_mean": sum(t.turns for t in trajs) / n,
                **({"env_reward_mean": sum(t.reward for t in trajs) / n} if env else {}),
                "tool_calls": float(sum(t.calls for t in trajs)),
                "tool_errors": float(sum(t.errors for t in trajs)),
                "tool_timeouts": float(sum(t.timeouts for t in trajs)),
                "tool_tokens": float(sum(t.tool_tokens for t in trajs)),
                "tool_s": float(tool_s)}

    @staticmethod
    def samples(trajs: Sequence[Trajectory]) -> list[FinishedSample]:
        """The trajectories as finished samples (row ``i`` = trajectory ``i``), for collating a rollout."""
        return [FinishedSample(i, t.prompt_ids, tuple(t.tokens), t.eos, max(t.steps - 1, 0), tuple(t.logprobs),
                               t.computed) for i, t in enumerate(trajs)]
