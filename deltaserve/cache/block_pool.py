"""Token-paged KV block ids: a free list and a reference count per block.

Blocks are plain integers indexing `CacheBuffers.kv[:, :, block]`. A block is free when its count is
zero. Counts above one mean sharing: the prefix cache's index (cache/prefix_index.py) and every request
resuming from a cached prefix hold one reference each. The free list is a stack, so a block freed a moment ago is
reused first (its memory is warm, and on CPU untouched pages of a large pool stay unallocated).
"""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out 0, 1, 2, ... first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (count 1 each), or None when fewer than n are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        for b in taken:
            self._refs[b] = 1
        return taken

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def share(self, blocks: list[int]) -> None:
        """One more owner for blocks already allocated (prefix caching)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one owner of each block; a block whose last owner leaves goes back to the free list.
        Freed in reverse so a request's first block is the next one handed out."""
        for b in reversed(blocks):
            refs = self._refs[b]
            if refs <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] = refs - 1
            if refs == 1:
                self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b, refs in enumerate(self._refs):
            if (refs == 0) != (b in free) or refs < 0:
                raise AssertionError(f"block {b}: refcount {refs} but {'' if b in free else 'not '}on the free list")
