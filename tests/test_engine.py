"""The rollout engine: ppo_core/engine/kv_blocks.py (block accounting), ppo_core/engine/scheduler.py (continuous batching,
preemption, prefix sharing, copy-on-write) and ppo_core/engine/rollout_engine.py (paged attention, sampling), runs everywhere.

    python -m pytest -q tests/test_engine.py

The scheduler is checked on hand-worked block numbers; the engine against ppo_core.generate (the padded reference)
at the same sampling noise on every family, and against itself under every scheduling choice (block size, pool size
forcing preemption, prefill chunks, batch limits, rows split as over processes): the tokens must not change.
The decode-only steps on ppo_core.engine.static_decode's fixed-shape buffers (what a CUDA graph captures) against the
dynamic steps on the CPU, through the Triton kernel in its interpreter, and as replayed CUDA graphs (GPU only).
"""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

import ppo_core
from ppo_core.engine.rollout_engine import PoolLayout, RolloutEngine, row_bucket, shared_prefix_groups
from ppo_core.engine.generate import counter_uniforms
from ppo_core.engine.kv_blocks import BlockPool, prefix_key
from ppo_core.engine.scheduler import Chunk, Scheduler, Sequence, Step
from ppo_core.engine.static_decode import StaticDecode, decode_bucket, decode_only

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_generate import CONFIGS, tiny  # noqa: E402


# -- the noise ---------------------------------------------------------------------------------------------------

def splitmix64_python(z):
    M = (1 << 64) - 1
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def test_counter_uniforms_are_splitmix64_in_plain_python_integers():
    """The int64 tensor arithmetic (wrapping multiplies, masked arithmetic shifts) against Python's exact integers."""
    M, g = (1 << 64) - 1, 0x9E3779B97F4A7C15
    for seed in (0, 3, 2**63 + 5, 10**30 + 7):
        rows, index = [0, 1, 7, 2**40], [5, 0, 123456, 2]
        expected = []
        for row, i in zip(rows, index):
            z = splitmix64_python((seed + g) & M)
            z = splitmix64_python((z + row + g) & M)
            z = splitmix64_python((z + i + g) & M)
            expected.append((z >> 11) * 2.0**-53)
        assert counter_uniforms(seed, torch.tensor(rows), torch.tensor(index)).tolist() == expected


# -- block accounting --------------------------------------------------------------------------------------------

def test_block_pool_reference_counts_and_least_recently_freed_reuse():
    pool = BlockPool(4, block_size=2)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert (a, b, c) == (0, 1, 2) and pool.n_free == 1
    key = prefix_key(None, (5, 6))
    pool.register(key, (5, 6), a, step=0)
    pool.hold(a)  # a second sequence shares it
    pool.release(a)
    assert pool.refs[a] == 1 and pool.n_free == 1
    pool.release(b), pool.release(a)  # freed in this order: b, then a
    assert pool.lookup(key, (5, 6), step=0) == a  # freed, still keyed: found
    assert pool.lookup(key, (5, 7), step=0) is None  # same key, other tokens: a collision never shares
    pool.hold(a)  # a later sequence takes it back from the free list
    assert pool.refs[a] == 1 and pool.n_free == 2
    pool.release(a)
    assert [pool.take(), pool.take(), pool.take()] == [3, 1, 0]  # never used first, then least recently freed
    assert pool.lookup(key, (5, 6), step=0) is None  # block a was taken for new content: its key is gone


def test_a_block_keyed_in_this_step_is_found_only_from_this_step_on():
    pool = BlockPool(2, block_size=2)
    block = pool.take()
    pool.register(prefix_key(None, (1,)), (1,), block, step=4)
    assert pool.lookup(prefix_key(None, (1,)), (1,), step=3) is None
    assert pool.lookup(prefix_key(None, (1,)), (1,), step=4) == block


def run_steps(sched, next_token=lambda seq: 1):
    """Drive a Scheduler as the engine does (no model): after each step, append `next_token` to every sampling
    sequence and finish those at their budget. -> the steps."""
    steps = []
    while not sched.done:
        step = sched.schedule()
        steps.append(step)
        sched.after_step(step)
        for c in step.chunks:
            if c.samples:
                c.seq.tokens.append(next_token(c.seq))
                if c.seq.generated >= c.seq.max_new:
                    sched.finish(c.seq)
    return steps


