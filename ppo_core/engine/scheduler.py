"""The rollout engine's scheduler: which sequences compute which tokens at each step (continuous batching).

Each step (one forward of the model over a flat batch of tokens, ppo_core.engine) the scheduler
  1. gives every running sequence its next tokens: one for a sequence that is decoding, a chunk of its prompt for one
     still prefilling (chunked prefill: at most `max_step_tokens` tokens in a step), and the KV blocks they need;
     where a pool has no free block it preempts the most recently admitted sequence (its blocks are freed; it waits
     at the head of the queue and is recomputed from its tokens when admitted again: nothing is lost);
  2. admits waiting sequences, in order, while the step's token budget, `max_num_seqs` and the free blocks allow.
     An admitted sequence first looks its tokens up in the pools (ppo_core.engine.kv_blocks): the blocks of a prefix already
     computed (the other samples of a GRPO group, a shared system prompt, its own blocks before a preemption) are
     shared, not recomputed. At least its last token is always computed (its logits give the next token); when that
     token falls inside a shared block, the block is copied first (copy-on-write: the sequence gets its own block with
     the shared slots copied, and writes only after them).
Finished sequences leave at once and their blocks are freed (ppo_core.engine calls `finish`). A sequence waiting on a
tool (a multi-turn episode, ppo_core.engine's on_turn_end) is `park`ed: it leaves the running batch and keeps its
blocks, and `resume` brings it back with the observation's tokens appended, which it then prefills on top of its own
cache like a prompt chunk. When a running sequence cannot get a block and is the only one running, a parked
sequence's blocks are freed instead (it is recomputed from its tokens when it resumes).

Layer groups: a model whose layers attend to a sliding window keeps those layers in a pool of their own; a
sequence's table there holds only the blocks its next query can see (blocks wholly before the window are freed,
-1 in the table). Everything here is bookkeeping on block numbers; the engine moves the tensors.
"""
from collections import deque
from dataclasses import dataclass, field

from .kv_blocks import BlockPool, prefix_key


@dataclass
class Sequence:
    """One prompt's generation."""

    index: int  # its place among the call's prompts (the order of the results)
    row: int  # its row of sampling noise (ppo_core.engine.generate.counter_uniforms)
    tokens: list  # the prompt, then each token generated
    prompt_len: int
    max_new: int
    num_computed: int = 0  # tokens[:num_computed] have their keys and values in the cache
    tables: list = field(default_factory=list)  # per layer group: block table (-1 = released, out of the window)
    keys: list = field(default_factory=list)  # prefix keys of its full blocks, in order (ppo_core.engine.kv_blocks)
    logprobs: list = field(default_factory=list)
    entropy: list = field(default_factory=list)
    mask: list = field(default_factory=list)  # per token after the prompt: 1 sampled, 0 appended (an observation)
    turn_start: int = 0  # len(tokens) when its current turn began (multi-turn episodes)
    params: object = None  # its SamplingParams (ppo_core.engine.rollout_engine), the call's

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class Chunk:
    """What one sequence computes in a step: tokens[start : start + length]; `samples`: the chunk ends at the
    sequence's last token, so a new token is sampled from the logits of its last position."""

    seq: Sequence
    start: int
    length: int
    samples: bool


@dataclass
class Step:
    index: int
    chunks: list  # [Chunk]: single-token chunks first (the engine batches their attention)
    copies: list  # per layer group: [(source block, destination block, slots to copy)], done before attention


