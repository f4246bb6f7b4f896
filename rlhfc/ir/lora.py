"""LoRA adapters of a model (``model @actor {…, lora = {alpha = 16, rank = 8, targets = ["q_proj", "v_proj"]}}``):
the modules each architecture lets adapters target, the adapter parameter count, and the check of the
setting (the runtime side is :mod:`rlhfc.runtime.models.lora`, through peft)."""

from __future__ import annotations

#: per architecture: the module names adapters may target, each with its (in, out) features per layer as a
#: function of (hidden, kv_dim, ffn) — one pair per module of that name in a layer (gpt2's c_proj is in the
#: attention and in the MLP)
LORA_TARGETS: dict[str, dict[str, tuple]] = {
    "llama": {"q_proj": (lambda h, kv, f: (h, h),), "k_proj": (lambda h, kv, f: (h, kv),),
              "v_proj": (lambda h, kv, f: (h, kv),), "o_proj": (lambda h, kv, f: (h, h),),
              "gate_proj": (lambda h, kv, f: (h, f),), "up_proj": (lambda h, kv, f: (h, f),),
              "down_proj": (lambda h, kv, f: (f, h),)},
    "gpt2": {"c_attn": (lambda h, kv, f: (h, h + 2 * kv),),
             "c_proj": (lambda h, kv, f: (h, h), lambda h, kv, f: (f, h)),
             "c_fc": (lambda h, kv, f: (h, f),)},
}
#: what ``lora(...)`` targets when the program names nothing: the attention's query and value projections
#: (the LoRA paper's choice; gpt2 fuses q, k, v into c_attn)
DEFAULT_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
LORA_KEYS = ("alpha", "rank", "targets")


def lora_params(m) -> int:
    """Adapter parameters of model ``m`` (``r · (in + out)`` per targeted module and layer); 0 without."""
    if not m.lora:
        return 0
    kv = m.kv_heads * (m.hidden // m.heads)
    per_layer = sum(sum(i + o for i, o in (fn(m.hidden, kv, m.ffn) for fn in LORA_TARGETS[m.arch][t]))
                    for t in m.lora["targets"])
    return int(m.lora["rank"]) * per_layer * m.layers


def lora_problems(m) -> list[tuple[str, str, str]]:
    """What is wrong with ``m.lora``: (field, message, hint) triples, empty when it is well formed."""
    lora, out = m.lora, []
    if not isinstance(lora, dict) or set(lora) != set(LORA_KEYS):
        return [("lora", f"lora must be {{alpha = A, rank = R, targets = [...]}}, got {lora!r}",
                 "in a program: lora(rank = 8, alpha = 16, targets = [q_proj, v_proj])")]
    rank, alpha, targets = lora["rank"], lora["alpha"], lora["targets"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        out.append(("lora.rank", f"the LoRA rank must be a positive integer, got {rank!r}", "e.g. rank = 8"))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        out.append(("lora.alpha", f"the LoRA alpha must be a positive number, got {alpha!r}",
                    "e.g. alpha = 16 (the adapter's output is scaled by alpha / rank)"))
    known = LORA_TARGETS.get(m.arch, {})
    if not isinstance(targets, list) or not targets:
        out.append(("lora.targets", "LoRA needs at least one target module",
                    f"e.g. targets = [{', '.join(DEFAULT_TARGETS.get(m.arch, ['q_proj']))}]"))
    else:
        for t in targets:
            if t not in known:
                out.append(("lora.targets", f"a {m.arch} model has no module '{t}' to put an adapter on",
                            f"{m.arch} modules: {', '.join(known)}"))
    if not m.trainable:
        out.append(("lora", f"model '{m.name}' is frozen: its LoRA adapters would never train",
                    "mark the model trainable, or drop lora(...)"))
    if m.head != "lm":
        out.append(("lora", f"LoRA adapters are for policies (head = lm), not head = {m.head}",
                    "train the critic or reward model in full: drop lora(...)"))
    return out


__all__ = ["DEFAULT_TARGETS", "LORA_KEYS", "LORA_TARGETS", "lora_params", "lora_problems"]