def test_scheduler_shares_a_prompt_and_copies_its_partly_matched_last_block():
    """Two samples of a 10-token prompt, blocks of 4: the first computes the prompt (blocks 0, 1, 2, the last holding
    positions 8, 9); the second, admitted in the same step, shares blocks 0 and 1, gets its own copy of block 2's
    first slot (position 8) and computes only its last prompt token (position 9)."""
    sched = Scheduler([16], block_size=4, windows=[None], max_num_seqs=8, max_step_tokens=64)
    prompt = list(range(10, 20))
    first, second = Sequence(0, 0, list(prompt), 10, 3), Sequence(1, 1, list(prompt), 10, 3)
    sched.add(first), sched.add(second)
    step = sched.schedule()
    assert [(c.seq.index, c.start, c.length, c.samples) for c in step.chunks] == [(1, 9, 1, True), (0, 0, 10, True)]
    assert first.tables == [[0, 1, 2]] and second.tables == [[0, 1, 3]]
    assert step.copies == [[(2, 3, 1)]]
    assert sched.pools[0].refs[:4] == [2, 2, 2, 1]  # block 2: its owner and the pending copy
    assert sched.stats["prefix_hit_tokens"] == 9
    sched.after_step(step)
    assert sched.pools[0].refs[:4] == [2, 2, 1, 1]  # the copy is done: the source is its owner's alone
    first.tokens.append(7), second.tokens.append(8)
    step = sched.schedule()  # both decode position 10 into their own block (2 and 3): nothing shared is written
    assert [(c.seq.index, c.start, c.length) for c in step.chunks] == [(0, 10, 1), (1, 10, 1)] and step.copies == [[]]


def test_scheduler_shares_full_blocks_with_a_later_prompt_and_recomputes_only_the_rest():
    sched = Scheduler([16], block_size=4, windows=[None], max_num_seqs=8, max_step_tokens=64)
    first = Sequence(0, 0, list(range(10, 22)), 12, 2)  # 12 tokens: blocks 0..2, all full
    sched.add(first)
    run_steps(sched)
    later = Sequence(1, 1, list(range(10, 18)) + [99, 98], 10, 2)  # shares the first 8 tokens (blocks 0, 1)
    sched.add(later)
    step = sched.schedule()
    assert [(c.start, c.length) for c in step.chunks] == [(8, 2)] and step.copies == [[]]
    assert later.tables[0][:2] == [0, 1]  # the first one's blocks 0 and 1, taken back from the free list, still keyed


