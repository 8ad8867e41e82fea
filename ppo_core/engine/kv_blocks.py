"""The rollout engine's block bookkeeping: which KV-cache blocks are free, who holds each, which hold a known prefix.

The KV cache is one pool of fixed-size blocks per layer group (ppo_core.engine): a block holds the keys and values
of `block_size` consecutive positions of one sequence in every layer of its group, and a sequence's block table lists
its blocks in position order. This file is only the accounting, plain Python on block numbers; the tensors live in
the engine. Three ideas, as in vLLM's and nano-vllm's block managers:

- Reference counts: a block held by several sequences (a shared prompt prefix) is freed when the last one lets go.
- Prefix keys: block i of a token sequence answers to key_i = hash((key_{i-1}, tokens of block i)), a chained hash
  over the whole prefix, so two sequences whose first tokens agree find the same blocks. A key also names a partly
  filled block (the last block of a prompt): then the block's first len(tokens) slots hold those tokens, and they
  never change afterwards (its owner only writes the slots after them), so the key stays true. The tokens are kept
  beside each key and compared on a match: a hash collision cannot share a wrong block.
- A freed block keeps its keys until it is taken for new content (least recently freed first), so a preempted
  sequence or a later prompt with the same prefix can still find it.
"""
from collections import OrderedDict


def prefix_key(previous_key, tokens) -> int:
    """The key of a block whose slots hold `tokens` (a tuple) after the prefix whose last block's key is
    `previous_key` (None for the first block)."""
    return hash((previous_key, tokens))


class BlockPool:
    """The blocks 0..n_blocks-1 of one layer group's pool."""

    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.refs = [0] * n_blocks  # sequences (and pending copies) holding each block
        self.free = OrderedDict.fromkeys(range(n_blocks))  # blocks with no holder, least recently freed first
        self.keys_of = [[] for _ in range(n_blocks)]  # the prefix keys each block answers to
        self.by_key = {}  # key -> (block, tokens, step): where a prefix's block is, the tokens to check it against,
        #                   and the engine step whose forward writes those slots

    @property
    def n_free(self) -> int:
        return len(self.free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self.free)

    def take(self) -> int:
        """A block for new content, held once. Its old keys are forgotten: what it held is about to be overwritten."""
        block, _ = self.free.popitem(last=False)
        for key in self.keys_of[block]:
            if self.by_key.get(key, (None,))[0] == block:
                del self.by_key[key]
        self.keys_of[block] = []
        self.refs[block] = 1
        return block

    def hold(self, block: int):
        """One more holder of `block` (a shared prefix block, found by `lookup`; it may be free and still keyed)."""
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, block: int):
        self.refs[block] -= 1
        assert self.refs[block] >= 0, f"block {block} released more often than held"
        if self.refs[block] == 0:
            self.free[block] = None  # the most recently freed: taken last

    def lookup(self, key: int, tokens: tuple, step: int):
        """The block holding `tokens` under `key`, written by the forward of `step` or an earlier one, or None."""
        found = self.by_key.get(key)
        if found is None or found[1] != tokens or found[2] > step:
            return None
        return found[0]

    def register(self, key: int, tokens: tuple, block: int, step: int):
        """`block`'s first len(tokens) slots hold `tokens` (under `key`) once the forward of `step` has run."""
        if key in self.by_key:  # the same prefix already has a block: keep that one
            return
        self.by_key[key] = (block, tokens, step)
        self.keys_of[block].append(key)
