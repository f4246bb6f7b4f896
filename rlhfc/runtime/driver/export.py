"""Models out of a run folder: a checkpoint's model as a Hugging Face folder (``rlhfc export``).

:func:`export_model` reads ``OUT/checkpoints/step_K/<worker>/weights.safetensors`` (every trainer writes
the single-rank model's layout there) into the model the runtime builds from its spec, and saves the
Hugging Face module inside it with ``save_pretrained`` (``config.json``, ``model.safetensors``), so
``transformers`` loads exactly the weights and architecture the trainer ran:

* head ``lm`` (the policy) → ``AutoModelForCausalLM``: the same log-probs as the trainer;
* head ``score`` (a reward model) → ``AutoModelForSequenceClassification`` with ``num_labels = 1``: its
  logit is the score at each row's last token that is not padding (the trainer's score when no padding
  sits between tokens); refused when the head has a non-zero bias, which that class's layer lacks;
* head ``value`` (a critic) → ``AutoModelForTokenClassification`` with ``num_labels = 1``: one value per
  token, the trainer's ``values``.

Tokenizer: a model loaded from a Hugging Face folder gets that folder's tokenizer files copied; a
config-built model gets the built-in character tokenizer (:class:`~rlhfc.runtime.data.tokenizer.CharTokenizer`)
as a ``tokenizers`` ``tokenizer.json`` (with ``tokenizer_config.json``), which ``AutoTokenizer`` loads and
which encodes and decodes as the runtime does (:func:`char_tokenizer_fast`).

Which model: :func:`find_model` reads the run's plan (``OUT/job/plan.json``, or a given job folder) and,
without one, the checkpoint's manifest (config-built models only).
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import torch

from rlhfc.contract.plan import Plan, PlanFormatError, load_plan
from rlhfc.runtime.data.tokenizer import CharTokenizer
from rlhfc.runtime.errors import JobError
from rlhfc.runtime.models.build import build_model, load_weights, set_weights

from .checkpoint import checkpoint_root, latest_checkpoint, read_meta

__all__ = ["ExportError", "find_checkpoint", "find_model", "export_model", "char_tokenizer_fast"]

#: files of a Hugging Face folder that belong to its tokenizer (copied as they are)
TOKENIZER_PATTERNS = ("tokenizer*", "vocab.*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                      "spiece.model", "sentencepiece.bpe.model", "chat_template.*")


class ExportError(JobError):
    """A run folder, checkpoint or model that cannot be exported; exit status 2."""

    exit_code = 2


def find_checkpoint(run: str, step: int | None = None) -> str:
    """The checkpoint folder of ``run``: ``step_{step}``, or the latest."""
    if not os.path.isdir(run):
        raise ExportError(f"run folder {run} does not exist", "give the --out folder of a run (default runs/<program>)")
    root = checkpoint_root(run)
    have = sorted((int(m.group(1)) for d in (os.listdir(root) if os.path.isdir(root) else ())
                   if (m := re.fullmatch(r"step_(\d+)", d)) and os.path.isfile(os.path.join(root, d, "job.json"))))
    if not have:
        raise ExportError(f"run folder {run} has no checkpoint", "a run writes one at its end and every "
                          "checkpoint_every steps; train (or resume) it first")
    if step is None:
        return latest_checkpoint(root) or os.path.join(root, f"step_{have[-1]}")
    if step not in have:
        raise ExportError(f"run folder {run} has no checkpoint of step {step}",
                          f"its checkpoints: {', '.join(f'step {s}' for s in have)}")
    return os.path.join(root, f"step_{step}")


def _plan(run: str, job: str | None) -> Plan | None:
    path = os.path.join(job or os.path.join(run, "job"), "plan.json")
    if not os.path.isfile(path):
        if job:
            raise ExportError(f"{job} is not a job folder (no plan.json)", "give the job folder the run ran")
        return None
    try:
        return load_plan(path)
    except PlanFormatError as exc:
        raise ExportError(exc.message, exc.hint) from None


def find_model(run: str, checkpoint: str, name: str | None, job: str | None = None) -> tuple[str, dict, str]:
    """(model name, its spec, its worker folder in ``checkpoint``); ``name`` None: the policy — the one
    trained model with an lm head (a frozen reference copy is not it), or the one lm-head model."""
    plan = _plan(run, job)
    manifest = read_meta(checkpoint).get("manifest", {})
    if plan is not None:
        specs = {m: entry.spec.as_dict() for m, entry in plan.models.items()}
        workers = {w: entry.model for w, entry in plan.placement.workers.items()}
        trained = plan.trained_models()
    else:   # the manifest's shapes: enough to build config models
        specs = {m: {k: v for k, v in s.items() if k != "params"} for m, s in manifest.get("models", {}).items()}
        workers = {m: m for m in specs}
        trained = set(manifest.get("algorithm", {}).get("train", {}))
    if name is None:   # the policy: the trained model with an lm head (else the only lm-head model)
        lm = sorted(m for m, s in specs.items() if s.get("head", "lm") == "lm")
        policies = [m for m in lm if m in trained] or lm
        if len(policies) != 1:
            raise ExportError(f"the run has {len(policies)} {'trained ' if trained & set(lm) else ''}models with "
                              f"an lm head ({', '.join(policies) or 'none'})",
                              f"choose one with --model (models: {', '.join(sorted(specs))})")
        name = policies[0]
    if name not in specs:
        raise ExportError(f"the run has no model '{name}'", f"models: {', '.join(sorted(specs))}")
    saved = [w for w, m in workers.items() if m == name and os.path.isfile(os.path.join(checkpoint, w,
                                                                                        "weights.safetensors"))]
    if not saved:
        raise ExportError(f"checkpoint {checkpoint} holds no weights of model '{name}'",
                          "the checkpoint was written by another job; give its job folder with --job")
    spec = specs[name]
    if spec.get("source") and not os.path.isdir(spec["source"]):
        raise ExportError(f"model '{name}' was loaded from {spec['source']}, which no longer exists",
                          "its config and tokenizer come from that folder: restore it, or export on the "
                          "machine that ran the job")
    return name, spec, os.path.join(checkpoint, sorted(saved)[0])


def export_model(spec: dict, worker_folder: str, out: str) -> str:
    """Write the model saved in ``worker_folder`` (built from ``spec``) to ``out`` as a Hugging Face folder;
    returns the ``transformers`` Auto class that loads it."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    try:
        model = build_model(spec, seed=0)
        load_weights(model, os.path.join(worker_folder, "weights.safetensors"))
        if spec.get("lora"):   # LoRA adapters merged into the weights: a plain model, as transformers loads it
            from rlhfc.runtime.models.lora import merged_state

            merged = build_model({**spec, "lora": None}, seed=0)
            set_weights(merged, merged_state(model))
            model = merged
    except (RuntimeError, ValueError, OSError) as exc:   # shapes or names that differ, a damaged file
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"the weights in {worker_folder} do not fit the model the plan describes: {first}",
                          "export with the job folder that wrote the checkpoint (--job), or check the file") from None
    head = model.spec["head"]
    if head == "lm":
        hf, auto = model.hf, "AutoModelForCausalLM"
    else:
        config = model.trunk.config.__class__.from_dict(model.trunk.config.to_dict())
        config.num_labels = 1
        cls = AutoModelForSequenceClassification if head == "score" else AutoModelForTokenClassification
        hf = cls.from_config(config).to(model.trunk.dtype)
        hf.base_model.load_state_dict(model.trunk.state_dict())
        layer = _scalar_layer(hf, model.hidden_size)
        if layer.bias is None and model.head.bias is not None and bool(model.head.bias.ne(0).any()):
            raise ExportError(f"the score head has a bias ({float(model.head.bias.detach()[0]):+.6g}), which "
                              f"{type(hf).__name__}'s layer has not, so it would score otherwise",
                              "export the policy instead, or read weights.safetensors of the checkpoint directly")
        with torch.no_grad():
            layer.weight.copy_(model.head.weight)
            if layer.bias is not None:
                layer.bias.copy_(model.head.bias if model.head.bias is not None else torch.zeros(1))
        auto = cls.__name__
    hf.eval()
    hf.save_pretrained(out, safe_serialization=True)
    if model.spec.get("source"):
        for pattern in TOKENIZER_PATTERNS:
            for path in glob.glob(os.path.join(model.spec["source"], pattern)):
                if os.path.isfile(path):
                    shutil.copy2(path, out)
    else:
        char_tokenizer_fast(CharTokenizer(model.spec["vocab"])).save_pretrained(out)
    return auto


