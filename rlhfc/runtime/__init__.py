"""What a compiled rlhfc job imports: models, tokenizers, generation, PPO math, data.

The runtime imports no compiler code (``rlhfc.frontend``, ``ir``, ``passes``,
``cost``, ``codegen``, ``explain``, ``cli``): a job runs with only this package and
``rlhfc.contract`` (the typed ``plan.json``, the engine registries, the shared rules) installed.

Modules:

* ``models``     build a policy / value / score model from a dict spec; weights in/out.
* ``tokenizer``  the built-in character tokenizer and a Hugging Face wrapper.
* ``generation`` KV-cached sampling (plain and streaming) and rollout forwards.
* ``rollout``    the rollout-engine interface a worker decodes through, and the torch decoder behind it
                 (``vllm_engine``: the vLLM engine); built from the registry of ``rlhfc.contract.engines``.
* ``ppo``        KL, rewards, GAE, whitening, PPO/value losses, GRPO/RLOO, train loop.
* ``data``       prompt sources (synthetic task, JSONL) with a checkpointable cursor.
* ``rewards``    rule rewards ``fn(prompt, response) -> float`` and their resolver.

Running a compiled job (imported by the generated ``main.py``, not re-exported here):

* ``job``        the driver (``Job``: what ``step`` calls; the loop; ``main``).
* ``cluster``    Ray start-up, placement group, worker creation (each group's class from its train backend's
                 registration: ``worker`` torch, ``parallel`` FSDP2, ``megatron`` megatron-core).
* ``group``      ``WorkerGroup``, the handle ``w.<worker>`` (one rank today).
* ``worker``     ``ModelWorker``, the Ray actor hosting one model.
* ``checkpoint`` atomic save / resume; ``metrics``: metrics.jsonl, TensorBoard, progress.
* ``samples``    samples.jsonl and TensorBoard text: a few samples per step.
* ``precision``  bf16 autocast of forwards (``run { precision = bf16 }``).
* ``compute``    driver-side stages (GAE, losses, ...).

Reading a run folder (``rlhfc export``): ``export``, a checkpoint's model as a Hugging Face folder.
"""

from .data import JsonlPrompts, PromptSource, SyntheticPrompts, prompt_source_from_spec, repeat_each
from .generation import (
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
from .models import (
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
from .rewards import resolve_rule, rule_scores
from .tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

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
