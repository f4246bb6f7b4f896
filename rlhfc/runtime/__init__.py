"""What a compiled rlhfc job imports: models, tokenizers, generation, PPO math, data.

The runtime imports no compiler code (``rlhfc.frontend``, ``ir``, ``passes``,
``cost``, ``codegen``, ``explain``, ``cli``): a job runs with only this package and
``rlhfc.contract`` (the typed ``plan.json``, the engine registries, the shared rules) installed.

Sub-packages, by concept; each imports only those listed before it (tests/test_layers.py checks it):

* ``models``   a model as a worker holds it: built from a spec, LoRA, precision, recomputation, megatron-core.
* ``rollout``  generation: the rollout-engine interface, the torch decoder and vLLM, the rollout forwards.
* ``data``     prompt sources, tokenizers, the runtime values of the IR's types, answer extraction.
* ``rl``       the RL math: masked reductions, KL, advantages, losses; the algorithm family; guards; refill.
* ``train``    the train backends (``torch``, ``fsdp``, ``megatron`` behind one interface), the minibatch
               training loop and length-grouped packing.
* ``worker``   the Ray actor hosting a model (one train backend, one rollout engine), each method's dispatch
               over a group's ranks, the stage-call decorator, traces.
* ``driver``   around the step loop: cluster start-up, worker groups, weight transfers, checkpoints,
               metrics, samples, Ray hygiene, export.

Modules at the top, what compiled jobs and programs name directly:

* ``job``      the driver the generated ``main.py`` calls (``Job``: what ``step`` calls; the loop; ``main``).
* ``compute``  the driver-side stages the generated ``main.py`` calls (GAE, losses, ...).
* ``rewards``  rule rewards ``fn(prompt, response) -> float`` (``rule("rlhfc.runtime.rewards:fn")``) and
               their resolver.
* ``errors``   ``JobError``, the one error type of a running job.

Below, the names a user's own code most often needs, re-exported.
"""

from rlhfc.runtime.data.prompts import (
    JsonlPrompts,
    PromptSource,
    SyntheticPrompts,
    prompt_source_from_spec,
    repeat_each,
)
from rlhfc.runtime.data.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer
from rlhfc.runtime.models.build import (
    PolicyModel,
    ScoreModel,
    ValueModel,
    build_model,
    copy_weights,
    get_weights,
    load_weights,
    normalize_spec,
    save_weights,
    set_weights,
)
from rlhfc.runtime.rollout.generation import (
    FinishedSample,
    RolloutBatch,
    collate,
    decode_prompts,
    decode_responses,
    encode_prompts,
    entropy_from_logits,
    generate,
    generate_stream,
    response_entropy,
    response_logprobs,
    response_logprobs_and_entropy,
    response_values,
    sequence_scores,
)

from .rewards import resolve_rule, rule_scores

__all__ = [
    "JsonlPrompts",
    "PromptSource",
    "SyntheticPrompts",
    "prompt_source_from_spec",
    "repeat_each",
    "FinishedSample",
    "RolloutBatch",
    "collate",
    "decode_prompts",
    "decode_responses",
    "encode_prompts",
    "entropy_from_logits",
    "generate",
    "generate_stream",
    "response_entropy",
    "response_logprobs",
    "response_logprobs_and_entropy",
    "response_values",
    "sequence_scores",
    "PolicyModel",
    "ScoreModel",
    "ValueModel",
    "build_model",
    "copy_weights",
    "get_weights",
    "load_weights",
    "normalize_spec",
    "save_weights",
    "set_weights",
    "resolve_rule",
    "rule_scores",
    "CharTokenizer",
    "HFTokenizer",
    "load_tokenizer",
]
