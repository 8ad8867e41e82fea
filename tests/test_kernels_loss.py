"""Tests of ppo_kernels.linear_logprob_loss: any loss of the per-token log-probs, fused with the LM head.

    python -m pytest -q tests/test_kernels_loss.py

The kernel holds no loss formula: each test hands it a loss_fn(logp, entropy, rows) built from ppo_core.algo as
ppo_core.update.policy_objective builds it (`objective`: PPO with clip and dual clip under every aggregation, CISPO,
GSPO, + a KL term k1/k2/k3, - the entropy bonus) or a made-up one, and compares three results (`assert_no_worse`):
the kernel, linear_logprob_loss_reference (full logits, then autograd through loss_fn) in the inputs' dtype, and
that reference in float64, the truth. Forward (loss, stats, log-probs, entropies) and backward (dhidden, dweight).

  - torch path, float64: the reference is the truth, and the kernel must match it to 1e-13 of the largest entry
    (TOL64). What differs is the order of fp64 sums over up to V = 700 terms, which moves a sum by at most
    V 2^-53 = 8e-14 of its largest term (measured: 3e-15); a mistake in the chain rule shows at >= 1e-5 here.
  - Triton path (the interpreter without a GPU), float32: no worse than the float32 reference's own error against
    the truth, plus 1e-6 of the largest entry (TOL32): the two paths round differently (the reference's
    autograd sums dz @ W in fp32, the kernel in fp64 over 8192-column blocks; the log-sum-exps run in another
    order), each a few fp32 ulps (2^-24 = 6e-8 relative) per operation; 1e-6 is 16 ulps, what two such budgets may
    differ by. Stats within EPS32 = 1e-5 relative: they are formed from log-probs, held to 1e-5 on every fp32 path.

Chunks: the monkeypatched budgets (TORCH_LOSS_TILE_ELEMENTS / TRITON_LOSS_CHUNK_ELEMENTS) split the rows into
3+ chunks, and the results must equal the one-chunk ones and the truth; rows_separate=False gives one chunk; a
chunk over MAX_CHUNK_FACTOR budgets falls back to linear_token_logprobs + loss_fn on the whole batch.
"""
import os
from collections import namedtuple

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before ppo_kernels imports triton

import pytest
import torch