def _scalar_layer(hf, hidden: int) -> torch.nn.Linear:
    """The ``Linear(hidden, 1)`` a ``*ForSequenceClassification`` / ``*ForTokenClassification`` adds."""
    for name, module in hf.named_children():
        if isinstance(module, torch.nn.Linear) and module.in_features == hidden and module.out_features == 1:
            return module
    raise ExportError(f"{type(hf).__name__} has no Linear({hidden}, 1) layer", "report it")


def char_tokenizer_fast(tok: CharTokenizer):
    """The built-in character tokenizer as a ``transformers.PreTrainedTokenizerFast``: ids 0/1/2 are
    ``<pad>``, ``<s>``, ``</s>``; each character of ``tok.chars`` is one token; unused ids up to the vocab
    are ``<unused_K>``. Normalisation does what :meth:`CharTokenizer.encode` does: an uppercase letter
    outside the vocabulary becomes lowercase, any other character outside it a space (or nothing). With
    special tokens (transformers' default) a text gets ``<s>`` in front, as the runtime encodes a prompt."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({c: i + tok.num_special for i, c in enumerate(tok.chars)})
    for i in range(len(vocab), tok.vocab_size):
        vocab[f"<unused_{i}>"] = i
    known = set(tok.chars)
    steps = [normalizers.Replace(c, c.lower()) for c in map(chr, range(65, 91))
             if c not in known and c.lower() in known]
    other = " " if " " in known else ""
    steps.append(normalizers.Replace(Regex("[^" + "".join(re.escape(c) for c in tok.chars) + "]"), other))
    core = Tokenizer(BPE(vocab=vocab, merges=[]))   # no merges: one token per character, no pre-tokenizer
    core.normalizer = normalizers.Sequence(steps)
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
