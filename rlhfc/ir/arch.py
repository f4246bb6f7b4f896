"""Built-in model architectures, published size presets, and parameter counts.

Parameter counts follow each architecture's layer shapes exactly (embeddings,
attention with grouped KV heads, gated MLP for llama / plain MLP for gpt2,
norms, output head), so ``llama(size = 7B)`` reports about 6.74e9 and
``llama(size = 70B)`` about 6.9e10 — the figures the cost model builds on.
"""

from __future__ import annotations

ARCHS = ("llama", "gpt2")
HEADS = ("lm", "value", "score")

#: Published configurations (Llama 2 7B/13B/70B, Code Llama 34B; GPT-2 family).
PRESETS: dict[str, dict[str, dict[str, int]]] = {
    "llama": {
        "7B": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, max_seq=4096),
        "13B": dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000, max_seq=4096),
        "34B": dict(layers=48, hidden=8192, heads=64, kv_heads=8, ffn=22016, vocab=32000, max_seq=16384),
        "70B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, max_seq=4096),
    },
    "gpt2": {
        "124M": dict(layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, max_seq=1024),
        "355M": dict(layers=24, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=50257, max_seq=1024),
        "774M": dict(layers=36, hidden=1280, heads=20, kv_heads=20, ffn=5120, vocab=50257, max_seq=1024),
        "1.5B": dict(layers=48, hidden=1600, heads=25, kv_heads=25, ffn=6400, vocab=50257, max_seq=1024),
    },
}

#: Config fields of every architecture, in canonical order.
ARCH_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_seq")


def default_ffn(arch: str, hidden: int) -> int:
    """FFN width when a program does not give one: 4h for gpt2; llama's 8h/3 rounded up to a multiple of 32."""
    if arch == "gpt2":
        return 4 * hidden
    return -(-(8 * hidden // 3) // 32) * 32


def param_count(arch: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                vocab: int, max_seq: int, head: str = "lm") -> int:
    """Exact parameter count of the built model (the runtime builds the same shapes)."""
    head_dim = hidden // heads
    kv_dim = kv_heads * head_dim
    if arch == "llama":
        attn = hidden * hidden * 2 + hidden * kv_dim * 2          # q, o  +  k, v (no biases)
        mlp = 3 * hidden * ffn                                     # gate, up, down
        norms = 2 * hidden
        trunk = vocab * hidden + layers * (attn + mlp + norms) + hidden   # + final norm
        out = vocab * hidden if head == "lm" else hidden + 1       # untied lm head / scalar head
        return trunk + out
    if arch == "gpt2":
        attn = hidden * (hidden + 2 * kv_dim) + (hidden + 2 * kv_dim) + hidden * hidden + hidden
        mlp = 2 * hidden * ffn + ffn + hidden
        norms = 4 * hidden
        trunk = vocab * hidden + max_seq * hidden + layers * (attn + mlp + norms) + 2 * hidden
        out = 0 if head == "lm" else hidden + 1                    # gpt2 ties its lm head to the embedding
        return trunk + out
    raise ValueError(f"unknown architecture {arch!r}")


def human_count(n: int | float) -> str:
    """``6738415616`` -> ``'6.74B'``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))