pytest.importorskip("ppo_core.algo")
import ppo_kernels  # noqa: E402
import ppo_kernels.loss as loss_module  # noqa: E402
from ppo_core import algo  # noqa: E402
from ppo_kernels.loss import (  # noqa: E402
    linear_logprob_loss_reference, linear_logprob_loss_torch, linear_logprob_loss_triton, row_chunks, token_tiles,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan warnings in the interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
AGG_MODES = algo.AGG_MODES
IMPLS = {"torch": linear_logprob_loss_torch, "triton": linear_logprob_loss_triton}
# the dtype each path is tested in, and its tolerance (module docstring)
DTYPES = {"torch": torch.float64, "triton": torch.float32}
TOL64, TOL32, EPS32 = 1e-13, 1e-6, 1e-5
BUDGETS = {"torch": "TORCH_LOSS_TILE_ELEMENTS", "triton": "TRITON_LOSS_CHUNK_ELEMENTS"}
# the interpreter runs a Python program per row and kernel: fewer rows there
SHAPES = {"torch": dict(B=4, T=29, H=24, V=700), "triton": dict(B=4, T=13, H=16, V=300)}
Out = namedtuple("Out", "loss stats logp entropy dhidden dweight")


def device_of(impl):
    return TRITON_DEVICE if impl == "triton" else "cpu"


def inputs(impl, seed, dtype=None, temperature=1.0):
    """head_batch at impl's shape, in its tested dtype (or dtype), on its device."""
    return head_batch(**SHAPES[impl], dtype=dtype or DTYPES[impl], device=device_of(impl), seed=seed,
                      temperature=temperature)


def split_rows(monkeypatch, impl, labels, V):
    """Set impl's chunk budget to one more token than the longest row keeps: chunks of 1-2 rows, 3+ of them.
    -> the budget in tokens."""
    budget = max(kept_per_row(labels)) + 1
    monkeypatch.setattr(loss_module, BUDGETS[impl], budget * V)
    assert len(row_chunks(kept_per_row(labels), budget)) >= 3
    return budget


def f64(t):
    """t in float64 on the CPU if it is a floating tensor, else t as it is."""
    return t.detach().cpu().double() if torch.is_tensor(t) and t.is_floating_point() else t


# ---------------------------------------------------------------------------------------------------- inputs
def head_batch(B=4, T=29, H=24, V=700, *, dtype=torch.float64, device="cpu", seed=0, temperature=1.0):
    """(hidden [B, T, H], weight [V, H], labels [B, T], tokens): tokens = (old_logp, advantages, mask, ref_logp),
    [B, T] each. Logits ~ N(0, 9). Labels: -100 on row 0's first 3 tokens (a prompt) and on ragged right padding
    (rows of different lengths, so chunks hold different token counts); mask 0 on three tokens of row 1 with real
    labels (their logits are formed, their gradient must be 0) and on all of row 2, if any (a row with no token
    in the loss). Old and reference log-probs near the policy's at `temperature`: log-ratios logp - old of
    N(0, 0.2^2) per token shifted by +0.25, +0.25, 0, -0.25 per row, advantages +1, -1, +1, -1 per row plus N(0, 1)
    per token: a PPO / CISPO clip of 0.2 clips some tokens and not others, and GSPO's sequence ratio s (clip 0.05)
    is clipped on row 0 (A > 0, s > 1.05) and row 3 (A < 0, s < 0.95), not on row 1 (A < 0, s > 1), 3 sigma off.
    Every tensor is made in float64 and cast to dtype: f64() of it is the same values, for the truth."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * (3 / H**0.5)
    labels = torch.randint(0, V, (B, T), generator=gen)
    lengths = T - torch.randint(0, T // 3, (B,), generator=gen)  # [B] tokens before the padding
    labels[torch.arange(T) >= lengths[:, None]] = -100
    labels[0, :3] = -100
    mask = (labels != -100).double()
    mask[1, 5:8] = 0
    if B > 2:
        mask[2] = 0
    logp = ppo_kernels.linear_token_logprobs_reference(hidden.to(dtype).double(), weight.to(dtype).double(),
                                                       labels, temperature=temperature)  # [B, T] what the kernel sees
    row_shift = torch.tensor([0.25, 0.25, 0.0, -0.25], dtype=torch.float64).repeat(B)[:B, None]  # [B, 1]
    row_sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(B)[:B, None]
    old_logp = logp - row_shift + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref_logp = logp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = row_sign + torch.randn(B, T, generator=gen, dtype=torch.float64)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(hidden), cast(weight), labels.to(device), tuple(map(cast, (old_logp, advantages, mask, ref_logp)))


def objective(kind, tokens, *, agg="token-mean", kl_coef=0.0, kl_kind="k3", entropy_coef=0.0, **settings):
    """loss_fn(logp, entropy, rows) as ppo_core.update.policy_objective builds it: algo.policy_loss_function(kind)
    with the batch's global num_tokens / num_seqs, + kl_coef * aggregate(kl_estimate(logp, ref)) (stat kl_loss),
    - entropy_coef * aggregate(entropy) (stat entropy). tokens: (old_logp, advantages, mask, ref_logp) [B, T]."""
    old_logp, advantages, mask, ref_logp = tokens
    policy_loss = algo.policy_loss_function(kind)
    agg = algo.Aggregation(agg, num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum())

    def loss_fn(logp, entropy, rows):
        m = mask[rows]
        loss, stats = policy_loss(logp, old_logp[rows], advantages[rows], m, agg=agg, **settings)
        if kl_coef:
            kl = algo.aggregate(algo.kl_estimate(logp, ref_logp[rows], kl_kind), m, agg)
            loss = loss + kl_coef * kl
            stats["kl_loss"] = kl.detach()
        if entropy_coef:
            loss = loss - entropy_coef * algo.aggregate(entropy, m, agg)
            stats["entropy"] = algo.masked_mean(entropy.detach(), m)
        return loss, stats
    return loss_fn


def made_up_loss(tokens, *, entropy=True, **_):
    """A loss no kernel has heard of: sum over the loss's tokens of logp^2 + 0.5 sin(H) logp, over the global token
    count (so it splits over rows). Its gradient to H is sin's derivative times logp: not a PPO term."""
    mask = tokens[2]
    num_tokens = mask.sum()

    def loss_fn(logp, entropy_rows, rows):
        per_token = logp ** 2
        if entropy:
            per_token = per_token + 0.5 * torch.sin(entropy_rows) * logp
        loss = (per_token * mask[rows]).sum() / num_tokens
        return loss, {"logp_sq": algo.masked_mean(logp.detach() ** 2, mask[rows])}
    return loss_fn


def coupled_loss(tokens, **_):
    """A loss that couples rows: (mean over all the loss's tokens of logp)^2. Correct only on every row at once."""
    mask = tokens[2]

    def loss_fn(logp, entropy, rows):
        mean = (logp * mask[rows]).sum() / mask.sum()
        return mean ** 2, {"mean_logp": mean.detach()}
    return loss_fn


# config: (loss builder, its arguments, need_entropy, temperature)
CONFIGS = {
    "ppo-token-mean-T0.7": (objective, dict(kind="ppo", clip_low=0.2, clip_high=0.28), False, 0.7),
    "ppo-dual-clip-seq-mean-token-mean": (objective, dict(kind="ppo", dual_clip=3.0, agg="seq-mean-token-mean"),
                                          False, 1.0),
    "ppo-seq-mean-token-sum": (objective, dict(kind="ppo", agg="seq-mean-token-sum"), False, 1.0),
    "ppo-seq-mean-token-sum-norm-T1.3": (objective, dict(kind="ppo", agg="seq-mean-token-sum-norm"), False, 1.3),
    "cispo-no-lower-clip": (objective, dict(kind="cispo", clip_low=10.0, clip_high=0.28), False, 1.0),
    "cispo-k2": (objective, dict(kind="cispo", agg="seq-mean-token-mean", kl_coef=0.1, kl_kind="k2"), False, 0.7),
    "gspo": (objective, dict(kind="gspo", clip_low=0.05, clip_high=0.05), False, 1.0),
    "ppo-k1-entropy": (objective, dict(kind="ppo", kl_coef=0.1, kl_kind="k1", entropy_coef=0.3), True, 0.7),
    "ppo-dual-clip-k3-entropy": (objective, dict(kind="ppo", dual_clip=3.0, agg="seq-mean-token-mean", kl_coef=0.1,
                                                 kl_kind="k3", entropy_coef=0.05), True, 1.3),
    "cispo-k3-entropy": (objective, dict(kind="cispo", agg="seq-mean-token-sum-norm", kl_coef=0.05, kl_kind="k3",
                                         entropy_coef=0.3), True, 1.0),
    "gspo-entropy": (objective, dict(kind="gspo", clip_low=0.05, clip_high=0.05, agg="seq-mean-token-mean",
                                     entropy_coef=0.3), True, 1.0),
    "made-up": (made_up_loss, dict(), True, 0.7),
}


def config_loss(name, tokens):
    builder, kwargs, need_entropy, temperature = CONFIGS[name]
    kwargs = dict(kwargs)
    if builder is objective:
        return objective(kwargs.pop("kind"), tokens, **kwargs), need_entropy, temperature
    return builder(tokens, entropy=need_entropy), need_entropy, temperature


# ---------------------------------------------------------------------------------------------------- running
def run(fn, hidden, weight, labels, loss_fn, *, grad=(True, True), **kwargs):
    """fn(hidden, weight, labels, loss_fn, **kwargs) on fresh leaves, then backward. -> Out (stats as floats)."""
    h = hidden.detach().clone().requires_grad_(grad[0])
    w = weight.detach().clone().requires_grad_(grad[1])
    loss, stats, logp, entropy = fn(h, w, labels, loss_fn, **kwargs)
    if loss.requires_grad:
        loss.backward()
    return Out(loss.detach(), {k: v.item() for k, v in stats.items()}, logp, entropy, h.grad, w.grad)


def truth_and_reference(hidden, weight, labels, tokens, make_loss, **kwargs):
    """The reference path in float64 (the truth) and in the inputs' dtype; make_loss(tokens) -> loss_fn."""
    truth = run(linear_logprob_loss_reference, f64(hidden), f64(weight), labels.cpu(),
                make_loss(tuple(map(f64, tokens))), **kwargs)
    return truth, run(linear_logprob_loss_reference, hidden, weight, labels, make_loss(tokens), **kwargs)


def max_err(got, want):
    got = got.detach().cpu().double()
    assert not torch.isnan(got).any(), "NaN"
    return (got - want.detach().cpu().double()).abs().max().item() if got.numel() else 0.0


def assert_no_worse(got, reference, truth, tol, stats_tol=None):
    """Every tensor of `got` no further from `truth` than `reference` is, plus tol of the truth's largest entry;
    the stats within stats_tol (default: tol) relative. For float64 pass the truth as the reference."""
    stats_tol = tol if stats_tol is None else stats_tol
    for name in ("loss", "logp", "entropy", "dhidden", "dweight"):
        k, r, t = getattr(got, name), getattr(reference, name), getattr(truth, name)
        if t is None:
            assert k is None, name
            continue
        scale = max(1.0, t.abs().max().item())
        err_kernel, err_reference = max_err(k, t), max_err(r, t)
        assert err_kernel <= err_reference + tol * scale, (name, err_kernel, err_reference)
    assert set(got.stats) == set(truth.stats), (set(got.stats), set(truth.stats))
    for key, want in truth.stats.items():
        assert abs(got.stats[key] - want) <= stats_tol * max(1.0, abs(want)), (key, got.stats[key], want)


def assert_same(a, b, tol):
    """Two runs of the kernel agree to tol of the largest entry (tol=0: bitwise)."""
    for name in ("loss", "logp", "entropy", "dhidden", "dweight"):
        x, y = getattr(a, name), getattr(b, name)
        if y is None:
            assert x is None, name
            continue
        if tol == 0:
            assert torch.equal(x, y), name
        else:
            assert max_err(x, y) <= tol * max(1.0, y.abs().max().item()), (name, max_err(x, y))
    assert set(a.stats) == set(b.stats)
    for key in b.stats:
        assert (a.stats[key] == b.stats[key]) if tol == 0 else abs(a.stats[key] - b.stats[key]) <= tol * max(
            1.0, abs(b.stats[key])), key


def spy(loss_fn, seen):
    """loss_fn that records (rows, logp's shape, whether it requires grad, entropy is None) of each call."""
    def recorded(logp, entropy, rows):
        seen.append((rows, tuple(logp.shape), logp.requires_grad, entropy is None))
        return loss_fn(logp, entropy, rows)
    return recorded


def kept_per_row(labels):
    return (labels != -100).sum(-1).tolist()


# ---------------------------------------------------------------------------------------------------- row_chunks
@pytest.mark.parametrize("kept, budget, rows_separate, chunks", [
    ([3, 2, 4, 1], 5, True, [(0, 2), (2, 4)]),  # 3 + 2 fills 5; 4 + 1 fills the next
    ([5, 5, 5], 5, True, [(0, 1), (1, 2), (2, 3)]),  # each row fills a chunk exactly
    ([2, 3], 5, True, [(0, 2)]),  # all in one
    ([7, 1, 1], 5, True, [(0, 1), (1, 3)]),  # a row over the budget is a chunk of its own
    ([1, 7, 1], 5, True, [(0, 1), (1, 2), (2, 3)]),
    ([0, 0, 6, 0], 5, True, [(0, 2), (2, 4)]),  # empty rows ride along with the chunk they fall in
    ([2, 2, 2, 2, 2], 8, True, [(0, 3), (3, 5)]),  # balanced: 2 chunks needed, closed at the even share 5 (not 8 + 2)
    ([128] * 16, 682, True, [(0, 4), (4, 8), (8, 12), (12, 16)]),  # 2048 tokens: 4 chunks of 512, not 5 + 5 + 5 + 1
    ([0, 0], 5, True, [(0, 2)]),
    ([3, 2, 4, 1], 5, False, [(0, 4)]),  # coupled rows: one chunk whatever the budget
    ([], 5, True, [(0, 0)]),  # at least one chunk
    ([], 5, False, [(0, 0)]),
])
def test_row_chunks_hand_worked(kept, budget, rows_separate, chunks):
    assert row_chunks(kept, budget, rows_separate) == chunks


# ---------------------------------------------------------------------------------------------------- the losses
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_reference_in_chunks_and_in_one(impl, config, monkeypatch, poisoned_empty):
    # The kernel in 3+ chunks of rows and in one chunk, against the reference and the float64 truth: loss, stats,
    # log-probs, entropies, dhidden, dweight; the loss_fn sees each chunk's rows alone, then every row for the stats.
    dtype = DTYPES[impl]
    _, _, need_entropy, temperature = CONFIGS[config]
    hidden, weight, labels, tokens = inputs(impl, seed=0, temperature=temperature)
    make_loss = lambda toks: config_loss(config, toks)[0]  # noqa: E731
    kwargs = dict(temperature=temperature, need_entropy=need_entropy)
    truth, reference = truth_and_reference(hidden, weight, labels, tokens, make_loss, **kwargs)
    tol = TOL64 if dtype == torch.float64 else TOL32
    stats_tol = TOL64 if dtype == torch.float64 else EPS32
    if dtype == torch.float64:
        reference = truth

    one_chunk_calls, calls = [], []
    one_chunk = run(IMPLS[impl], hidden, weight, labels, spy(make_loss(tokens), one_chunk_calls), **kwargs)
    assert [c[0] for c in one_chunk_calls] == [slice(0, 4)]  # the default budget holds the batch
    budget = split_rows(monkeypatch, impl, labels, weight.shape[0])
    chunked = run(IMPLS[impl], hidden, weight, labels, spy(make_loss(tokens), calls), **kwargs)
    chunks = row_chunks(kept_per_row(labels), budget)
    assert len(chunks) >= 3
    assert [c[0] for c in calls] == [slice(s0, s1) for s0, s1 in chunks] + [slice(None)]  # + the stats' call
    assert all(shape == (s1 - s0, labels.shape[1]) and requires_grad and no_entropy != need_entropy
               for (shape, requires_grad, no_entropy), (s0, s1) in zip((c[1:] for c in calls), chunks))

    for got in (one_chunk, chunked):
        assert_no_worse(got, reference, truth, tol, stats_tol)
        assert got.loss.dtype == dtype and got.logp.dtype == dtype and got.dhidden.dtype == dtype
        in_loss = (labels != -100) & (tokens[2] != 0)
        assert (got.dhidden[~in_loss] == 0).all() and (got.logp[labels == -100] == 0).all()
    assert_same(chunked, one_chunk, tol)
    # not vacuous: gradients reach hidden and weight; a clipped loss clips some tokens (or rows) and not others
    assert truth.dhidden.abs().max() > 1e-3 and truth.dweight.abs().max() > 1e-3
    if "clipfrac" in truth.stats:
        assert 0 < truth.stats["clipfrac"] < 1, truth.stats
    if need_entropy:  # the entropy's share of the gradients is far above the tolerance
        builder, loss_kwargs, _, _ = CONFIGS[config]
        if builder is objective:
            loss_kwargs = dict(loss_kwargs, entropy_coef=0.0)
            no_h = objective(loss_kwargs.pop("kind"), tuple(map(f64, tokens)), **loss_kwargs)
        else:
            no_h = builder(tuple(map(f64, tokens)), entropy=False)
        without = run(linear_logprob_loss_reference, f64(hidden), f64(weight), labels.cpu(), no_h,
                      temperature=temperature, need_entropy=True)
        for name in ("dhidden", "dweight"):
            assert max_err(getattr(without, name), getattr(truth, name)) > 100 * tol, name


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_rows_separate_false_is_one_chunk_for_a_loss_that_couples_rows(impl, monkeypatch, poisoned_empty):
    # (mean logp)^2 over the whole batch: chunked by rows it would be a sum of squares, not a square. With
    # rows_separate=False the loss sees every row at once, under a budget that would make 3+ chunks of them (the
    # batch's tokens are within MAX_CHUNK_FACTOR budgets: no fallback).
    dtype = DTYPES[impl]
    hidden, weight, labels, tokens = inputs(impl, seed=1)
    split_rows(monkeypatch, impl, labels, weight.shape[0])
    truth, reference = truth_and_reference(hidden, weight, labels, tokens, coupled_loss, temperature=0.7)
    if dtype == torch.float64:
        reference = truth
    calls = []
    got = run(IMPLS[impl], hidden, weight, labels, spy(coupled_loss(tokens), calls), temperature=0.7,
              rows_separate=False)
    assert [c[0] for c in calls] == [slice(0, 4)]  # one chunk of every row: no fallback, no stats' call
    assert_no_worse(got, reference, truth, TOL64 if dtype == torch.float64 else TOL32)
    wrong = run(IMPLS[impl], hidden, weight, labels, coupled_loss(tokens), temperature=0.7)  # rows_separate=True
    # the flag is what makes it right: chunked, each chunk's gradient is that of its own (mean logp)^2 (the value is
    # the whole batch's either way: it comes from one more call on every row)
    gap = (wrong.dhidden.double().cpu() - truth.dhidden).abs().max().item()
    assert gap > 1e-3 * truth.dhidden.abs().max().item()


@pytest.mark.parametrize("kept, budget, bounds, rows", [
    ([3, 2, 4, 1], 5, [(0, 5), (5, 10)], [(0, 2), (2, 4)]),  # 10 tokens, 2 tiles of 5: the rows they lie in
    ([3, 2, 4, 1], 4, [(0, 4), (4, 8), (8, 10)], [(0, 2), (1, 3), (2, 4)]),  # ceil(10 / 4) = 3 tiles of <= 4, across rows
    ([7, 0, 0], 4, [(0, 4), (4, 7)], [(0, 1), (0, 1)]),  # one long row in two tiles
    ([128] * 16, 220, [(r0, r0 + 205) for r0 in range(0, 1845, 205)] + [(1845, 2048)],
     [(r0 // 128, (r0 + 204) // 128 + 1) for r0 in range(0, 1845, 205)] + [(14, 16)]),  # 10 tiles, not 16 rows
    ([0, 0], 5, [(0, 0)], [(0, 2)]),  # no token: one empty tile over every row
])
def test_token_tiles_hand_worked(kept, budget, bounds, rows):
    assert token_tiles(kept, budget, 0) == (bounds, rows)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("config", ["ppo-dual-clip-k3-entropy", "cispo-k2", "ppo-seq-mean-token-sum-norm-T1.3",
                                    "made-up"])
def test_token_level_losses_in_tiles_across_rows(impl, config, monkeypatch, poisoned_empty):
    # tokens_separate=True: tiles of a few tokens that cut rows in two, each loss call seeing placeholders (0) on its
    # rows' other tokens; the loss, stats, dhidden and dweight equal the reference's (and the float64 truth)
    dtype = DTYPES[impl]
    _, _, need_entropy, temperature = CONFIGS[config]
    hidden, weight, labels, tokens = inputs(impl, seed=3, temperature=temperature)
    make_loss = lambda toks: config_loss(config, toks)[0]  # noqa: E731
    kwargs = dict(temperature=temperature, need_entropy=need_entropy)
    truth, reference = truth_and_reference(hidden, weight, labels, tokens, make_loss, **kwargs)
    if dtype == torch.float64:
        reference = truth
    budget = 7  # tokens per tile: rows of ~20-29 kept tokens are cut into several tiles each
    monkeypatch.setattr(loss_module, BUDGETS[impl], budget * weight.shape[0])
    calls = []
    got = run(IMPLS[impl], hidden, weight, labels, spy(make_loss(tokens), calls), tokens_separate=True, **kwargs)
    bounds, rows = token_tiles(kept_per_row(labels), budget, labels.shape[1])
    assert len(bounds) >= 5 and any(s1 - s0 > 1 for s0, s1 in rows)  # tiles that span two rows
    assert [c[0] for c in calls] == [slice(s0, s1) for s0, s1 in rows] + [slice(None)]  # then the value's call
    assert_no_worse(got, reference, truth, TOL64 if dtype == torch.float64 else TOL32)


def test_a_row_level_loss_needs_whole_rows():
    # GSPO's sequence ratio reads every token of its row: in tiles across rows (tokens_separate=True, wrongly) its
    # gradient is wrong; in chunks of whole rows it is right. The flag is what the kind's coupling sets.
    hidden, weight, labels, tokens = inputs("torch", seed=3)
    make_loss = lambda toks: config_loss("gspo", toks)[0]  # noqa: E731
    truth, _ = truth_and_reference(hidden, weight, labels, tokens, make_loss)
    assert algo.loss_coupling("gspo") == "row" and algo.loss_coupling("ppo") == "token"
    budget = 7
    loss_module_budget = budget * weight.shape[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_module, BUDGETS["torch"], loss_module_budget)
        wrong = run(IMPLS["torch"], hidden, weight, labels, make_loss(tokens), tokens_separate=True)
        right = run(IMPLS["torch"], hidden, weight, labels, make_loss(tokens))
    assert (right.dhidden - truth.dhidden).abs().max().item() <= TOL64 * truth.dhidden.abs().max().item()
    assert (wrong.dhidden - truth.dhidden).abs().max().item() > 1e-3 * truth.dhidden.abs().max().item()


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("trigger", ["factor-0", "long-row", "coupled-batch"])
def test_fallback_when_a_chunk_is_too_large(impl, trigger, monkeypatch, poisoned_empty):
    # A chunk over MAX_CHUNK_FACTOR budgets: linear_token_logprobs (its own recomputing backward), then loss_fn on the
    # whole batch. Triggered by a factor of 0 (any chunk), by a budget of 1 token against rows of 7+ (4 x 1 < 7), and
    # by rows_separate=False with the batch's tokens over 4 budgets.
    dtype = DTYPES[impl]
    hidden, weight, labels, tokens = inputs(impl, seed=2)
    V, kept = weight.shape[0], kept_per_row(labels)
    rows_separate = trigger != "coupled-batch"
    if trigger == "factor-0":
        monkeypatch.setattr(loss_module, "MAX_CHUNK_FACTOR", 0)
    elif trigger == "long-row":
        assert max(kept) > loss_module.MAX_CHUNK_FACTOR
        monkeypatch.setattr(loss_module, BUDGETS[impl], 1 * V)
    else:
        monkeypatch.setattr(loss_module, BUDGETS[impl], sum(kept) // 8 * V)
    fallbacks, real = [], loss_module._linear._linear_token_logprobs
    monkeypatch.setattr(loss_module._linear, "_linear_token_logprobs", lambda *a: fallbacks.append(a[-1]) or real(*a))
    make_loss = lambda toks: objective("ppo", toks, dual_clip=3.0, agg="seq-mean-token-mean", kl_coef=0.1,  # noqa
                                       entropy_coef=0.05)
    kwargs = dict(temperature=0.7, need_entropy=True)
    truth, reference = truth_and_reference(hidden, weight, labels, tokens, make_loss, **kwargs)
    if dtype == torch.float64:
        reference = truth
    calls = []
    got = run(IMPLS[impl], hidden, weight, labels, spy(make_loss(tokens), calls), rows_separate=rows_separate,
              **kwargs)
    assert fallbacks == [impl] and [c[0] for c in calls] == [slice(None)]
    assert_no_worse(got, reference, truth, TOL64 if dtype == torch.float64 else TOL32,
                    TOL64 if dtype == torch.float64 else EPS32)
    assert not got.logp.requires_grad and not got.entropy.requires_grad


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("empty", ["mask", "labels"])
def test_fully_masked_batch_is_zero_not_nan(impl, empty, monkeypatch):
    # mask 0 everywhere (the logits are formed, every token's gradient is 0), or every label -100 (no row is
    # projected; what a process short of rows runs under DDP): loss 0, gradients exactly 0, stats 0, no NaN;
    # in one chunk and in several
    hidden, weight, labels, tokens = inputs(impl, seed=3)
    old_logp, advantages, mask, ref_logp = tokens
    if empty == "labels":
        labels = torch.full_like(labels, -100)
    tokens = (old_logp, advantages, torch.zeros_like(mask), ref_logp)
    for split in (False, True):
        if split:
            monkeypatch.setattr(loss_module, BUDGETS[impl], 5 * weight.shape[0])
        for kind, agg in (("ppo", "token-mean"), ("ppo", "seq-mean-token-mean"), ("cispo", "seq-mean-token-sum"),
                          ("gspo", "token-mean")):
            loss_fn = objective(kind, tokens, agg=agg, kl_coef=0.1, entropy_coef=0.3)
            got = run(IMPLS[impl], hidden, weight, labels, loss_fn, temperature=0.7, need_entropy=True)
            assert got.loss.item() == 0.0, (kind, agg, got.loss)
            assert (got.dhidden == 0).all() and (got.dweight == 0).all()
            assert all(v == 0.0 for v in got.stats.values()), got.stats
            assert not got.logp.isnan().any() and not got.entropy.isnan().any()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_frozen_head_frozen_hidden_and_the_incoming_gradient(impl, monkeypatch):
    # weight.requires_grad False (a frozen LM head): dhidden alone, bitwise what it is with both; hidden frozen:
    # dweight alone, the same; neither: a loss without grad. The backward scales the gradients formed in the
    # forward by the incoming one: 3 * loss gives 3 * the gradients, the same single rounding either way.
    hidden, weight, labels, tokens = inputs(impl, seed=4)
    split_rows(monkeypatch, impl, labels, weight.shape[0])
    loss_fn = objective("ppo", tokens, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.05)
    kwargs = dict(temperature=0.7, need_entropy=True)
    both = run(IMPLS[impl], hidden, weight, labels, loss_fn, **kwargs)
    frozen_head = run(IMPLS[impl], hidden, weight, labels, loss_fn, grad=(True, False), **kwargs)
    frozen_hidden = run(IMPLS[impl], hidden, weight, labels, loss_fn, grad=(False, True), **kwargs)
    assert frozen_head.dweight is None and torch.equal(frozen_head.dhidden, both.dhidden)
    assert frozen_hidden.dhidden is None and torch.equal(frozen_hidden.dweight, both.dweight)
    for out in (frozen_head, frozen_hidden):
        assert torch.equal(out.loss, both.loss) and out.stats == both.stats
    loss, stats, logp, _ = IMPLS[impl](hidden, weight, labels, loss_fn, **kwargs)
    assert not loss.requires_grad and torch.equal(loss, both.loss) and torch.equal(logp, both.logp)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (3 * IMPLS[impl](h, w, labels, loss_fn, **kwargs)[0]).backward()
    assert torch.equal(h.grad, 3 * both.dhidden) and torch.equal(w.grad, 3 * both.dweight)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_hidden_as_the_trainer_slices_it(impl, monkeypatch):
    # The trainer hands the head the response positions of whole sequences, [B, P + T, H][:, P - 1 : -1]: a strided
    # view. The result is bitwise that of a contiguous copy, and the gradient reaches the full tensor, 0 elsewhere.
    hidden, weight, labels, tokens = inputs(impl, seed=9)
    split_rows(monkeypatch, impl, labels, weight.shape[0])
    loss_fn = objective("ppo", tokens, entropy_coef=0.05)
    contiguous = run(IMPLS[impl], hidden, weight, labels, loss_fn, need_entropy=True)
    B, T, H = hidden.shape
    P = 3  # prompt length
    full = torch.zeros(B, P + T, H, dtype=hidden.dtype, device=hidden.device)
    full[:, P - 1:-1] = hidden
    full.requires_grad_()
    w = weight.clone().requires_grad_()
    loss, stats, logp, _ = IMPLS[impl](full[:, P - 1:-1], w, labels, loss_fn, need_entropy=True)
    loss.backward()
    assert torch.equal(loss.detach(), contiguous.loss) and torch.equal(logp, contiguous.logp)
    assert torch.equal(full.grad[:, P - 1:-1], contiguous.dhidden) and torch.equal(w.grad, contiguous.dweight)
    assert (full.grad[:, :P - 1] == 0).all() and (full.grad[:, -1] == 0).all()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bitwise_deterministic(impl, monkeypatch):
    hidden, weight, labels, tokens = inputs(impl, seed=5, dtype=torch.float32)
    split_rows(monkeypatch, impl, labels, weight.shape[0])
    loss_fn = objective("ppo", tokens, dual_clip=3.0, agg="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.05)
    a, b = (run(IMPLS[impl], hidden, weight, labels, loss_fn, temperature=0.7, need_entropy=True) for _ in range(2))
    assert_same(a, b, 0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_label_outside_vocabulary_and_shapes_raise(impl):
    hidden, weight, labels, tokens = head_batch(B=2, T=10, H=16, V=100, dtype=DTYPES[impl], device=device_of(impl))
    loss_fn = objective("ppo", tokens)
    for bad in (100, -1):
        bad_labels = labels.clone()
        bad_labels[1, 4] = bad
        for fn in (IMPLS[impl], linear_logprob_loss_reference):
            with pytest.raises(ValueError, match=f"label {bad} is outside"):
                fn(hidden, weight, bad_labels, loss_fn)
    for args, match in (((hidden.flatten(0, 1), weight, labels.flatten()), "hidden"),  # tokens flat: [N, H]
                        ((hidden, weight, labels[:, :-1]), "disagree"),
                        ((hidden, weight[:, :-1], labels), "disagree")):
        with pytest.raises(ValueError, match=match):
            IMPLS[impl](*args, loss_fn)
    with pytest.raises(ValueError, match="temperature"):
        IMPLS[impl](hidden, weight, labels, loss_fn, temperature=0.0)


@pytest.mark.parametrize("impl", ["torch", "triton", "dispatch"])
def test_autocast_and_mixed_dtypes(impl, monkeypatch):
    # Under autocast, fp32 hidden / weight are cast to the autocast dtype: the result is that of an explicit bf16
    # cast, and the gradients reach the fp32 tensors in fp32, straight from the fp32 accumulators: rounded to bf16
    # they are the explicit call's gradients (which autograd rounded to bf16 on the way back through the cast).
    # A weight of another dtype than hidden is cast to hidden's; a weight whose last dim is not contiguous is made so.
    fn = {"torch": linear_logprob_loss_torch, "triton": linear_logprob_loss_triton,
          "dispatch": ppo_kernels.linear_logprob_loss}[impl]
    device = device_of(impl)
    hidden, weight, labels, tokens = head_batch(B=2, T=24, H=32, V=300, dtype=torch.float32, device=device, seed=6)
    loss_fn = objective("ppo", tokens, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.05)

    def call(cast_hidden, cast_weight, autocast=False, weight_leaf=weight):
        h, w = hidden.clone().requires_grad_(), weight_leaf.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss, stats, logp, entropy = fn(cast_hidden(h), cast_weight(w), labels, loss_fn, temperature=0.7,
                                            need_entropy=True)
        loss.backward()
        return loss, logp, entropy, h.grad, w.grad

    # several chunks: the torch path's bf16 GEMMs round each chunk's dW product to bf16, their sum is fp32
    monkeypatch.setattr(loss_module, "TORCH_LOSS_TILE_ELEMENTS", 10 * 300)
    keep, bf16 = (lambda t: t), (lambda t: t.to(torch.bfloat16))
    explicit = call(bf16, bf16)
    for got in (call(keep, keep, autocast=True),  # fp32 master weights under autocast
                call(bf16, keep),  # bf16 hidden, fp32 weight
                call(bf16, lambda w: w.T.contiguous().T, weight_leaf=weight.T.contiguous().T)):  # last dim strided
        assert all(torch.equal(g, e) for g, e in zip(got[:3], explicit[:3]))  # loss, logp, entropy
        assert got[0].dtype == got[1].dtype == torch.float32
        assert got[3].dtype == torch.float32 and got[4].dtype == torch.float32
        assert torch.equal(got[3].to(torch.bfloat16).float(), explicit[3])
        assert torch.equal(got[4].to(torch.bfloat16).float(), explicit[4])
    assert not torch.equal(got[4], explicit[4])  # fp32 weight: its gradient was not rounded to bf16


@pytest.mark.parametrize("config", ["ppo-dual-clip-k3-entropy", "made-up"])
def test_triton_bf16_operands_in_chunks(config, monkeypatch, poisoned_empty):
    # bf16 hidden / weight on the Triton path, in 3+ chunks: the logits are fp32 GEMM outputs of the bf16 values,
    # so the log-probs are those of the float64 truth on the same bf16 operands to fp32 accuracy (EPS32); under the
    # interpreter dz stays fp32 too, and dhidden / dweight leave fp32 accumulators rounded once to bf16: within half
    # a bf16 ulp (2^-9 relative; 2^-8 allowed) of the truth, plus the fp32 path's own error (TOL32 of the largest).
    hidden, weight, labels, tokens = inputs("triton", seed=7)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    split_rows(monkeypatch, "triton", labels, weight.shape[0])
    make_loss = lambda toks: config_loss(config, toks)[0]  # noqa: E731
    _, need_entropy, temperature = config_loss(config, tokens)
    kwargs = dict(temperature=temperature, need_entropy=need_entropy)
    truth, reference = truth_and_reference(hidden, weight, labels, tokens, make_loss, **kwargs)
    got = run(linear_logprob_loss_triton, hidden, weight, labels, make_loss(tokens), **kwargs)
    assert got.dhidden.dtype == got.dweight.dtype == torch.bfloat16 and got.logp.dtype == torch.float32
    assert max_err(got.logp, truth.logp) <= EPS32 and max_err(got.entropy, truth.entropy) <= EPS32
    for name in ("loss", "dhidden", "dweight"):
        k, r, t = getattr(got, name), getattr(reference, name), getattr(truth, name)
        scale = max(1.0, t.abs().max().item())
        assert max_err(k, t) <= max_err(r, t) + TOL32 * scale, name  # no worse than bf16 eager
        if INTERPRET:
            err = (k.double().cpu() - t).abs()
            assert (err <= 2**-8 * t.abs() + TOL32 * scale).all(), (name, err.max().item())


def test_gradcheck_float64(monkeypatch):
    # The chain rule from the loss's per-token gradient (dloss/dlogp, dloss/dH) through the temperature to hidden and
    # weight, against finite differences (independent of the reference): a smooth made-up loss reading both, in 2
    # chunks of rows, with a prompt token out of the loss.
    hidden, weight, labels, tokens = head_batch(B=2, T=4, H=5, V=7, seed=8)
    labels[0, 0] = -100
    loss_fn = made_up_loss(tokens)
    monkeypatch.setattr(loss_module, "TORCH_LOSS_TILE_ELEMENTS", 4 * 7)  # a chunk per row
    assert torch.autograd.gradcheck(
        lambda h, w: linear_logprob_loss_torch(h, w, labels, loss_fn, temperature=0.7, need_entropy=True)[0],
        (hidden.clone().requires_grad_(), weight.clone().requires_grad_()))