class Scheduler:
    def __init__(self, n_blocks: list, block_size: int, windows: list, max_num_seqs: int, max_step_tokens: int):
        """n_blocks, windows: per layer group, the pool's size and the group's window (None = full attention)."""
        self.pools = [BlockPool(n, block_size) for n in n_blocks]
        self.windows = list(windows)
        self.block_size = block_size
        self.max_num_seqs, self.max_step_tokens = max_num_seqs, max_step_tokens
        self.waiting = deque()
        self.running = []  # in admission order
        self.parked = []  # waiting on a tool, blocks kept (or freed by `make_room`: then num_computed is 0)
        self.n_steps = 0
        self.stats = dict(preemptions=0, prefix_hit_tokens=0)

    def add(self, seq: Sequence):
        seq.tables = [[] for _ in self.pools]
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running and not self.parked

    # -- one step ---------------------------------------------------------------------------------------------------

    def schedule(self) -> Step:
        step = Step(self.n_steps, [], [[] for _ in self.pools])
        budget = self.max_step_tokens
        i = 0
        while i < len(self.running):  # 1. the running sequences, oldest first
            seq = self.running[i]
            remaining = len(seq.tokens) - seq.num_computed
            length = 1 if remaining == 1 else min(remaining, budget)  # a decode token is never held back
            if length < 1:  # a prefill with no budget left this step continues in the next one
                i += 1
                continue
            while not self.allocate(seq, seq.num_computed + length):
                if len(self.running) == 1 and any(p.num_computed for p in self.parked):
                    self.make_room()
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if i >= len(self.running) or self.running[i] is not seq:  # it preempted itself
                break
            step.chunks.append(self.chunk(seq, length, step.index))
            budget -= length
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:  # 2. admissions, in order
            seq = self.waiting[0]
            if not self.admit(seq, budget, step):
                break
            self.waiting.popleft()
            length = min(len(seq.tokens) - seq.num_computed, budget)
            step.chunks.append(self.chunk(seq, length, step.index))
            budget -= length
        step.chunks.sort(key=lambda c: c.length > 1)  # stable: single-token chunks first, in their order
        self.n_steps += 1
        return step

    def held_tokens(self, group: int) -> int:
        """Tokens whose keys and values the running sequences hold in `group` (call it after `after_step`): every
        computed token in a full-attention group, the last `window` of each sequence in a sliding one."""
        window = self.windows[group]
        return sum(seq.num_computed if window is None else min(seq.num_computed, window) for seq in self.running)

    def chunk(self, seq: Sequence, length: int, step: int) -> Chunk:
        """seq computes tokens[num_computed : num_computed + length] this step; key the blocks it completes."""
        start, end = seq.num_computed, seq.num_computed + length
        bs = self.block_size
        for b in range(len(seq.keys), end // bs):  # full blocks
            tokens = tuple(seq.tokens[b * bs : (b + 1) * bs])
            seq.keys.append(prefix_key(seq.keys[-1] if seq.keys else None, tokens))
            for g, pool in enumerate(self.pools):
                if seq.tables[g][b] >= 0:  # (a sliding group's block before the window is not held)
                    pool.register(seq.keys[-1], tokens, seq.tables[g][b], step)
        samples = end == len(seq.tokens)
        if samples and end % bs and seq.generated == 0:  # a prompt's last, partly filled block
            b = end // bs
            tokens = tuple(seq.tokens[b * bs : end])
            key = prefix_key(seq.keys[-1] if seq.keys else None, tokens)
            for g, pool in enumerate(self.pools):
                pool.register(key, tokens, seq.tables[g][b], step)
        return Chunk(seq, start, length, samples)

    def after_step(self, step: Step):
        """The step's forward has run: count its tokens as computed, drop the copies' sources, and free the blocks
        that have left a sliding window."""
        for chunk in step.chunks:
            chunk.seq.num_computed = chunk.start + chunk.length
        for g, copies in enumerate(step.copies):
            for source, _, _ in copies:
                self.pools[g].release(source)
        for seq in self.running:
            self.free_out_of_window(seq)

    # -- blocks -----------------------------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, end: int) -> bool:
        """Give seq blocks for positions < end in every group. False (nothing taken) where a pool has too few."""
        need = -(-end // self.block_size)
        if any(pool.n_free < need - len(seq.tables[g]) for g, pool in enumerate(self.pools)):
            return False
        for g, pool in enumerate(self.pools):
            while len(seq.tables[g]) < need:
                seq.tables[g].append(pool.take())
        return True

    def free_out_of_window(self, seq: Sequence):
        """Release the sliding groups' blocks that no query of seq from now on can see: the next query, at position
        num_computed, sees positions >= num_computed + 1 - window."""
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            first_seen = (seq.num_computed + 1 - window) // self.block_size  # the first block it may see
            table = seq.tables[g]
            for b in range(min(first_seen, len(table))):
                if table[b] >= 0:
                    self.pools[g].release(table[b])
                    table[b] = -1

    def release_all(self, seq: Sequence):
        for g, table in enumerate(seq.tables):
            for block in table:
                if block >= 0:
                    self.pools[g].release(block)
        seq.tables = [[] for _ in self.pools]

    def preempt(self, seq: Sequence):
        """Free all of seq's blocks and put it first in the queue: it is recomputed from its tokens when admitted."""
        self.release_all(seq)
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1

    def finish(self, seq: Sequence):
        self.release_all(seq)
        self.running.remove(seq)

    def park(self, seq: Sequence):
        """seq waits on a tool: out of the running batch, its blocks kept."""
        self.running.remove(seq)
        self.parked.append(seq)

    def resume(self, seq: Sequence, tokens: list):
        """seq's tool has answered: `tokens` are appended (mask 0) and it runs again, prefilling them on its own
        cache; one whose blocks `make_room` took waits first in the queue, to be recomputed."""
        self.parked.remove(seq)
        seq.tokens += tokens
        seq.mask += [0] * len(tokens)
        seq.turn_start = len(seq.tokens)
        if seq.num_computed:
            self.running.append(seq)
        else:
            seq.tables = [[] for _ in self.pools]
            self.waiting.appendleft(seq)

    def make_room(self):
        """Free the blocks of the most recently parked sequence that holds any (it is recomputed on resuming)."""
        seq = next(p for p in reversed(self.parked) if p.num_computed)
        self.release_all(seq)
        seq.num_computed = 0
        seq.keys = []
        self.stats["preemptions"] += 1

    # -- admission and prefix sharing -------------------------------------------------------------------------------

    def match(self, seq: Sequence, step: int) -> tuple[int, list, list]:
        """How many of seq's first tokens the pools hold already (at most len(tokens) - 1: the last token is always
        computed, its logits give the next one) -> (matched, per group the blocks holding them, -1 for a sliding
        group's block wholly before the window the next query sees; the prefix keys of the matched full blocks).
        The last listed block may hold more than the matched tokens: it is copied, not shared (`admit`)."""
        bs, tokens, n = self.block_size, seq.tokens, len(seq.tokens)
        hits, keys, previous = [], [], None  # per block: its block in each group (None where a group lacks it)
        for b in range(-(-n // bs)):
            segment = tuple(tokens[b * bs : (b + 1) * bs])
            key = prefix_key(previous, segment)
            found = [pool.lookup(key, segment, step) for pool in self.pools]
            # a full group must hold every block; a sliding one only those the window needs (checked below)
            if any(block is None and window is None for block, window in zip(found, self.windows)):
                break
            if all(block is None for block in found):
                break
            hits.append(found)
            keys.append(key)
            previous = key
        matched = max(0, min(sum(min(bs, n - b * bs) for b in range(len(hits))), n - 1))
        while matched > 0:  # every group must hold the blocks the next query (at position `matched`) sees
            missing = [b for g, window in enumerate(self.windows)
                       for b in range(self.first_seen(matched, window), (matched - 1) // bs + 1) if hits[b][g] is None]
            if not missing:
                break
            matched = min(missing) * bs  # what lies before the first missing block
        n_blocks = -(-matched // bs)
        tables = [[hits[b][g] if b >= self.first_seen(matched, window) else -1 for b in range(n_blocks)]
                  for g, window in enumerate(self.windows)]
        return matched, tables, keys[: matched // bs]

    def first_seen(self, position: int, window) -> int:
        """The first block a query at `position` can see (0 without a window)."""
        return 0 if window is None else max(0, position + 1 - window) // self.block_size

    def admit(self, seq: Sequence, budget: int, step: Step) -> bool:
        """Admit seq if the pools can hold its first chunk, and all its tokens in a full-attention pool: share the
        blocks of its matched prefix; a partly matched last block is copied (copy-on-write)."""
        matched, shared, keys = self.match(seq, step.index)
        bs, n = self.block_size, len(seq.tokens)
        copy_last = matched % bs != 0  # the block holding token `matched` is partly someone else's
        end = matched + min(n - matched, budget)
        for g, pool in enumerate(self.pools):
            blocks = -(-n // bs) if self.windows[g] is None else -(-end // bs)
            new = blocks - (len(shared[g]) - copy_last)  # positions past the shared blocks, the copy included
            freed_by_holding = sum(1 for b in shared[g] if b >= 0 and pool.refs[b] == 0)  # shared blocks now free
            if pool.n_free - freed_by_holding < new:
                return False
        for g, pool in enumerate(self.pools):
            table = list(shared[g])
            for block in table:
                if block >= 0:
                    pool.hold(block)  # a copy's source is held until the forward has copied it (after_step)
            if copy_last:
                source = table[-1]
                table[-1] = pool.take()
                step.copies[g].append((source, table[-1], matched % bs))
            seq.tables[g] = table
        assert self.allocate(seq, end), "admit: the pools were checked to hold the first chunk"
        self.stats["prefix_hit_tokens"] += matched
        seq.num_computed, seq.keys = matched, keys
        self.running.append(seq)
        return True
