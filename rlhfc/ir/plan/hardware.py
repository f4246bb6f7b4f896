"""The hardware rules every mesh and parallel split obeys (one home for them: placement, the cost model's
candidate lists, baselines and tests read them here).

- A **mesh** is node-aligned: it lies inside one node, or it is whole nodes (starts at a node boundary
  and spans a multiple of the node's devices). A mesh that straddles nodes puts half of its ranks
  behind the slow inter-node link for no gain.
- **tp** divides the model's attention heads and its key/value heads (each rank holds whole heads), and
  every tensor-parallel group (``tp`` consecutive devices of the mesh) stays inside one node (tp
  all-reduces every layer: NVLink, never the network).
- **pp** divides the model's layer count (every pipeline stage holds as many layers).
- **dp · tp · pp** is the mesh's device count.
"""

from __future__ import annotations

import math

from .attrs import Layout


def mesh_aligned(first: int, count: int, per_node: int) -> bool:
    """Whether devices ``first .. first+count-1`` lie inside one node or are whole nodes."""
    per_node = max(per_node, 1)
    if count <= 0 or first < 0:
        return False
    inside = first // per_node == (first + count - 1) // per_node
    whole = first % per_node == 0 and count % per_node == 0
    return inside or whole


def tp_within_nodes(first: int, count: int, tp: int, per_node: int) -> bool:
    """Whether every tensor-parallel group of ``tp`` consecutive devices of the mesh stays inside a node."""
    per_node = max(per_node, 1)
    if tp <= 1:
        return True
    # a group's offset in its node repeats every per_node / gcd(tp, per_node) groups: check one period at most
    groups = min(-(-count // tp), per_node // math.gcd(tp, per_node))
    return all(((g := first + k * tp) // per_node) == ((g + tp - 1) // per_node) for k in range(groups))


def layout_problems(lay: Layout, *, per_node: int, heads: int, kv_heads: int, layers: int) -> list[str]:
    """What breaks the hardware rules in ``lay`` for a model of ``heads``/``kv_heads``/``layers`` (empty: none)."""
    out = []
    if lay.dp * lay.tp * lay.pp != lay.count:
        out.append(f"dp·tp·pp = {lay.dp * lay.tp * lay.pp} is not the mesh's {lay.count} devices")
    if not mesh_aligned(lay.first, lay.count, per_node):
        out.append(f"mesh {lay.first}..{lay.first + lay.count - 1} straddles nodes of {per_node} devices "
                   "(a mesh lies inside one node or is whole nodes)")
    if heads % lay.tp or kv_heads % lay.tp:
        out.append(f"tp = {lay.tp} does not divide the {heads} attention heads and {kv_heads} key/value heads")
    if not tp_within_nodes(lay.first, lay.count, lay.tp, per_node):
        out.append(f"tp = {lay.tp} groups cross a node boundary (nodes of {per_node} devices)")
    if layers % lay.pp:
        out.append(f"pp = {lay.pp} does not divide the {layers} layers")
    return out


def splits(first: int, count: int, *, per_node: int, heads: int, kv_heads: int, layers: int) -> list[tuple]:
    """Every ``(dp, tp, pp)`` of a mesh that the rules allow (``(count, 1, 1)`` always is)."""
    def divisors(n: int) -> list[int]:
        return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []

    out = []   # tp divides heads, kv_heads and count; pp divides layers and count / tp: walk only those
    for tp in divisors(math.gcd(count, heads, kv_heads)):
        if not tp_within_nodes(first, count, tp, per_node):
            continue
        for pp in divisors(math.gcd(count // tp, layers)):
            out.append((count // (tp * pp), tp, pp))
    return out


def aligned_sizes(n: int, per_node: int) -> list[int]:
    """Mesh sizes a cluster of ``n`` devices offers: 1..per_node inside a node, then whole nodes."""
    per_node = max(min(per_node, n), 1)
    return list(range(1, per_node + 1)) + [k * per_node for k in range(2, n // per_node + 1)]
