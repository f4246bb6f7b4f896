"""What a transformer block keeps for backward, op by op: a ``torch.fx`` trace of the block the runtime trains.

:func:`trace_block` builds one block of a model (Hugging Face ``LlamaDecoderLayer`` / ``GPT2Block`` from the
model's config, as the runtime does; weights on no device) and traces its forward with
:func:`torch.fx.experimental.proxy_tensor.make_fx` on fake tensors of the training micro-batch's shape
(``rows x seq``) — no memory is allocated, so a 70B block traces in a second. A model is traced once
(:func:`_scaled`: at two primes no other dimension shares, so every size is a monomial ``c · rows^a · seq^b``
read off by division) and each micro-batch shape evaluates those polynomials — the same numbers as a fresh
trace at that shape (:func:`fresh_trace`; a test compares them). On the aten-level graph:

- :class:`torch.fx.passes.shape_prop.ShapeProp` gives every node's output shape and dtype;
- the graph is run once more under autograd (still fake) inside
  :func:`torch.autograd.graph.saved_tensors_hooks`: every tensor autograd saves is attributed to the node that
  allocated its storage, so each node knows the bytes backward *needs* of it (views share their base's
  storage; the block's inputs and the weights are not activations);
- each node gets a time to recompute it by its *kind* (:func:`op_kind`): a matrix product (``matmul``) its
  FLOPs at the matmul rate; a ``softmax``, an ``elementwise`` op (arithmetic, activations, reductions) or a
  ``copy`` (clones, concatenations, casts) the bytes it moves at that kind's bandwidth (``kind_bw``; the
  one ``bytes_per_s`` where a kind has none) — softmax's exponentials make it several times slower per
  byte than an add on a CPU — plus a per-op cost. :func:`reprice` prices a trace again at other rates (a
  profile's, or rates fitted from a measured block forward: :func:`fit_kind_rates`).

The node keys (``mm.default#3``: the 4th ``aten.mm`` call) are the names the runtime's selective checkpoint
policy counts (:mod:`rlhfc.runtime.models.recompute`). :mod:`rlhfc.passes.recompute_choice` chooses from this.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from rlhfc.contract.rules import op_key

from .trace_cache import BUNDLED, RawOp, bundled_keys, load, monomials, primes_above, save, value_at

#: tiny proxy shapes whose dimensions are all distinct: a captured block input's dims map back by size
_PROXY = {"rows": 3, "seq": 7, "head_dim": 4, "heads": 2}


@dataclass(frozen=True)
class OpNode:
    """One aten call of the block's forward.

    ``key``: ``<op>.<overload>#<k>``; ``bytes``: bytes of the storages it allocates (0 for views/aliases);
    ``needed``: of those, the bytes autograd saves for backward; ``seconds``: its time to (re)compute;
    ``core_attention``: part of softmax(QK^T)V (what Megatron's ``selective`` recomputes); ``saves``: whether
    its backward keeps any tensor (a checkpoint's recompute runs until the last op that does); ``kind``: its
    op kind (:func:`op_kind`), ``moved``: bytes it reads and writes (what a memory-bound kind is priced by)."""

    name: str
    key: str
    bytes: int
    needed: int
    seconds: float
    flops: float
    core_attention: bool
    saves: bool = False
    kind: str = "elementwise"
    moved: float = 0.0


@dataclass(frozen=True)
class BlockTrace:
    """The traced block: its ops in forward order, and ``autograd_bytes`` (what plain autograd keeps, block
    inputs and weights excluded), ``input_bytes`` (the hidden-state input, kept under every policy);
    ``ckpt_region_s`` / ``ckpt_op_s``: what a checkpointed block pays beyond its replayed ops, per block and
    per aten call a selective checkpoint dispatches (:mod:`rlhfc.passes.recompute_prices`; 0 unless priced);
    ``ckpt_forward_op_s``: per call of the forward's, where measured on the model's own block (else ``ckpt_op_s``)."""

    arch: str
    rows: int
    seq: int
    nodes: tuple[OpNode, ...]
    autograd_bytes: int
    input_bytes: int
    forward_s: float
    notes: tuple[str, ...] = field(default=())
    ckpt_region_s: float = 0.0
    ckpt_op_s: float = 0.0
    ckpt_forward_op_s: float | None = None


def _hf_block(arch: str, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, attn: str):
    # the configuration modules themselves, not ``transformers``' lazy top level (which loads every name asked of it)
    if arch == "llama":
        from transformers.models.llama.configuration_llama import LlamaConfig

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=1,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False)
    else:
        from transformers.models.gpt2.configuration_gpt2 import GPT2Config

        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_inner=ffn, n_layer=1, n_head=heads,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    return cfg


@functools.lru_cache(maxsize=8)
def _block_inputs(arch: str, attn: str):
    """(args, kwargs) the model passes its first block, captured from a tiny real model on a left-padded batch
    of ``_PROXY`` shape (as the runtime feeds it: position ids counting real tokens only)."""
    import torch

    p = _PROXY
    hidden = p["heads"] * p["head_dim"]
    cfg = _hf_block(arch, hidden, p["heads"], p["heads"], 16, 11, attn)
    torch.manual_seed(0)
    if arch == "llama":   # the model class itself: AutoModel's mapping would import more of transformers
        from transformers.models.llama.modeling_llama import LlamaModel

        model = LlamaModel(cfg)
        block = model.layers[0]
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Model

        model = GPT2Model(cfg)
        block = model.h[0]
    seen = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    ids = torch.ones(p["rows"], p["seq"], dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    hook.remove()
    return seen["args"], seen["kwargs"]


def _flops(node) -> int:
    """FLOPs of the matrix products and attention; 0 for the rest (priced by bytes moved)."""
    name = str(node.target)
    shapes = [a.meta["tensor_meta"].shape for a in node.args if hasattr(a, "meta") and "tensor_meta" in a.meta]
    if name in ("aten.mm.default", "aten.addmm.default") and len(shapes) >= 2:
        (m, k), n = shapes[-2], shapes[-1][-1]
        return 2 * int(m) * int(k) * int(n)
    if name == "aten.bmm.default" and len(shapes) == 2:
        b, m, k = shapes[0]
        return 2 * int(b) * int(m) * int(k) * int(shapes[1][-1])
    if "scaled_dot_product" in name and len(shapes) >= 3:
        q, k = shapes[0], shapes[1]
        return 4 * int(q[0]) * int(q[1]) * int(q[2]) * int(k[2]) * int(q[3])
    return 0


_MATMULS = ("aten.bmm.default", "aten.matmul.default", "aten.mm.default")

#: op kinds a recompute is priced by (see the module docstring)
OP_KINDS = ("matmul", "softmax", "elementwise", "copy", "view")
_COPIES = ("clone", "_to_copy", "copy", "cat", "index", "gather", "embedding", "expand_copy", "slice_scatter")


def op_kind(name: str, flops: float, fresh: int) -> str:
    """The kind of aten op ``name`` (``"aten.add.Tensor"``): ``matmul`` (it has FLOPs), ``softmax``, ``copy``,
    ``view`` (allocates nothing) or ``elementwise`` (the rest: arithmetic, activations, norms' reductions)."""
    base = name[5:].split(".")[0] if name.startswith("aten.") else name
    if flops:
        return "matmul"
    if not fresh:
        return "view"
    if "softmax" in base:
        return "softmax"
    if base in _COPIES:
        return "copy"
    return "elementwise"


def _seconds(kind: str, flops: float, moved: float, flops_per_s: float, bytes_per_s: float, kind_bw: dict,
             op_s: float) -> float:
    # an op that allocates and computes nothing (a view) is priced free: its few microseconds of dispatch would
    # make the estimate depend on how many views a transformers release writes into a block
    if not moved and not flops:
        return 0.0
    if kind == "matmul":
        return max(flops / flops_per_s, moved / kind_bw.get("matmul", bytes_per_s)) + op_s
    return moved / kind_bw.get(kind, bytes_per_s) + op_s


def core_attention(graph) -> set[str]:
    """The nodes of softmax(QK^T)V: a fused attention op, or (eager attention) each softmax with what lies
    between it and the products on either side (scale, mask, dropout, views), those products included."""
    out = set()
    for n in graph.nodes:
        name = str(n.target)
        if "scaled_dot_product" in name:
            out.add(n.name)
        if "softmax" not in name or "backward" in name:
            continue
        todo = [(n, "up"), (n, "down")]
        while todo:
            x, way = todo.pop()
            if x.name in out and x is not n:
                continue
            out.add(x.name)
            if x is not n and str(x.target) in _MATMULS:
                continue
            nxt = [a for a in x.args if hasattr(a, "op") and a.op == "call_function"] if way == "up" else list(x.users)
            todo.extend((y, way) for y in nxt if y.op == "call_function")
    return out


def trace_block(*args, **kwargs) -> BlockTrace:
    """Trace one block at a micro-batch of ``rows x seq`` tokens (see the module docstring); cached. Arguments:
    ``arch, hidden, heads, kv_heads, ffn, vocab, rows, seq``; keywords ``dtype``, ``attn`` (the runtime's
    attention implementation), ``flops_per_s``, ``bytes_per_s``, ``kind_bw`` (``((kind, bytes/s), ...)``: the
    bandwidth of each memory-bound op kind, ``bytes_per_s`` for the others), ``op_s`` (the rates op times are
    priced at)."""
    import warnings

    with warnings.catch_warnings():   # torch's pytree deprecation notes while tracing are not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        return _trace_block(*args, **kwargs)


@functools.lru_cache(maxsize=256)
def _trace_block(arch: str, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, rows: int, seq: int,
                 *, dtype: str = "float32", attn: str = "sdpa", flops_per_s: float = 50e9,
                 bytes_per_s: float = 8e9, kind_bw: tuple = (), op_s: float = 5e-6) -> BlockTrace:
    ops, autograd = _scaled(arch, hidden, heads, kv_heads, ffn, vocab, dtype, attn)
    return _priced(arch, rows, seq, hidden, dtype, [op.at(rows, seq) for op in ops],
                   value_at(autograd, rows, seq), flops_per_s, bytes_per_s, kind_bw, op_s)


def fresh_trace(arch: str, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, rows: int, seq: int,
                *, dtype: str = "float32", attn: str = "sdpa", flops_per_s: float = 50e9, bytes_per_s: float = 8e9,
                kind_bw: tuple = (), op_s: float = 5e-6) -> BlockTrace:
    """:func:`trace_block` traced at ``rows x seq`` itself rather than scaled from the model's one trace (what
    the tests compare the scaled trace with; not cached)."""
    ops, autograd = _raw_trace(arch, hidden, heads, kv_heads, ffn, vocab, rows, seq, dtype, attn)
    return _priced(arch, rows, seq, hidden, dtype, [op.at(rows, seq) for op in ops],
                   value_at(autograd, rows, seq), flops_per_s, bytes_per_s, kind_bw, op_s)


def _priced(arch, rows, seq, hidden, dtype, ops, autograd, flops_per_s, bytes_per_s, kind_bw, op_s) -> BlockTrace:
    """The :class:`BlockTrace` of evaluated ops (``(name, target, fresh, needed, moved, flops, core, saves)``)
    and ``autograd`` bytes."""
    nodes = []
    counts: dict[str, int] = {}
    for name, target, fresh, needed, moved, flops, core, saves in ops:
        k = counts.get(target, 0)
        counts[target] = k + 1
        moved = moved if fresh else 0.0   # a view moves nothing
        kind = op_kind(target, flops, fresh)
        seconds = _seconds(kind, flops, moved, flops_per_s, bytes_per_s, dict(kind_bw), op_s)
        nodes.append(OpNode(name, op_key(target, k), fresh, needed, seconds, flops, core, saves, kind, moved))
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return BlockTrace(arch, rows, seq, tuple(nodes), autograd, rows * seq * hidden * size,
                      sum(x.seconds for x in nodes))


@functools.lru_cache(maxsize=16)
def _scaled(arch: str, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, dtype: str, attn: str):
    """The block traced once per model, at ``rows`` and ``seq`` two primes larger than any of its dimensions:
    every size a tensor of the trace has is then ``c · rows^a · seq^b`` with ``c`` a product of the model's
    dimensions, which neither prime divides, so ``a`` and ``b`` are read off by division. The ops at another
    micro-batch shape are these polynomials evaluated there (a test checks them against a fresh trace). Kept
    on disk too (:mod:`rlhfc.passes.trace_cache`): a compile in a new process neither imports torch and
    transformers nor traces again."""
    key = (arch, hidden, heads, kv_heads, ffn, vocab, dtype, attn)
    cached = load(key)
    if cached is not None:
        return cached
    ops, autograd = traced(key)
    save(key, ops, autograd)
    return ops, autograd


def traced(key: tuple) -> tuple[list[RawOp], tuple]:
    """The block of ``key`` (``(arch, hidden, heads, kv_heads, ffn, vocab, dtype, attn)``) traced afresh, at the
    two primes :func:`_scaled` describes."""
    arch, hidden, heads, kv_heads, ffn, vocab, dtype, attn = key
    rows, seq = primes_above(max(hidden, heads, kv_heads, ffn, 64), 2)
    return _raw_trace(arch, hidden, heads, kv_heads, ffn, vocab, rows, seq, dtype, attn)


def bundle(folder: str = BUNDLED) -> list[str]:
    """Trace every :func:`~rlhfc.passes.trace_cache.bundled_keys` block under the installed torch and transformers
    and write it to ``folder`` (the traces that ship with rlhfc; run with the versions ``constraints.txt`` pins:
    ``python -m rlhfc.passes.recompute_trace``); returns the files written."""
    written = (save(key, *traced(key), folder) for key in bundled_keys())
    return [path for path in written if path is not None]


def _raw_trace(arch, hidden, heads, kv_heads, ffn, vocab, rows, seq, dtype, attn) -> tuple[list[RawOp], tuple]:
    """The block's aten ops traced at ``rows x seq`` (see the module docstring) and the bytes autograd saves in
    all, sizes as sums of monomials in ``rows`` and ``seq`` (:class:`RawOp`: a true polynomial when those
    are primes no other dimension shares; at other shapes, exact at ``rows x seq`` only)."""
    import warnings

    with warnings.catch_warnings():   # torch's pytree deprecation notes while tracing are not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        return _raw_trace_inner(arch, hidden, heads, kv_heads, ffn, vocab, rows, seq, dtype, attn)


def _raw_trace_inner(arch, hidden, heads, kv_heads, ffn, vocab, rows, seq, dtype, attn):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx import Interpreter
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.shape_prop import ShapeProp
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._pytree import tree_flatten, tree_unflatten

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    args, kwargs = _block_inputs(arch, attn)
    p = _PROXY
    dims = {p["rows"]: rows, p["seq"]: seq, p["heads"] * p["head_dim"]: hidden, p["head_dim"]: hidden // heads}
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    cfg = _hf_block(arch, hidden, heads, kv_heads, ffn, vocab, attn)
    with torch.device("meta"):
        if arch == "llama":
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer
            block = LlamaDecoderLayer(cfg, layer_idx=0)
        else:
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block
            block = GPT2Block(cfg, layer_idx=0)
    block.train()
    fake = FakeTensorMode()
    with fake:
        state = {k: torch.empty(v.shape, dtype=torch_dtype) for k, v in
                 list(block.named_parameters()) + list(block.named_buffers())}
        inputs = []
        for i in where:
            t = flat[i]
            shape = [dims.get(d, d) for d in t.shape]
            dt = torch_dtype if t.is_floating_point() else t.dtype
            inputs.append(torch.empty(shape, dtype=dt))

        def run(state, *tensors):
            vals = list(flat)
            for i, t in zip(where, tensors):
                vals[i] = t
            a, k = tree_unflatten(vals, spec)
            return torch.func.functional_call(block, state, a, k)

        gm = make_fx(run)(state, *inputs)
        flat_in = tree_flatten((state, *inputs))[0]
        ShapeProp(gm).propagate(*flat_in)
        # autograd on the traced ops: which storages backward keeps, and who allocated them
        # the weights and the hidden states need gradients; rotary tables and masks do not (as at run time)
        n_state = len(tree_flatten(state)[0])
        grad_in = [t.detach().requires_grad_(t.is_floating_point() and i <= n_state) for i, t in enumerate(flat_in)]
        owner = {StorageWeakRef(t.untyped_storage()).cdata: None for t in grad_in}
        held, current, savers = [], [None], set()

        class Owners(Interpreter):
            def run_node(self, n):
                current[0] = n.name
                out = super().run_node(n)
                if n.op == "call_function":
                    for t in tree_flatten(out)[0]:
                        if isinstance(t, torch.Tensor):
                            held.append(t)
                            owner.setdefault(StorageWeakRef(t.untyped_storage()).cdata, n.name)
                return out

        saved: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            saved[StorageWeakRef(s).cdata] = s.nbytes()
            savers.add(current[0])
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            Owners(gm).run(*grad_in)
        fresh: dict[str, list] = {}      # node -> bytes of each storage it allocated
        needed: dict[str, list] = {}     # node -> bytes of those that autograd saved
        counted: set[int] = set()
        for t in held:
            s = t.untyped_storage()
            key = StorageWeakRef(s).cdata
            name = owner.get(key)
            if name is None or key in counted:
                continue
            counted.add(key)
            fresh.setdefault(name, []).append(s.nbytes())
            if key in saved:
                needed.setdefault(name, []).append(s.nbytes())
    core = core_attention(gm.graph)
    ops = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not str(n.target).startswith("aten."):
            continue
        ops.append(RawOp(n.name, str(n.target), monomials(fresh.get(n.name, ()), rows, seq),
                          monomials(needed.get(n.name, ()), rows, seq), monomials(_moved_bytes(n), rows, seq),
                          monomials([_flops(n)], rows, seq), n.name in core, n.name in savers))
    return ops, monomials([b for bs in needed.values() for b in bs], rows, seq)


def _moved_bytes(node) -> list[int]:
    """The bytes of each tensor ``node`` writes or reads (its outputs and tensor arguments)."""
    out = []
    for m in [node.meta.get("tensor_meta")] + [a.meta.get("tensor_meta") for a in node.args if hasattr(a, "meta")]:
        for t in (m if isinstance(m, (list, tuple)) and not hasattr(m, "shape") else [m]):
            if t is not None and hasattr(t, "shape"):
                n = 1
                for d in t.shape:
                    n *= int(d)
                out.append(n * t.dtype.itemsize)
    return out


def reprice(trace: BlockTrace, flops_per_s: float, kind_bw: dict[str, float], op_s: float = 5e-6) -> BlockTrace:
    """``trace`` with every op priced again by its kind at these rates (``kind_bw``: bytes/s of each
    memory-bound kind, the fastest of them bounding a matrix product's memory traffic; a kind left out keeps
    its ops' times)."""
    from dataclasses import replace

    bw = max(kind_bw.values(), default=float("inf"))
    nodes = tuple(replace(n, seconds=_seconds(n.kind, n.flops, n.moved, flops_per_s, bw, kind_bw, op_s))
                  if n.kind == "matmul" or n.kind in kind_bw else n for n in trace.nodes)
    return replace(trace, nodes=nodes, forward_s=sum(n.seconds for n in nodes))


def fit_kind_rates(trace: BlockTrace, seconds: dict[str, float], op_s: float = 5e-6) -> tuple[float, dict]:
    """Per op kind, the rate a measured block forward ran at (``seconds`` by op key: a profile): matmul
    FLOP/s, and the bytes/s of each memory-bound kind — Σ work / Σ (measured seconds − per-op cost) over
    the kind's ops. Returns (flops_per_s, {kind: bytes/s})."""
    work: dict[str, float] = {}
    spent: dict[str, float] = {}
    for n in trace.nodes:
        if n.key not in seconds or n.kind == "view":
            continue
        work[n.kind] = work.get(n.kind, 0.0) + (n.flops if n.kind == "matmul" else n.moved)
        spent[n.kind] = spent.get(n.kind, 0.0) + max(seconds[n.key] - op_s, 1e-9)
    rates = {k: work[k] / spent[k] for k in work if work[k] > 0}
    return rates.pop("matmul", 0.0), rates


def retime(trace: BlockTrace, seconds: dict[str, float]) -> BlockTrace:
    """``trace`` with the op times measured on the device (``seconds`` by op key, e.g. from timing each aten
    call of a real block forward: a profile); ops not measured keep their estimate."""
    from dataclasses import replace

    nodes = tuple(replace(n, seconds=float(seconds.get(n.key, n.seconds))) for n in trace.nodes)
    return replace(trace, nodes=nodes, forward_s=sum(n.seconds for n in nodes))


if __name__ == "__main__":   # python -m rlhfc.passes.recompute_trace: write the shipped traces anew
    for path in bundle():
        print(path)