def test_scheduler_preempts_the_newest_and_recomputes_it_from_its_tokens():
    """6 blocks of 2 for three sequences of 2-token prompts that grow to 6 tokens (3 blocks each): the pool holds two
    at the end, so the newest is preempted, put first in the queue, and admitted again later with all its tokens."""
    sched = Scheduler([6], block_size=2, windows=[None], max_num_seqs=8, max_step_tokens=64)
    seqs = [Sequence(i, i, [10 + i, 20 + i], 2, 4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    steps = run_steps(sched, next_token=lambda seq: 100 + seq.generated)
    assert sched.stats["preemptions"] >= 1
    assert all(s.tokens == s.tokens[:2] + [100, 101, 102, 103] for s in seqs)
    recomputed = [c for st in steps for c in st.chunks if c.start == 0 and c.length > 2]
    assert recomputed and all(c.seq is seqs[2] for c in recomputed)  # only the newest was ever preempted
    assert sched.pools[0].n_free == 6 and all(r == 0 for r in sched.pools[0].refs)


def test_scheduler_prefills_in_chunks_of_the_step_budget_and_never_holds_back_a_decode_token():
    sched = Scheduler([32], block_size=4, windows=[None], max_num_seqs=8, max_step_tokens=5)
    a, b = Sequence(0, 0, list(range(3)), 3, 3), Sequence(1, 1, list(range(50, 62)), 12, 1)
    sched.add(a), sched.add(b)
    steps = run_steps(sched)
    chunks = [[(c.seq.index, c.start, c.length) for c in st.chunks] for st in steps]
    # a samples its 3 tokens in steps 0-2 (decoding one token a step first); b's 12 tokens fill what is left of 5
    assert chunks == [[(0, 0, 3), (1, 0, 2)], [(0, 3, 1), (1, 2, 4)], [(0, 4, 1), (1, 6, 4)], [(1, 10, 2)]]


def test_sliding_window_group_frees_the_blocks_no_query_sees():
    """Window 5, blocks of 2: after position p is computed, the next query (p + 1) sees positions >= p - 3, so
    blocks lying wholly before that are released (-1), while the full-attention group keeps every block."""
    sched = Scheduler([16, 16], block_size=2, windows=[None, 5], max_num_seqs=4, max_step_tokens=64)
    seq = Sequence(0, 0, list(range(9)), 9, 3)
    sched.add(seq)
    step = sched.schedule()
    sched.after_step(step)
    full, sliding = seq.tables
    assert len(full) == 5 and all(b >= 0 for b in full)
    # 9 computed: the next query at 9 sees 5..9, first block seen = 5 // 2 = 2
    assert sliding[:2] == [-1, -1] and all(b >= 0 for b in sliding[2:])
    assert sched.pools[1].n_used == 3 and sched.pools[0].n_used == 5


# -- the engine against ppo_core.generate ------------------------------------------------------------------------

def padded(prompts):
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def reference(model, prompts, new, eos=None, **kw):
    """ppo_core.generate on the left-padded batch with the engine's noise, cut after each row's first EOS."""
    ids, mask = padded(prompts)
    out = ppo_core.generate(model, ids, new, attention_mask=mask, noise_seed=kw.pop("seed"), eos_token_id=eos,
                            pad_token_id=-1, **kw)
    if isinstance(out, tuple):
        return [[t for t in row if t != -1] for row in out[0].tolist()], out[1]
    return [[t for t in row if t != -1] for row in out.tolist()]


def grouped_prompts(seed=1):
    """4 prompts of odd lengths, each sampled 3 times, one of them cut to share only a prefix."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(3, 131, (n,), generator=g).tolist() for n in (6, 9, 13, 1)]
    prompts = [p for p in base for _ in range(3)]
    prompts[4] = prompts[4][:5] + [7, 7]
    return prompts


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_samples_the_tokens_of_generate_at_the_same_noise(name, greedy):
    """Every family (OLMo 3's sliding window of 5 in a pool of its own), with shared prompts: the same tokens as the
    padded reference, and the same log-probs to float32 rounding."""
    model = tiny(name)
    prompts = grouped_prompts()
    expected, expected_lp = reference(model, prompts, 12, greedy=greedy, seed=3, return_logprobs=True)
    engine = RolloutEngine(model, block_size=4)
    tokens, logprobs = engine.generate(prompts, 12, greedy=greedy, seed=3, return_logprobs=True)
    assert tokens == expected
    torch.testing.assert_close(torch.tensor(logprobs), expected_lp, rtol=0, atol=2e-5)
    assert engine.stats["prefix_hit_tokens"] > 0 and engine.stats["useful_tokens"] == 12 * len(prompts)


def test_cpu_steps_run_small_row_counts_exactly_and_pad_larger_ones_to_a_few_shapes():
    """row_bucket, hand-worked: exact up to 16 rows, then multiples of 8, 32, 128; and a step padded that way (20
    sequences decoding: 24 rows, 4 of them padding written to the spare block) samples what generate does."""
    cpu = torch.device("cpu")
    assert [row_bucket(n, cpu) for n in (1, 2, 7, 16, 17, 24, 25, 128, 129, 1024, 1025)] == \
        [1, 2, 7, 16, 24, 24, 32, 128, 160, 1024, 1152]
    assert row_bucket(17, torch.device("meta")) == 17
    model = tiny("qwen3")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 131, (n,), generator=g).tolist() for n in [2, 3, 5] * 6 + [4, 4]]  # 20
    expected = reference(model, prompts, 5, seed=7)
    assert RolloutEngine(model, block_size=4).generate(prompts, 5, seed=7) == expected


@pytest.mark.parametrize("name", ["qwen3", "olmo3", "llama_bias"])
def test_cpu_decode_gathers_in_chunks_of_a_few_sequences_and_samples_what_generate_does(name):
    """gather_chunk_bytes: the CPU decode attention gathers the keys of a few sequences at a time (1 byte: one
    sequence; 12,000 bytes: 2 to 6, fewer as the keys grow, the last chunk short). 12 distinct prompts, all prefilled in
    the first step, then 7 decode steps of 12 sequences: the tokens are generate's, the log-probs too to float32
    rounding and the whole step's gather's to the bit (each sequence's matmuls are the same), and the profiler counts,
    in every layer of every decode step, one gather of keys and one of values per chunk: 2 x 12 with one sequence a
    chunk, against 2 for the whole batch. gather_at_once_bytes=0 makes every step chunk; at its default (16 MiB)
    steps as small as these gather at once."""
    from torch.profiler import profile

    model = tiny(name)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 131, (n,), generator=g).tolist() for n in range(3, 15)]
    expected, expected_lp = reference(model, prompts, 8, seed=4, return_logprobs=True)
    gathers, one_gather = {}, None
    for chunk_bytes in [None, 1, 12000, "1, at once by default"]:
        engine = (RolloutEngine(model, block_size=4, gather_chunk_bytes=1) if isinstance(chunk_bytes, str) else
                  RolloutEngine(model, block_size=4, gather_at_once_bytes=0, gather_chunk_bytes=chunk_bytes))
        with profile() as prof:
            tokens, logprobs = engine.generate(prompts, 8, seed=4, return_logprobs=True)
        assert tokens == expected, chunk_bytes
        torch.testing.assert_close(torch.tensor(logprobs), expected_lp, rtol=0, atol=2e-5)
        one_gather = one_gather or logprobs
        assert logprobs == one_gather, chunk_bytes
        assert engine.stats["steps"] == 8
        gathers[chunk_bytes] = sum(e.name == "aten::index_select" and e.cpu_parent is not None
                                   and e.cpu_parent.name == "engine.attention" for e in prof.events())
    assert gathers[1] - gathers[None] == 7 * model.args.num_hidden_layers * (2 * 12 - 2)
    assert gathers[None] < gathers[12000] < gathers[1]
    assert gathers["1, at once by default"] == gathers[None]


@pytest.mark.parametrize("name", ["qwen3", "olmo3"])
def test_the_tokens_do_not_depend_on_how_the_engine_schedules_them(name):
    """Block sizes, a pool so small that sequences are preempted and recomputed, prefill chunks of 5 tokens, at most 3
    sequences at once, and the rows split in two calls as over two processes: the same bytes every time."""
    model = tiny(name)
    prompts = grouped_prompts(seed=2)
    expected = RolloutEngine(model).generate(prompts, 15, seed=11)
    assert RolloutEngine(model).generate(prompts, 15, seed=11) == expected  # same seed, same bytes
    assert RolloutEngine(model).generate(prompts, 15, seed=12) != expected
    for kw in [dict(block_size=2), dict(block_size=8, max_step_tokens=5), dict(max_num_seqs=3)]:
        assert RolloutEngine(model, **kw).generate(prompts, 15, seed=11) == expected, kw
    small = RolloutEngine(model, block_size=2, kv_cache_gb=32 * pool_bytes_per_position(model) / 2**30)
    assert small.generate(prompts, 15, seed=11) == expected
    assert small.stats["preemptions"] > 0
    half = len(prompts) // 2
    first = RolloutEngine(model).generate(prompts[:half], 15, seed=11, rows=range(half))
    second = RolloutEngine(model).generate(prompts[half:], 15, seed=11, rows=range(half, len(prompts)))
    assert first + second == expected


def test_shared_prefix_groups_hand_worked():
    """Blocks of 4. Sequences a, b, c begin with blocks 5, 6 (c and a also share block 7, b does not); d is alone.
    The group is a, b, c with k = 2 shared blocks, never the block a sequence writes its new token to; it is used
    when the positions it saves gathering (2 members x 2 blocks x 4) reach the minimum."""
    def single(table, start):
        return SimpleNamespace(start=start, seq=SimpleNamespace(tables=[table]))

    a, b, c, d = single([5, 6, 7, 9], 14), single([5, 6, 8, 10], 13), single([5, 6, 7, 11], 12), single([20, 21], 5)
    assert shared_prefix_groups([a, b, c, d], 0, 4, min_shared=16) == [([0, 1, 2], 2)]
    assert shared_prefix_groups([a, b, c, d], 0, 4, min_shared=17) == []
    assert shared_prefix_groups([a, single([5, 6, 7], 8)], 0, 4) == [([0, 1], 2)]  # block 7 is being written to
    assert shared_prefix_groups([d, single([20], 3)], 0, 4) == []  # the second writes to block 20 (position 3)
    assert shared_prefix_groups([d, single([20, 22], 4)], 0, 4) == [([0, 1], 1)]  # block 20 is full for both


@pytest.mark.parametrize("name", ["qwen3", "olmo3"])
def test_the_samples_of_a_prompt_attend_to_its_blocks_once_and_sample_what_generate_does(name):
    """GRPO groups (3 prompts of 13, 17 and 22 tokens x 4 samples, blocks of 4): the CPU decode steps attend to each
    group's shared prompt blocks once for the group and merge that with each sample's own keys by log-sum-exp
    (stats['shared_prefix_steps']); the tokens are generate's and the log-probs too, to float32 rounding. OLMo 3's
    sliding-window layers keep their own pool and gather as before. Each sample's own keys gathered one sequence at a
    time (gather_chunk_bytes=1) give the same bits."""
    model = tiny(name)
    g = torch.Generator().manual_seed(6)
    prompts = [p for n in (13, 17, 22) for p in [torch.randint(3, 131, (n,), generator=g).tolist()] * 4]
    expected, expected_lp = reference(model, prompts, 10, seed=5, return_logprobs=True)
    engine = RolloutEngine(model, block_size=4, shared_prefix_min_bytes=0)  # these tiny shapes save a few bytes
    tokens, logprobs = engine.generate(prompts, 10, seed=5, return_logprobs=True)
    assert tokens == expected
    torch.testing.assert_close(torch.tensor(logprobs), expected_lp, rtol=0, atol=2e-5)
    assert engine.stats["shared_prefix_steps"] >= 8  # of 9 decode steps (10 tokens, the first sampled by prefill)
    chunked = RolloutEngine(model, block_size=4, shared_prefix_min_bytes=0, gather_at_once_bytes=0,
                            gather_chunk_bytes=1)
    assert chunked.generate(prompts, 10, seed=5, return_logprobs=True) == (tokens, logprobs)
    assert chunked.stats["shared_prefix_steps"] == engine.stats["shared_prefix_steps"]
    by_default = RolloutEngine(model, block_size=4)  # SHARED_PREFIX_MIN_BYTES: not worth it at this size
    assert by_default.generate(prompts, 10, seed=5) == expected and by_default.stats["shared_prefix_steps"] == 0


def pool_bytes_per_position(model):
    a = model.args
    return 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 4


def test_engine_stops_each_sequence_at_its_first_eos_or_its_own_budget():
    model = tiny("llama_bias")
    prompts = grouped_prompts()
    free_run = RolloutEngine(model).generate(prompts, 10, seed=5)
    eos = [free_run[0][2], free_run[5][6]]
    expected = reference(model, prompts, 10, eos=eos, seed=5)
    assert RolloutEngine(model).generate(prompts, 10, seed=5, eos_token_id=eos) == expected
    assert any(len(t) < 10 for t in expected) and all(t[-1] in eos for t in expected if len(t) < 10)
    budgets = [1, 4, 0, 7] * 3
    cut = RolloutEngine(model).generate(prompts, budgets, seed=5)
    assert cut == [row[:n] for row, n in zip(free_run, budgets)]


def test_engine_holds_kv_for_the_tokens_it_keeps_and_little_more():
    """Heavy-tailed lengths: at the peak the blocks in use hold at most 1.25x the bytes of the tokens held there,
    plus one block per sequence (its partly filled last block), and far less than a padded cache would."""
    model = tiny("qwen3")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 131, (5,), generator=g).tolist() for _ in range(16)]
    lengths = torch.distributions.LogNormal(torch.tensor(2.5), torch.tensor(1.0)).sample((16,)).clamp(2, 80).long().tolist()
    engine = RolloutEngine(model, block_size=4)
    engine.generate(prompts, lengths, seed=0)
    s = engine.stats
    block_bytes = 4 * pool_bytes_per_position(model)
    assert s["peak_kv_bytes"] <= 1.25 * s["kv_token_bytes_at_peak"] + s["sequences_at_peak"] * block_bytes
    padded_bytes = 16 * (5 + max(lengths)) * pool_bytes_per_position(model)
    assert s["peak_kv_bytes"] < 0.6 * padded_bytes
    assert s["computed_tokens"] == 16 * 5 + sum(lengths) - 16  # no row-step is spent on a finished sequence


def test_engine_decodes_a_lora_policy_with_its_adapters_and_without():
    from ppo_core.models import lora

    model = tiny("qwen3")
    lora.add_lora(model, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    prompts = grouped_prompts()
    assert RolloutEngine(model).generate(prompts, 8, greedy=True) == reference(model, prompts, 8, greedy=True, seed=0)
    with lora.adapters_disabled(model):
        base = reference(model, prompts, 8, greedy=True, seed=0)
        assert RolloutEngine(model).generate(prompts, 8, greedy=True) == base
    assert base != reference(model, prompts, 8, greedy=True, seed=0)


def test_engine_refuses_what_it_cannot_do_with_one_line():
    model = tiny("qwen3")
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        RolloutEngine(model, kv_cache_gb=1e-9).generate([[1, 2]], 4)
    with pytest.raises(ValueError, match="empty prompt"):
        RolloutEngine(model).generate([[]], 4)
    with pytest.raises(ValueError, match="2 prompts, 1 max_new_tokens"):
        RolloutEngine(model).generate([[1], [2]], [3])


INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it where there is no GPU


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors through Triton's interpreter; on a GPU the CUDA tests run "
                                             "the compiled kernel")
@pytest.mark.parametrize("name", ["qwen3", "olmo3"])
def test_engine_decodes_through_the_triton_kernel_as_on_a_gpu(name, monkeypatch):
    """PPO_KERNELS_BACKEND=triton: the engine's single-token attention runs the paged decode kernel (in Triton's
    interpreter here), reading the block tables and sequence lengths it is given (OLMo 3: a window of 5 over
    blocks of 4, in its own pool); the same tokens as the padded reference."""
    import ppo_core.engine.rollout_engine as engine_module

    monkeypatch.setenv("PPO_KERNELS_BACKEND", "triton")
    calls = []
    kernel = engine_module.paged_decode_attention
    monkeypatch.setattr(engine_module, "paged_decode_attention", lambda *a: calls.append(a[3].shape) or kernel(*a))
    model = tiny(name)
    prompts = grouped_prompts()[:6]
    expected = reference(model, prompts, 6, greedy=True, seed=0)
    assert RolloutEngine(model, block_size=4).generate(prompts, 6, greedy=True) == expected
    assert len(calls) >= 5 * model.args.num_hidden_layers  # every decode step, every layer: the kernel ran


@pytest.mark.parametrize("name", ["qwen3", "olmo3"])
def test_engine_under_cpu_bf16_autocast_samples_what_generate_does(name):
    """dtype='bf16-mixed' on the CPU: matmuls in bf16 (packed bf16 weights where oneDNN has bf16 kernels, autocast's
    F.linear elsewhere), attention and the KV cache in float32, as ppo_core.generate decodes. The two multiply the
    same bf16 operands and differ only in the order of the fp32 accumulation (rows per matmul): greedy tokens equal,
    log-probs within one bf16 rounding step at magnitude 1 (2^-8; measured: at most 2.2e-4). The same with the decode
    attention's gathers one sequence at a time (gather_chunk_bytes=1): the chunks too attend in float32."""
    model = tiny(name)
    prompts = grouped_prompts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_lp = reference(model, prompts, 8, greedy=True, seed=0, return_logprobs=True)
        for chunk_bytes in [None, 1]:
            engine = RolloutEngine(model, block_size=4, gather_at_once_bytes=0, gather_chunk_bytes=chunk_bytes)
            tokens, logprobs = engine.generate(prompts, 8, greedy=True, return_logprobs=True)
            assert tokens == expected, chunk_bytes
            torch.testing.assert_close(torch.tensor(logprobs), expected_lp, rtol=0, atol=2**-8)


# -- multi-turn episodes: a turn ends, an observation is appended, decoding goes on -----------------------------

OBSERVATIONS = {0: [[7, 8, 9], [11]], 1: [[20, 21]], 2: [], 3: [[5, 5, 5, 5]]}  # per prompt, one per turn end


def turn_by_turn(model, prompt, observations, turn_tokens, budget):
    """The reference: each turn decoded by a fresh greedy engine call on the whole conversation so far (prompt, the
    turns, the observations) -> (tokens after the prompt, mask)."""
    tokens, mask = [], []
    for k in range(len(observations) + 1):
        room = budget - len(tokens)
        turn = RolloutEngine(model).generate([prompt + tokens], min(turn_tokens, room), greedy=True)[0]
        tokens += turn
        mask += [1] * len(turn)
        if k == len(observations) or len(tokens) >= budget or budget - len(tokens) <= len(observations[k]):
            break
        tokens += observations[k]
        mask += [0] * len(observations[k])
    return tokens, mask


def scripted(observations, executor=None, slow=()):
    """on_turn_end answering prompt i's k-th turn end with observations[i][k] (None after the last); for the prompts
    in `slow`, through a Future that a thread completes after 50 ms, as a tool running alongside decoding would."""
    seen = {}

    def on_turn_end(index, tokens):
        k = seen[index] = seen.get(index, -1) + 1
        answer = observations[index][k] if k < len(observations[index]) else None
        if index in slow:
            return executor.submit(lambda: (time.sleep(0.05), answer)[1])
        return answer
    return on_turn_end


@pytest.mark.parametrize("name", ["qwen3", "olmo3"])
def test_multi_turn_episodes_continue_on_their_own_cache(name):
    """Turns of 4 sampled tokens, then each prompt's observations: the tokens of a fresh decode of each whole
    conversation (greedy), observation tokens masked 0, each position computed once (the observations are prefilled
    on the sequence's own cache, never the conversation again), also when one prompt's tool answers late."""
    model = tiny(name)
    prompts = grouped_prompts()[:4]
    budget = 16
    want = [turn_by_turn(model, p, OBSERVATIONS[i], 4, budget) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(2) as executor:
        for slow in [(), (0, 3)]:
            engine = RolloutEngine(model, block_size=4)
            tokens, mask, logprobs = engine.generate(
                prompts, budget, greedy=True, on_turn_end=scripted(OBSERVATIONS, executor, slow), max_turn_tokens=4,
                return_mask=True, return_logprobs=True)
            assert [(t, m) for t, m in zip(tokens, mask)] == want, slow
            assert all(lp == 0.0 for row, m in zip(logprobs, mask) for lp, keep in zip(row, m) if not keep)
            s = engine.stats
            assert s["computed_tokens"] == sum(len(p) + len(t) - 1 for p, t in zip(prompts, tokens)) - s["prefix_hit_tokens"]
            assert s["observation_tokens"] == sum(len(t) - sum(m) for t, m in zip(tokens, mask))
            assert 0.0 < s["busy_fraction"] <= 1.0


def test_multi_turn_parked_sequences_give_up_their_blocks_when_the_pool_runs_out():
    """A pool of 40 positions for four episodes whose tools answer late: parked sequences' blocks are freed for the
    running ones and recomputed when their tool answers; the tokens do not change."""
    model = tiny("qwen3")
    prompts = grouped_prompts()[:4]
    want = [turn_by_turn(model, p, OBSERVATIONS[i], 4, 16) for i, p in enumerate(prompts)]
    engine = RolloutEngine(model, block_size=2, kv_cache_gb=40 * pool_bytes_per_position(model) / 2**30)
    with ThreadPoolExecutor(2) as executor:
        tokens, mask = engine.generate(prompts, 16, greedy=True, on_turn_end=scripted(OBSERVATIONS, executor, (0, 1, 3)),
                                       max_turn_tokens=4, return_mask=True)
    assert [(t, m) for t, m in zip(tokens, mask)] == want
    assert engine.stats["preemptions"] > 0


# -- decode-only steps on fixed-shape buffers (ppo_core.engine.static_decode), and their CUDA graphs ---------------------

BUDGETS = [3, 12, 7, 1, 9, 5, 12, 2, 8, 11, 4, 6]  # grouped_prompts' 12 sequences leave at different steps


def test_only_steps_of_single_tokens_without_copies_are_decode_only():
    seq = Sequence(0, 0, [5, 6, 7], 3, 4)
    assert decode_only(Step(0, [Chunk(seq, 2, 1, True), Chunk(seq, 5, 1, False)], [[], []]))
    assert not decode_only(Step(0, [Chunk(seq, 2, 1, True), Chunk(seq, 0, 3, True)], [[], []]))  # a prefill chunk
    assert not decode_only(Step(0, [Chunk(seq, 2, 1, True)], [[], [(4, 7, 2)]]))  # a copy-on-write first
    assert [decode_bucket(n) for n in (1, 2, 3, 5, 8, 9, 64, 65, 256)] == [1, 2, 4, 8, 8, 16, 64, 128, 256]
    # more sequences than the buffers' rows (resumed multi-turn episodes may pass max_num_seqs): the dynamic step
    layout = PoolLayout([None], [0] * 4, [0, 1, 2, 3], block_size=4, n_blocks=[8], device=torch.device("cpu"))
    static = StaticDecode(tiny("qwen3"), [], layout, max_rows=3, max_len=20, cuda_graphs=False)
    assert static.rows == 4 and static.tables.shape == (1, 4, 5)
    assert static.takes(Step(0, [Chunk(seq, 2, 1, True)] * 4, [[]]))
    assert not static.takes(Step(0, [Chunk(seq, 2, 1, True)] * 5, [[]]))


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_static_decode_steps_give_the_tokens_and_logprobs_of_the_dynamic_steps(name, greedy):
    """Every family (GQA, OLMo 3's sliding window in its own pool, NoPE layers, clip_qkv), sequences leaving at
    different steps (buckets of 16, 8, 4 and 2 rows, with padding rows): the decode-only steps on the static buffers (the
    torch reference attention over tables padded to the call's width) sample the dynamic steps' tokens, and their
    log-probs to float32 rounding (measured: at most 2.4e-6; the two attentions sum in other orders)."""
    model = tiny(name)
    prompts = grouped_prompts()
    dynamic, static = RolloutEngine(model, block_size=4), RolloutEngine(model, block_size=4, static_decode=True)
    tokens, logprobs = dynamic.generate(prompts, BUDGETS, greedy=greedy, seed=3, return_logprobs=True)
    static_tokens, static_logprobs = static.generate(prompts, BUDGETS, greedy=greedy, seed=3, return_logprobs=True)
    assert static_tokens == tokens
    torch.testing.assert_close(torch.tensor(sum(static_logprobs, [])), torch.tensor(sum(logprobs, [])), rtol=0,
                               atol=1e-5)
    s = static.stats
    assert dynamic.stats["static_steps"] == 0 and s["static_steps"] == s["steps"] - 1  # all but the prefill step
    assert s["computed_tokens"] == dynamic.stats["computed_tokens"] and s["graph_replays"] == s["graph_captures"] == 0
    assert s["cuda_graphs"] == dynamic.stats["cuda_graphs"] == "off: not on CUDA (cpu)"


@pytest.mark.parametrize("name", ["qwen3", "olmo3"])
def test_static_decode_steps_keep_the_tokens_under_every_scheduling_choice(name):
    """Preemption (a pool of 32 positions, blocks of 2), at most 3 sequences at once (their admissions' prefills
    between the decode-only steps), prefill chunks of 5, and multi-turn episodes whose tools answer late (sequences
    parked and resumed): the static steps give the dynamic steps' tokens."""
    model = tiny(name)
    prompts = grouped_prompts(seed=2)
    expected = RolloutEngine(model).generate(prompts, 15, seed=11)
    for kw in [dict(block_size=2, kv_cache_gb=32 * pool_bytes_per_position(model) / 2**30), dict(max_num_seqs=3),
               dict(block_size=8, max_step_tokens=5)]:
        engine = RolloutEngine(model, static_decode=True, **kw)
        assert engine.generate(prompts, 15, seed=11) == expected, kw
        assert engine.stats["static_steps"] > engine.stats["steps"] // 2 and (
            engine.stats["preemptions"] > 0 or "kv_cache_gb" not in kw), kw
    with ThreadPoolExecutor(2) as executor:
        episodes = [RolloutEngine(model, block_size=4, static_decode=static).generate(
            grouped_prompts()[:4], 16, greedy=True, on_turn_end=scripted(OBSERVATIONS, executor, (0, 3)),
            max_turn_tokens=4, return_mask=True) for static in (False, True)]
    assert episodes[1] == episodes[0]


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors through Triton's interpreter; on a GPU the CUDA tests run "
                                             "the compiled kernel")
@pytest.mark.parametrize("name", ["qwen3", "olmo3"])
def test_static_decode_steps_launch_the_triton_kernel_with_shapes_fixed_per_bucket(name, monkeypatch):
    """PPO_KERNELS_BACKEND=triton (the kernel in Triton's interpreter): the static steps give the dynamic steps'
    tokens (those on the CPU's attention), and every kernel launch reads a table of the call's width W and a bucket's
    rows, so its grid (B, n_kv_heads, num_splits) and num_splits (default_num_splits of B, n_kv_heads, W and the
    SM count) are one per bucket, what a captured launch needs; the padding rows (length 1, table [spare block, -1,
    ...]) and the table columns past each row's length (stale or -1) are read as they must be."""
    import ppo_core.engine.static_decode as static_module

    model = tiny(name)
    prompts, budgets = grouped_prompts()[:6], [2, 6, 4, 1, 6, 3]
    expected = RolloutEngine(model, block_size=4).generate(prompts, budgets, greedy=True)
    monkeypatch.setenv("PPO_KERNELS_BACKEND", "triton")
    launches = []
    kernel = static_module.paged_decode_attention

    def recording(q, k_cache, v_cache, tables, lengths, window):
        launches.append((q.shape[0], tuple(tables.shape), tuple(lengths.shape), window))
        return kernel(q, k_cache, v_cache, tables, lengths, window)

    monkeypatch.setattr(static_module, "paged_decode_attention", recording)
    engine = RolloutEngine(model, block_size=4, static_decode=True)
    assert engine.generate(prompts, budgets, greedy=True) == expected
    W = -(-max(len(p) + b for p, b in zip(prompts, budgets)) // 4)
    assert len(launches) == engine.stats["static_steps"] * model.args.num_hidden_layers > 0
    assert all(tables == (B, W) and lengths == (B,) and B == decode_bucket(B) for B, tables, lengths, _ in launches)
    assert len({B for B, *_ in launches}) >= 3  # 8, then fewer as sequences leave
    if name == "olmo3":
        assert {window for *_, window in launches} == {None, 5}  # the full and the sliding group


def cuda_graph_model(name):
    """tiny(name) on the GPU; "qwen3 lora": with LoRA adapters (frozen base weights: their autocast casts are not
    cached, so every replay recomputes them inside the graph)."""
    from ppo_core.models import lora

    model = tiny(name.split()[0])
    if name.endswith("lora"):
        lora.add_lora(model, 4, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0, 0.5)
    return model.cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["olmo3", "qwen3 lora"])
def test_cuda_graph_decode_steps_give_the_tokens_of_the_eager_steps(name):
    """Under bf16 autocast with fp32 weights (the trainer's rollout): the decode-only steps replayed as CUDA graphs
    (one captured per bucket) give the tokens and log-probs of the same static steps run eagerly, greedy and sampled;
    in float32, the greedy tokens of the dynamic steps (other kernels' shapes: other num_splits, other row counts)."""
    model = cuda_graph_model(name)
    prompts = grouped_prompts()
    for greedy in (True, False):
        kw = dict(greedy=greedy, seed=3, return_logprobs=True)
        eager = RolloutEngine(model, block_size=4, cuda_graphs=False, static_decode=True)
        graphs = RolloutEngine(model, block_size=4)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            tokens, logprobs = eager.generate(prompts, BUDGETS, **kw)
            graph_tokens, graph_logprobs = graphs.generate(prompts, BUDGETS, **kw)
        assert graph_tokens == tokens, greedy
        torch.testing.assert_close(torch.tensor(sum(graph_logprobs, [])), torch.tensor(sum(logprobs, [])), rtol=0,
                                   atol=1e-6)
        s = graphs.stats
        assert s["cuda_graphs"] == "on" and eager.stats["cuda_graphs"] == "off: cuda_graphs=False"
        assert s["graph_replays"] == s["static_steps"] == eager.stats["static_steps"] > 0
        assert 1 <= s["graph_captures"] <= 5  # buckets 16, 8, 4, 2, 1 at most, each captured once in the call
    dynamic = RolloutEngine(model, block_size=4, cuda_graphs=False).generate(prompts, BUDGETS, greedy=True)
    assert RolloutEngine(model, block_size=4).generate(prompts, BUDGETS, greedy=True) == dynamic
