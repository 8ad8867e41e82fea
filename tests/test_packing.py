"""Packed (padding-free) forwards and the packing logic: ppo_core/data/packing.py and the packed parts of ppo_core/models/model.py
(`packed_attention`, `Backbone.forward_packed`, `forward(packed=...)`, `ScoreModel.score_packed`), and the reward
model's scoring by token budget (ppo_core/rewards/reward_model.py). Runs everywhere; one GPU tier at the end.

    python -m pytest -q tests/test_packing.py

The references are independent of the packed code: each sequence run alone (`model(seq[None])`, no padding, no
packing), the padded forward (`model(ids, mask)`), hand-worked index numbers, and plain-Python checks of what the
micro-batch and process splits promise. The model checks run in float64 on the tiny random families of
tests/test_generate.py, so that the only difference the tolerance absorbs is the order of float64 sums.
"""
import copy
import dataclasses
import itertools
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from ppo_core.config import build_config
from ppo_core.models.lora import LoRALinear, add_lora, adapters_disabled
from ppo_core.models.model import CausalLM, ModelArgs, ScoreModel, attention, causal_window_mask, packed_attention
from ppo_core.data.packing import balanced_split, pack_rows, token_budget_micro_batches, unpack_rows
from ppo_core.rewards.reward_model import RewardModelReward
from ppo_core.train import DEMO_CHECKPOINT

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from random_weights import randomize  # noqa: E402
from test_generate import BASE, CONFIGS, tiny  # noqa: E402

LENGTHS = [7, 3, 11, 1]  # longer and shorter than olmo3's window of 5, and a sequence of one token

# float64: the packed, alone and padded forwards differ only in the order of sums (matmuls of other shapes block
# differently), a few units of float64 rounding (2^-53 = 1.1e-16) per dot product over 4 layers; measured at
# <= 1.3e-15 of the largest magnitude. A token that attends across sequences, to a pad or at a wrong position is
# off by O(1) of it.
F64 = 1e-12
# A float64 result returned as float32 (ScoreModel's heads end in .float()): two float64 values equal to F64 can round
# to neighbouring float32 numbers, one float32 unit in the last place apart, <= 2^-23 of the value.
F32_ULP = torch.finfo(torch.float32).eps


def assert_close64(got, want):
    """got == want up to F64 of want's largest magnitude (the scale of the sums' rounding)."""
    assert got.shape == want.shape
    scale = want.abs().max()
    assert (got - want).abs().max() <= F64 * scale, ((got - want).abs().max() / scale).item()


def assert_same_float32(got, want):
    """Float32 roundings of float64 values that agree to F64: at most one float32 unit in the last place apart."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).abs() <= F32_ULP * want.abs()).all(), (got - want).abs().max().item()


def sequences(lengths=LENGTHS, vocab=131, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def packed_inputs(seqs):
    """(input_ids [N], positions [N], seq_lens): the sequences one after another, positions from 0 in each."""
    return torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs]), [len(s) for s in seqs]


def padded_inputs(seqs, side="left"):
    """(ids [S, T], mask [S, T] long): each sequence padded with 0 to the longest, on the left or the right."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


# -- the packed forward against each sequence alone and the padded forward ----------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_logits_equal_each_sequence_alone_and_the_padded_forward(name):
    model = tiny(name).double()
    seqs = sequences()
    flat, positions, seq_lens = packed_inputs(seqs)
    ids, mask = padded_inputs(seqs)  # left-padded
    with torch.no_grad():
        packed = model(flat, packed=(positions, seq_lens))  # [N, V]
        alone = torch.cat([model(s[None])[0] for s in seqs])  # [N, V]
        padded = model(ids, mask)[mask.bool()]  # [N, V], the real tokens row by row: the pack's order
    assert packed.dtype == torch.float64 and packed.shape == (sum(LENGTHS), 131)
    assert_close64(packed, alone)
    assert_close64(packed, padded)


