"""The prefix cache's index (integers only): a radix tree of full KV blocks keyed by their token ids, and GDN
state snapshots hung on it at exact token positions.

A hybrid model can resume a prompt at position p only with both halves of the cache at p: the KV of every
attention layer for tokens < p, and the recurrent state + conv window of every GDN layer after exactly p
tokens (the delta rule cannot be rolled back or replayed, so a state is a point value). Hence:

- A node is one full block: its `block_size` token ids (the key among its parent's children) and the KV
  block that holds them. The path from the root spells a prefix; the index holds one reference on each
  node's block (`BlockPool.share`), so a block outlives the request that computed it.
- A `Snapshot` is a state at position p = node.depth + len(tail): it hangs on the node of the full blocks
  below p, keyed by the `tail` tokens of the partly filled block that follows (empty when p is a block
  boundary). It owns a snapshot slot (a state slot outside the live ones) and a reference on the tail's
  block, whose positions < p never change; a request that resumes there copies that block (copy-on-write:
  its own writes from p on go to the copy).
- A hit (`lookup`) is the longest p <= max_len with a snapshot whose tokens match (or p = 0). `kv_len`, how
  far the cached KV matches (full blocks, then the common prefix with a child block or a snapshot tail),
  finds branch points: when it is deeper than the hit, the request saves its own state there.

Eviction keeps the two halves consistent: a node goes only as a leaf (its descendants first) and takes
its snapshots with it; a snapshot's score is its recency plus the prefill it saves (`WORK_TOKENS_PER_TICK`
tokens count as one tick more recent: every snapshot takes one slot, so this is work per byte up to a
constant). KV that no snapshot uses yet is kept (it is how a later request finds a branch point) and
evicted least recently used first. Candidates wait in two heaps with lazy invalidation (an entry is stale
once its item was touched again, evicted, or is held by a live sequence; it is pushed again when that
changes: `released`), so eviction costs O(log n) per item, not a scan of the index.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from .block_pool import BlockPool

WORK_TOKENS_PER_TICK = 256


@dataclasses.dataclass(eq=False)
class _Node:
    parent: _Node | None
    tokens: tuple[int, ...]                  # this block's token ids (the root: none)
    block: int                               # the KV block holding them (the root: -1)
    depth: int                               # tokens from the root through the end of this node
    children: dict[tuple[int, ...], _Node] = dataclasses.field(default_factory=dict)
    snapshots: dict[tuple[int, ...], Snapshot] = dataclasses.field(default_factory=dict)
    # first token -> the child keys and snapshot tails starting with it (a lookup compares only those)
    firsts: dict[int, set[tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    last_used: int = 0

    def add_key(self, key: tuple[int, ...]) -> None:
        if key:
            self.firsts.setdefault(key[0], set()).add(key)

    def remove_key(self, key: tuple[int, ...]) -> None:
        if key:
            keys = self.firsts[key[0]]
            keys.discard(key)
            if not keys:
                del self.firsts[key[0]]


@dataclasses.dataclass(eq=False)
class Snapshot:
    node: _Node
    tail: tuple[int, ...]                    # tokens after node.depth, < block_size of them
    tail_block: int | None                   # the block holding the tail's KV (None: no tail)
    slot: int                                # snapshot slot holding the state after `length` tokens
    last_used: int = 0

    @property
    def length(self) -> int:
        return self.node.depth + len(self.tail)


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    length: int                              # p: KV for < p and the state at p are cached (0: nothing)
    blocks: tuple[int, ...]                  # the full blocks covering [0, p // block_size * block_size)
    tail_block: int | None                   # copy this block for positions [p // bs * bs, p) (None: p % bs == 0)
    slot: int | None                         # restore the state from this snapshot slot (None when p == 0)
    kv_len: int                              # how far cached KV matches the tokens (>= length)


MISS = PrefixHit(0, (), None, None, 0)


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixIndex:
    def __init__(self, blocks: BlockPool, *, block_size: int, first_slot: int, num_slots: int):
        self.pool = blocks
        self.block_size = block_size
        self.first_slot = first_slot
        self.num_slots = num_slots           # snapshot slots: ids first_slot .. first_slot + num_slots - 1
        self._free_slots = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.root = _Node(None, (), -1, 0)
        self._nodes: set[_Node] = set()
        self._snapshots: set[Snapshot] = set()
        self._clock = itertools.count(1)
        self._refs: dict[int, int] = {}        # references the index holds, per block
        self._node_of: dict[int, _Node] = {}   # block -> the node holding it
        self._tails: dict[int, set[Snapshot]] = {}   # block -> the snapshots whose tail it holds
        self._lru: list[tuple] = []            # (last_used, -length, n, item, stamp): block eviction
        self._by_score: list[tuple] = []       # (score, n, snapshot, stamp): snapshot-slot eviction
        self._pushes = itertools.count()
        self.last_node: _Node | None = None
        self.num_evicted_snapshots = 0
        self.num_evicted_blocks = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_blocks(self) -> int:
        return len(self._nodes)

    def lookup(self, tokens: list[int], max_len: int) -> PrefixHit:
        """The longest cached prefix of `tokens` of at most max_len tokens; touches what it returns."""
        bs = self.block_size
        node, best = self.root, None
        path: list[_Node] = []
        while True:
            aligned = node.snapshots.get(())
            if aligned is not None and node.depth <= max_len:
                best = aligned
            if node.depth < len(tokens):
                for key in node.firsts.get(tokens[node.depth], ()):
                    end = node.depth + len(key)
                    if len(key) < bs and end <= max_len and (best is None or end > best.length) and \
                            tuple(tokens[node.depth:end]) == key:
                        best = node.snapshots[key]
            child = node.children.get(tuple(tokens[node.depth:node.depth + bs])) \
                if node.depth + bs <= len(tokens) else None
            if child is None:
                break
            node = child
            path.append(node)
        rest = tokens[node.depth:node.depth + bs]
        partial = max([_common_prefix(k, rest) for k in node.firsts.get(rest[0], ())], default=0) if rest else 0
        kv_len = node.depth + partial
        if best is None:
            return PrefixHit(0, (), None, None, kv_len)
        now = next(self._clock)
        used = path[: best.node.depth // bs]
        for n in used:
            self._touch(n, now)
        self._touch(best, now)
        return PrefixHit(best.length, tuple(n.block for n in used), best.tail_block, best.slot, kv_len)

    # ---- insertion -----------------------------------------------------------------------------
    def insert_blocks(self, tokens: list[int], blocks: list[int], num_full: int, start: _Node | None = None) -> _Node:
        """Index the first num_full blocks of a sequence (their tokens are all computed); blocks already
        indexed under the same tokens stay as they are (the sequence's copy stays its own). Returns the
        node after them. start: a node this sequence's tokens already reached (its ancestors are then
        indexed too, as a node is only evicted after its children), to resume from."""
        bs, node = self.block_size, self.root
        if start is not None and start in self._nodes and start.depth <= num_full * bs:
            node = start
        now = next(self._clock)
        for i in range(node.depth // bs, num_full):
            key = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                self._share(blocks[i])
                child = _Node(node, key, blocks[i], node.depth + bs)
                node.children[key] = child
                node.add_key(key)
                self._nodes.add(child)
                self._node_of[child.block] = child
            if child.block == blocks[i]:        # the sequence holds it: pushed again once released
                child.last_used = now
            else:
                self._touch(child, now)
            node = child
        return node

    def save(self, tokens: list[int], length: int, blocks: list[int], start: _Node | None = None) -> int | None:
        """Index a sequence's cache at `length` tokens (its blocks cover them, its state is after exactly
        `length` tokens): its full blocks, and a snapshot unless one exists there. Returns the snapshot slot
        the caller must copy the sequence's state into, or None (already cached, or no slot); `last_node` is
        then the node of its full blocks (a `start` for the sequence's next save)."""
        self.last_node = None
        if length <= 0 or self.num_slots == 0:
            return None
        bs = self.block_size
        node = self.last_node = self.insert_blocks(tokens, blocks, length // bs, start)
        tail = tuple(tokens[node.depth:length])
        existing = node.snapshots.get(tail)
        if existing is not None:
            self._touch(existing, next(self._clock))
            return None
        if not self._free_slots:
            self._evict_one_snapshot()
        if not self._free_slots:
            return None
        tail_block = blocks[length // bs] if tail else None
        snap = Snapshot(node, tail, tail_block, self._free_slots.pop())
        if tail_block is not None:
            self._share(tail_block)
            self._tails.setdefault(tail_block, set()).add(snap)
        node.snapshots[tail] = snap
        node.add_key(tail)
        self._snapshots.add(snap)
        self._touch(snap, next(self._clock))
        return snap.slot

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _share(self, block: int) -> None:
        self.pool.share([block])
        self._refs[block] = self._refs.get(block, 0) + 1

    def _unshare(self, block: int) -> None:
        self.pool.free([block])
        left = self._refs[block] - 1
        if left:
            self._refs[block] = left
        else:
            del self._refs[block]

    def _only_mine(self, block: int) -> bool:
        return self.pool.ref_count(block) == self._refs.get(block, -1)

    def _push(self, item: _Node | Snapshot) -> None:
        if isinstance(item, Snapshot):
            if item.tail_block is not None:
                heapq.heappush(self._lru, (item.last_used, -item.length, next(self._pushes), item, item.last_used))
            heapq.heappush(self._by_score, (self._score(item), next(self._pushes), item, item.last_used))
        else:
            heapq.heappush(self._lru, (item.last_used, -item.depth, next(self._pushes), item, item.last_used))
        if len(self._lru) + len(self._by_score) > 4 * (len(self._nodes) + len(self._snapshots)) + 256:
            self._rebuild_heaps()

    def _touch(self, item: _Node | Snapshot, now: int) -> None:
        item.last_used = now
        self._push(item)

    def _rebuild_heaps(self) -> None:
        self._lru = [(n.last_used, -n.depth, next(self._pushes), n, n.last_used) for n in self._nodes]
        self._lru += [(x.last_used, -x.length, next(self._pushes), x, x.last_used) for x in self._snapshots
                      if x.tail_block is not None]
        self._by_score = [(self._score(x), next(self._pushes), x, x.last_used) for x in self._snapshots]
        heapq.heapify(self._lru)
        heapq.heapify(self._by_score)

    def released(self, blocks: list[int]) -> None:
        """Live sequences let go of these blocks: what the index holds among them may be evictable now."""
        for b in blocks:
            if b in self._refs and self._only_mine(b):
                node = self._node_of.get(b)
                if node is not None:
                    self._push(node)
                for snap in self._tails.get(b, ()):
                    self._push(snap)

    # ---- eviction ------------------------------------------------------------------------------
    def _drop_snapshot(self, snap: Snapshot) -> None:
        del snap.node.snapshots[snap.tail]
        snap.node.remove_key(snap.tail)
        self._snapshots.discard(snap)
        self._free_slots.append(snap.slot)
        if snap.tail_block is not None:
            tails = self._tails[snap.tail_block]
            tails.discard(snap)
            if not tails:
                del self._tails[snap.tail_block]
            self._unshare(snap.tail_block)
            self.released([snap.tail_block])

    def _drop_node(self, node: _Node) -> None:
        assert not node.children, "only a leaf is evicted"
        for snap in list(node.snapshots.values()):
            self._drop_snapshot(snap)
            self.num_evicted_snapshots += 1
        del node.parent.children[node.tokens]
        node.parent.remove_key(node.tokens)
        self._nodes.discard(node)
        del self._node_of[node.block]
        self._unshare(node.block)
        self.released([node.block])
        self.num_evicted_blocks += 1
        if node.parent is not self.root and not node.parent.children:
            self._push(node.parent)

    def _score(self, snap: Snapshot) -> float:
        return snap.last_used + snap.length / WORK_TOKENS_PER_TICK

    def _evict_one_snapshot(self) -> bool:
        while self._by_score:
            _, _, snap, stamp = heapq.heappop(self._by_score)
            if snap in self._snapshots and snap.last_used == stamp:
                self._drop_snapshot(snap)
                self.num_evicted_snapshots += 1
                return True
        return False

    def evict_blocks(self, needed: int) -> None:
        """Evict until `needed` blocks are free (or nothing evictable is left), least recently used first:
        leaves and snapshots whose block no one but the index holds (a block may be both a node's and a
        snapshot's tail, so one eviction may free nothing until the other goes too)."""
        while self.pool.num_free < needed and self._lru:
            _, _, _, item, stamp = heapq.heappop(self._lru)
            if item.last_used != stamp:
                continue
            if isinstance(item, Snapshot):
                if item in self._snapshots and self._only_mine(item.tail_block):
                    self._drop_snapshot(item)
                    self.num_evicted_snapshots += 1
            elif item in self._nodes and not item.children and self._only_mine(item.block):
                self._drop_node(item)

    def reset(self) -> None:
        """Drop every snapshot and node (live sequences keep their own block references)."""
        for snap in list(self._snapshots):
            self._drop_snapshot(snap)
        for node in sorted(self._nodes, key=lambda n: -n.depth):
            del node.parent.children[node.tokens]
            node.parent.remove_key(node.tokens)
            self._unshare(node.block)
        self._nodes.clear()
        self._node_of.clear()
        self._lru.clear()
        self._by_score.clear()

    # ---- integrity -----------------------------------------------------------------------------
    def block_refs(self) -> dict[int, int]:
        """The references the index holds, per block (recounted from the tree and the snapshots)."""
        refs: dict[int, int] = {}
        for node in self._nodes:
            refs[node.block] = refs.get(node.block, 0) + 1
        for snap in self._snapshots:
            if snap.tail_block is not None:
                refs[snap.tail_block] = refs.get(snap.tail_block, 0) + 1
        return refs

    def check_integrity(self) -> None:
        """The tree is consistent and every snapshot slot is either free or held by exactly one snapshot."""
        bs, seen = self.block_size, 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.parent is not node or child.tokens != key or len(key) != bs or child.depth != node.depth + bs:
                    raise AssertionError(f"prefix index: node at depth {child.depth} is misplaced")
                if child not in self._nodes:
                    raise AssertionError("prefix index: a reachable node is not registered")
                seen += 1
                stack.append(child)
            keys = {k for ks in node.firsts.values() for k in ks}
            if keys != set(node.children) | {t for t in node.snapshots if t}:
                raise AssertionError(f"prefix index: the first-token map at depth {node.depth} drifted")
            for tail, snap in node.snapshots.items():
                if snap.node is not node or snap.tail != tail or len(tail) >= bs or snap not in self._snapshots:
                    raise AssertionError(f"prefix index: snapshot at {snap.length} is misplaced")
                if (snap.tail_block is None) != (not tail):
                    raise AssertionError(f"prefix index: snapshot at {snap.length} has a wrong tail block")
        if seen != len(self._nodes):
            raise AssertionError(f"prefix index: {len(self._nodes)} nodes registered, {seen} reachable")
        if self.block_refs() != self._refs:
            raise AssertionError("prefix index: its per-block reference counts drifted")
        if {n.block: n for n in self._nodes} != self._node_of:
            raise AssertionError("prefix index: the block -> node map drifted")
        slots = [s.slot for s in self._snapshots] + self._free_slots
        if sorted(slots) != list(range(self.first_slot, self.first_slot + self.num_slots)):
            raise AssertionError("prefix index: snapshot slots lost or held twice")