def test_packed_forward_does_not_depend_on_the_order_of_the_pack():
    """A sequence's logits are the same wherever it sits in the pack (its positions restart at 0)."""
    model = tiny("olmo3").double()
    seqs = sequences()
    order = [2, 0, 3, 1]
    flat, positions, seq_lens = packed_inputs(seqs)
    flat_shuffled, positions_shuffled, seq_lens_shuffled = packed_inputs([seqs[i] for i in order])
    with torch.no_grad():
        packed = model(flat, packed=(positions, seq_lens))
        shuffled = model(flat_shuffled, packed=(positions_shuffled, seq_lens_shuffled))
    starts = [0, *itertools.accumulate(LENGTHS)]
    back = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in order])  # rows of `packed` in `order`
    assert_close64(shuffled, packed[back])


def test_causal_lm_packed_passes_hidden_states_to_head_fn():
    """head_fn gets the packed hidden [N, H] (return_hidden's) and the LM head's weight, whose product is the
    logits."""
    model = tiny("llama_bias").double()
    flat, positions, seq_lens = packed_inputs(sequences())
    with torch.no_grad():
        hidden = model(flat, packed=(positions, seq_lens), return_hidden=True)  # [N, H]
        head_hidden, head_weight = model(flat, packed=(positions, seq_lens), head_fn=lambda h, w: (h, w))
        logits = model(flat, packed=(positions, seq_lens))  # [N, V]
    assert hidden.shape == (sum(LENGTHS), 60)
    assert torch.equal(head_hidden, hidden) and head_weight is model.lm_head.weight
    assert_close64(hidden @ head_weight.T, logits)


# -- gradients ----------------------------------------------------------------------------------------------------

def parameter_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert_close64(got[name], want[name])


@pytest.mark.parametrize("name", ["llama_bias", "olmo3"])
def test_packed_gradients_equal_padded_gradients_with_and_without_checkpointing(name):
    """sum(logits * fixed random weights) over the real tokens: every parameter's gradient is the padded
    forward's; with gradient checkpointing in train mode (each block then runs twice) the same again."""
    model = tiny(name).double()
    seqs = sequences()
    flat, positions, seq_lens = packed_inputs(seqs)
    ids, mask = padded_inputs(seqs)
    weights = torch.randn(sum(LENGTHS), 131, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def packed_loss():
        return (model(flat, packed=(positions, seq_lens)) * weights).sum()

    def padded_loss():
        return (model(ids, mask)[mask.bool()] * weights).sum()

    padded = parameter_grads(model, padded_loss)
    assert len(padded) == len(list(model.parameters()))  # every parameter is reached
    assert_same_grads(parameter_grads(model, packed_loss), padded)

    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))  # (a recomputation stops early)
    model.model.gradient_checkpointing = True
    model.train()
    assert_same_grads(parameter_grads(model, packed_loss), padded)
    assert len(calls) == 2  # the forward and its recomputation in the backward: checkpointing ran
    assert_same_grads(parameter_grads(model, padded_loss), padded)


# -- LoRA ---------------------------------------------------------------------------------------------------------

def test_lora_packed_equals_padded_with_adapters_on_and_off():
    model = tiny("olmo3").double()
    seqs = sequences()
    flat, positions, seq_lens = packed_inputs(seqs)
    ids, mask = padded_inputs(seqs)
    with torch.no_grad():
        base = model(ids, mask)[mask.bool()]
    add_lora(model, rank=4, alpha=8.0, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # adapters as after some training (B starts at zero), moving the logits by O(1)
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g, dtype=torch.float64) / m.in_features ** 0.5)
                m.lora_B.copy_(0.3 * torch.randn(m.lora_B.shape, generator=g, dtype=torch.float64) / m.rank ** 0.5)
        adapted = model(flat, packed=(positions, seq_lens))
        assert_close64(adapted, model(ids, mask)[mask.bool()])
        assert (adapted - base).abs().max() > 0.1 * base.abs().max()  # the adapters matter
        with adapters_disabled(model):
            reference = model(flat, packed=(positions, seq_lens))
            assert_close64(reference, model(ids, mask)[mask.bool()])
    assert_close64(reference, base)


# -- ScoreModel ---------------------------------------------------------------------------------------------------

def tiny_score_model(name, vocab_size=131, seed=0):
    cfg = {**BASE, **CONFIGS[name], "vocab_size": vocab_size,
           "architectures": [CONFIGS[name]["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
           "num_labels": 1, "pad_token_id": 0}
    return randomize(ScoreModel(ModelArgs.from_hf_config(cfg)), seed).eval()


@pytest.mark.parametrize("name", ["llama_bias", "olmo3"])
def test_score_model_packed_equals_padded(name):
    """score_packed: the score at each sequence's last token, as score() on right-padded rows; forward(packed=...):
    the values of the padded forward at the real tokens; the float64 hidden states under both."""
    model = tiny_score_model(name).double()
    seqs = sequences()
    flat, positions, seq_lens = packed_inputs(seqs)
    ids, mask = padded_inputs(seqs, side="right")
    with torch.no_grad():
        assert_close64(model.model.forward_packed(flat, positions, seq_lens), model.model(ids, mask)[mask.bool()])
        scores = model.score_packed(flat, positions, seq_lens)  # [S]
        assert scores.shape == (len(seqs),)
        assert_same_float32(scores, model.score(ids, mask))
        assert_same_float32(model(flat, packed=(positions, seq_lens)), model(ids, mask)[mask.bool()])


# -- pack_rows and unpack_rows, on hand-worked numbers ------------------------------------------------------------

# 3 rows, prompt length P = 4 (left-padded), R = 3 response tokens (right-padded; row 2 has a hole at response column 1)
HAND_IDS = torch.tensor([[0, 0, 11, 12, 13, 14, 0],
                         [21, 22, 23, 24, 25, 0, 0],
                         [0, 31, 32, 33, 34, 0, 36]])
HAND_MASK = HAND_IDS != 0


def test_pack_rows_on_hand_worked_rows():
    pack = pack_rows(HAND_IDS, HAND_MASK, prompt_len=4)
    assert pack.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23, 24, 25, 31, 32, 33, 34, 36]
    assert pack.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert pack.seq_lens == [4, 5, 5]
    # response token j of row i (column 4 + j) is predicted by column 3 + j; N = 14 where that column is a pad
    assert pack.response_index.tolist() == [[1, 2, 3],  # 12, 13, 14
                                            [7, 8, 14],  # 24, 25, pad
                                            [11, 12, 14]]  # 33, 34, the hole
    assert pack.args == (pack.positions, pack.seq_lens)


def test_unpack_rows_zeros_at_n_and_gradient_back_to_the_packed_rows():
    pack = pack_rows(HAND_IDS, HAND_MASK, prompt_len=4)
    N, index = 14, pack.response_index
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(N, 5, generator=g, dtype=torch.float64, requires_grad=True)  # [N, H]
    out = unpack_rows(hidden, index)  # [3, 3, 5]
    assert out.shape == (3, 3, 5)
    upstream = torch.randn(3, 3, 5, generator=g, dtype=torch.float64)
    out.backward(upstream)
    want_grad = torch.zeros(N, 5, dtype=torch.float64)
    for i, j in itertools.product(range(3), range(3)):
        n = index[i, j].item()
        if n == N:
            assert (out[i, j] == 0).all()
        else:
            assert torch.equal(out[i, j], hidden[n])
            want_grad[n] += upstream[i, j]
    assert torch.equal(hidden.grad, want_grad)  # each row receives only its own positions' gradients
    assert (hidden.grad[[0, 4, 5, 6, 9, 10, 13]] == 0).all()  # rows no response token reads


@pytest.mark.parametrize("name", ["llama_bias", "olmo3"])
def test_pack_rows_feeds_the_model_as_each_row_alone(name):
    """The pack of a padded batch (left-padded prompts, right-padded responses, a hole) through the model, laid out
    by response_index: at every response-predicting column that is a real token, the hidden state of that token in
    its row's real tokens run alone; zeros elsewhere. Without sliding windows, the padded forward's too."""
    model = tiny(name).double()
    g = torch.Generator().manual_seed(5)
    P, R = 7, 8
    ids = torch.randint(3, 131, (3, P + R), generator=g)
    mask = torch.ones(3, P + R, dtype=torch.bool)
    mask[0, :3] = False  # left padding of the prompts
    mask[1, :1] = False
    mask[1, 12:] = False  # right padding of the responses
    mask[2, 9] = False  # a hole in row 2's response
    pack = pack_rows(ids, mask, prompt_len=P)
    predicting = mask[:, P - 1 : -1]  # [3, R] the columns that predict the response tokens, where real
    with torch.no_grad():
        hidden = unpack_rows(model(pack.input_ids, packed=pack.args, return_hidden=True), pack.response_index)
        alone = torch.zeros_like(hidden)  # [3, R, H]
        for i in range(3):
            row = model(ids[i, mask[i]][None], return_hidden=True)[0]  # [n_i, H] the row's real tokens alone
            columns = mask[i].nonzero().squeeze(1).tolist()
            for j in range(R):
                if predicting[i, j]:
                    alone[i, j] = row[columns.index(P - 1 + j)]
        padded = model(ids, mask.long(), return_hidden=True)[:, P - 1 : -1]  # [3, R, H]
    assert_close64(hidden[predicting], alone[predicting])
    assert (hidden[~predicting] == 0).all()
    if name != "olmo3":  # see test_padded_forward_window_counts_a_hole_that_positions_skip
        assert_close64(hidden[predicting], padded[predicting])


@pytest.mark.xfail(strict=True, reason="Backbone.forward (padded, rows with holes): RoPE positions skip a hole, the "
                                       "sliding window counts its column; the packed forward and the row alone skip it")
def test_padded_forward_window_counts_a_hole_that_positions_skip():
    """A row with a hole (a masked column between real tokens) in the padded forward against the row's real tokens
    alone, on a model with a window of 5: the tokens after the hole differ where the hole falls within the window."""
    model = tiny("olmo3").double()
    ids = torch.randint(3, 131, (1, 12), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, 6] = 0  # the hole
    with torch.no_grad():
        padded = model(ids, mask)[mask.bool()]
        alone = model(ids[mask.bool()][None])[0]
    assert_close64(padded, alone)


# -- token_budget_micro_batches -----------------------------------------------------------------------------------

def test_token_budget_micro_batches_hand_worked():
    # first-fit decreasing: 11 (9) | 10 (5) + 13 (5) | 12 (3) + 14 (2)
    assert token_budget_micro_batches([10, 11, 12, 13, 14], [5, 9, 3, 5, 2], 10) == [[11], [10, 13], [12, 14]]
    # a row over the budget alone; nothing joins it
    assert token_budget_micro_batches([0, 1, 2], [4, 15, 6], 10) == [[1], [2, 0]]
    # ties in the order of `rows`, the same answer every call
    assert token_budget_micro_batches([7, 3, 5, 9], [4, 4, 4, 4], 8) == [[7, 3], [5, 9]]
    assert token_budget_micro_batches([9, 5, 3, 7], [4, 4, 4, 4], 8) == [[9, 5], [3, 7]]
    assert token_budget_micro_batches([], [], 8) == []


def fewest_micro_batches(lengths, budget):
    """The optimum, by brute force over subsets (dynamic programming over bitmasks; lengths all <= budget)."""
    n = len(lengths)
    fits = [sum(lengths[i] for i in range(n) if s >> i & 1) <= budget for s in range(1 << n)]
    best = [0] + [n + 1] * ((1 << n) - 1)
    for s in range(1, 1 << n):
        low = s & -s  # the micro-batch holding the lowest row of s
        rest = s ^ low
        sub = rest
        while True:
            if fits[sub | low]:
                best[s] = min(best[s], 1 + best[rest ^ sub])
            if sub == 0:
                break
            sub = (sub - 1) & rest
    return best[-1]


def test_token_budget_micro_batches_random_against_plain_python_checks():
    rng = random.Random(0)
    for case in range(300):
        n, budget = rng.randint(1, 8), rng.randint(4, 40)
        lengths = [max(1, int(rng.paretovariate(1.2) * budget / 6)) for _ in range(n)]  # heavy-tailed, some > budget
        rows = rng.sample(range(100), n)
        length = dict(zip(rows, lengths))
        bins = token_budget_micro_batches(rows, lengths, budget)
        assert bins == token_budget_micro_batches(rows, lengths, budget)  # deterministic
        assert sorted(r for b in bins for r in b) == sorted(rows)  # every row exactly once
        for k, b in enumerate(bins):
            load = sum(length[r] for r in b)
            assert load <= budget or len(b) == 1, (case, b)  # the budget, or one over-long row alone
            assert [length[r] for r in b] == sorted((length[r] for r in b), reverse=True)  # went in longest first
            for later in bins[k + 1 :]:  # first fit: a later micro-batch's first row did not fit into this one
                assert load + length[later[0]] > budget, (case, bins)
        # FFD's bound (Dosa 2007): at most 11/9 OPT + 6/9 micro-batches, OPT by brute force
        fitting = [x for x in lengths if x <= budget]
        if fitting:
            over = len(lengths) - len(fitting)
            assert len(bins) - over <= 11 / 9 * fewest_micro_batches(fitting, budget) + 6 / 9, (case, bins)


# -- balanced_split -----------------------------------------------------------------------------------------------

def test_balanced_split_hand_worked():
    # longest first to the least-loaded process (ties to the lowest rank): 1 -> p0 (8), 3 -> p1 (6), 4 -> p1 (11),
    # 0 -> p0 (11), 5 -> p0 (13, tie), 2 -> p1 (12); each share in the order of `rows`
    assert balanced_split([0, 1, 2, 3, 4, 5], [3, 8, 1, 6, 5, 2], 2) == [[0, 1, 5], [2, 3, 4]]
    # 1 -> p0 (8), 3 -> p1 (6), 4 -> p2 (5), 0 -> p2 (8), 5 -> p1 (8), 2 -> p0 (9: all tied at 8)
    assert balanced_split([0, 1, 2, 3, 4, 5], [3, 8, 1, 6, 5, 2], 3) == [[1, 2], [3, 5], [0, 4]]
    assert balanced_split([4, 2], [1, 1], 3) == [[4], [2], []]  # more processes than rows


def test_balanced_split_random_heavy_tailed_within_the_lpt_bound():
    rng = random.Random(1)
    for case in range(200):
        n, world = rng.randint(1, 60), rng.randint(1, 8)
        lengths = [max(1, int(rng.paretovariate(1.1) * 20)) for _ in range(n)]
        rows = rng.sample(range(1000), n)
        length, place = dict(zip(rows, lengths)), {r: i for i, r in enumerate(rows)}
        shares = balanced_split(rows, lengths, world)
        assert len(shares) == world
        assert sorted(r for s in shares for r in s) == sorted(rows)  # every row exactly once
        for share in shares:
            assert [place[r] for r in share] == sorted(place[r] for r in share)  # the order of `rows`
        loads = [sum(length[r] for r in s) for s in shares]
        # greedy list scheduling: the fullest share was the emptiest (<= the mean) before its last row
        assert max(loads) <= sum(lengths) / world + max(lengths), (case, loads)
        assert shares == balanced_split(rows, lengths, world)  # every process computes the same split


# -- the reward model's scoring by token budget --------------------------------------------------------------------

PROMPTS = ["abc=", "kitten=", "xy=", "hello=", "q=", "racecar=", "", "madaminedenimadam=", "zz="]
RESPONSES = ["cba", "nettik", "", "olleh", "q", "racecar", "", "madaminedenimadam", "zz"]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A small random Olmo3ForSequenceClassification (sliding window 5) over the demo tokenizer, written by us."""
    path = tmp_path_factory.mktemp("rm")
    tiny_score_model("olmo3", vocab_size=29).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO_CHECKPOINT, name), path / name)
    return str(path)


def test_reward_model_packed_scores_equal_padded_scores(reward_model_dir):
    """cfg.micro_batch_tokens > 0 scores in packed micro-batches (five here: one text longer than the budget alone,
    two texts in each of the others, an empty text among them): the scores of the padded batches, in the same order."""
    padded_cfg = build_config(overrides={"reward_model": reward_model_dir})
    source = RewardModelReward(reward_model_dir, padded_cfg, "cpu", torch.float64, batch_size=4)
    lengths = [len(source.tokenizer.encode(p + r)) for p, r in zip(PROMPTS, RESPONSES)]
    budget = 16
    bins = token_budget_micro_batches(list(range(len(lengths))), [max(n, 1) for n in lengths], budget)
    assert len(bins) >= 4 and min(len(b) for b in bins[1:]) == 2 and max(lengths) > budget and min(lengths) == 0
    padded, _ = source(PROMPTS, RESPONSES)
    source.cfg = dataclasses.replace(padded_cfg, micro_batch_tokens=budget)
    packed, metrics = source(PROMPTS, RESPONSES)
    assert metrics == {} and packed.device.type == "cpu"
    assert_same_float32(packed, padded)
    assert padded.unique().numel() == len(PROMPTS)  # every text its own score: a mixed-up order would show


SHARDED_DRIVER = """
import json, sys
import torch
from ppo_core.models import distributed as dist
from ppo_core.config import build_config
from ppo_core.rewards.reward_model import RewardModelReward
path, out, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rank, world, device = dist.init("cpu")
source = RewardModelReward(path, build_config(overrides={"reward_model": path, "micro_batch_tokens": "16"}), "cpu",
                           torch.float64)
dist.shard(source.model, device, root=False)  # as ppo_core.run.start.spread_over_processes shards it (shard_frozen)
# Each block is then an FSDP root of its own, which FSDP2 keeps gathered after its first forward: made to free its
# weights after every forward, as a non-root unit does, so that every forward all-gathers.
for block in source.model.model.layers:
    block.set_reshard_after_forward(True)
scores, _ = source(*texts[rank])
torch.save(scores, f"{out}/scores-{rank}.pt")
"""


def test_sharded_reward_model_packed_scoring_with_unequal_micro_batch_counts(reward_model_dir, tmp_path):
    """2 processes under torchrun, the reward model FSDP-sharded: process 0 scores texts that take five micro-batches,
    process 1 one short text. Every forward all-gathers each block, so without the 1-token forwards that even out
    the counts process 0 would wait for process 1 in vain; with them each gets the scores of one unsharded process."""
    texts = [[PROMPTS, RESPONSES], [["ab="], ["ba"]]]
    script = tmp_path / "driver.py"
    script.write_text(SHARDED_DRIVER)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run([*torchrun, str(script), reward_model_dir, str(tmp_path), json.dumps(texts)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = build_config(overrides={"reward_model": reward_model_dir, "micro_batch_tokens": "16"})
    one = RewardModelReward(reward_model_dir, cfg, "cpu", torch.float64)
    for rank, (prompts, responses) in enumerate(texts):
        assert_same_float32(torch.load(tmp_path / f"scores-{rank}.pt"), one(prompts, responses)[0])


# -- GPU tier: varlen flash attention -----------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (varlen flash attention)")
BF16_ROUNDING = torch.finfo(torch.bfloat16).eps / 2  # 2^-8: a rounding to bf16 moves a value by at most this of it


def per_sequence_bf16(q, k, v, seq_lens, window):
    """The reference in the input dtype on the GPU: one SDPA call per sequence (packed_attention's CPU loop)."""
    outputs, start = [], 0
    for n in seq_lens:
        q_s, k_s, v_s = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
        if window is not None and n > window:
            times = torch.arange(n, device=q.device)
            y = attention(q_s, k_s, v_s, causal_window_mask(times, times, None, window))
        else:
            y = attention(q_s, k_s, v_s, is_causal=True)
        outputs.append(y[0].transpose(0, 1))
        start += n
    return torch.cat(outputs)


@pytest.mark.parametrize("window, bf16", [(None, False), (None, True), (16, False)])
def test_cpu_packed_attention_groups_lengths_with_the_bits_of_one_call_per_sequence(window, bf16):
    """On the CPU packed_attention runs the sequences of one length as one batched SDPA call; the fused kernel computes
    each (sequence, head) alone, so output and gradients are bit-identical to one call per sequence (float32, and bf16
    inputs under autocast, where attention computes in float32), lengths repeated and not, one longer than the
    window, GQA 9/3 at SmolLM2's head size."""
    seq_lens, hs = [60, 58, 60, 71, 58, 60, 47, 1, 16, 17, 60], 64
    g = torch.Generator().manual_seed(7)
    dtype = torch.bfloat16 if bf16 else torch.float32
    inputs = [torch.randn(sum(seq_lens), h, hs, generator=g).to(dtype) for h in (9, 3, 3)]
    upstream = torch.randn(sum(seq_lens), 9, hs, generator=g)
    results = []
    for attend in (packed_attention, per_sequence_bf16):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = attend(*leaves, seq_lens, window)
        out.float().backward(upstream)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for name, got, want in zip(["out", "dq", "dk", "dv"], *results):
        assert got.dtype == want.dtype and torch.equal(got, want), name


@needs_cuda
@pytest.mark.parametrize("window", [None, 16])
def test_varlen_flash_attention_on_cuda_matches_the_float64_reference(window):
    """CUDA bf16 (varlen flash, GQA: 8 query heads over 2 kv heads) against the CPU per-sequence reference in float64
    on the same bf16-rounded inputs, forward and backward. The output: within flash's two bf16 roundings, of the
    probabilities before the product with v (<= 2^-8 sum_j p_j |v_j| <= 2^-8 max|v|) and of the output itself
    (<= 2^-8 max|v|). Output and gradients: no worse than twice the error of the reference in bf16 on the GPU
    (per-sequence SDPA)."""
    seq_lens, nh, nkv, hs = [37, 5, 128, 1, 70, 16], 8, 2, 64
    N = sum(seq_lens)
    g = torch.Generator().manual_seed(6)
    q, k, v, upstream = (torch.randn(N, h, hs, generator=g).bfloat16().double() for h in (nh, nkv, nkv, nh))
    truth_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    truth = packed_attention(*truth_inputs, seq_lens, window)  # CPU float64
    truth.backward(upstream)

    def run(attend):
        inputs = [t.cuda().bfloat16().requires_grad_() for t in (q, k, v)]
        out = attend(*inputs, seq_lens, window)
        out.backward(upstream.cuda().bfloat16())
        return [t.detach().double().cpu() for t in (out, *(x.grad for x in inputs))]

    varlen = run(packed_attention)
    reference = run(per_sequence_bf16)
    assert (varlen[0] - truth).abs().max() <= 2 * BF16_ROUNDING * v.abs().max()
    truths = [truth, *(t.grad for t in truth_inputs)]
    for name, got, ref, want in zip(["out", "dq", "dk", "dv"], varlen, reference, truths):
        err, ref_err = (got - want).abs().max().item(), (ref - want).abs().max().item()
        assert err <= 2 * ref_err, (name, err, ref_err)


@needs_cuda
def test_packed_model_on_cuda_bf16_no_worse_than_the_padded_forward():
    """A tiny OLMo 3 (head size 16, GQA, window 5) in bf16 on CUDA, packed (varlen flash) and padded, forward and
    backward: against float64 on the CPU, the packed error is within twice the padded one."""
    cfg = {**BASE, **CONFIGS["olmo3"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    truth_model = randomize(CausalLM(ModelArgs.from_hf_config(cfg))).double()
    seqs = sequences([37, 3, 64, 1, 9])
    flat, positions, seq_lens = packed_inputs(seqs)
    ids, mask = padded_inputs(seqs)
    weights = torch.randn(flat.numel(), 131, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def logits_and_grad(model, device, packed):
        """(logits at the real tokens [N, V], q_proj's gradient of layer 0), both float64 on the CPU."""
        model.zero_grad(set_to_none=True)
        if packed:
            logits = model(flat.to(device), packed=(positions.to(device), seq_lens))
        else:
            logits = model(ids.to(device), mask.to(device))[mask.to(device).bool()]
        (logits.double() * weights.to(device)).sum().backward()
        return logits.detach().double().cpu(), model.model.layers[0].self_attn.q_proj.weight.grad.double().cpu()

    want = logits_and_grad(truth_model, "cpu", packed=False)
    model = copy.deepcopy(truth_model).to("cuda", torch.bfloat16)
    packed = logits_and_grad(model, "cuda", packed=True)
    padded = logits_and_grad(model, "cuda", packed=False)
    for name, got, ref, truth in zip(["logits", "grad"], packed, padded, want):
        err, ref_err = (got - truth).abs().max().item(), (ref - truth).abs().max().item()
        assert err <= 2 * ref_err, (name, err, ref_err)
