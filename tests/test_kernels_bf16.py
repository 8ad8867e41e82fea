"""The fused heads' chunked torch paths (what CPU tensors run) on bf16 operands, against float64.

    python -m pytest -q tests/test_kernels_bf16.py

linear_token_logprobs and linear_logprob_loss (with ppo_core.algo's PPO loss) take bf16 hidden / weight in two ways,
both checked here:
(a) plain bf16 tensors, (b) fp32 tensors (the trainer's fp32 master weights) under torch.autocast("cpu", bf16),
which the heads cast to bf16 themselves. Either way the matmuls run in bf16 (test_matmuls_run_in_bf16_and_...) and
everything else in fp32: max, sum-exp, log-probs, entropy, the loss and its per-token gradient.

The truth is the float64 reference on the same bf16 operands (hidden.double(), weight.double()): the products
h_k w_k of bf16 values are exact, so what remains is the path's own rounding, and the tolerances below are that
rounding's bound, worked out per element from float64 quantities (no global fudge factor):

  logits  z~ = fl_bf16(fl_fp32(h . w)) / T: the GEMM accumulates the H exact products in fp32
          (|err| <= H 2^-24 sum_k |h_k w_k|), then rounds its output to bf16 (|err| <= u |z|, u = 2^-8, bf16's
          unit roundoff: 8 significant bits), so  |z~_v - z_v| <= delta_v = u |z_v| + (H + 4) 2^-24 A_v,
          A_v = sum_k |h_k w_vk| / T  (the + 4 covers the fp32 division by T and the widening).
  log-probs  logsumexp is 1-Lipschitz and d lse / dz_v = p_v: |d lse| <= e^(2 dmax) sum_v p_v delta_v
          (dmax = max_v delta_v; e^(2 dmax) bounds how much p moves across the perturbation), and
          |d logp| <= delta_label + |d lse|.
  entropy  dH/dz_v = -p_v (log p_v + H):  |dH| <= e^(2 dmax) sum_v p_v (|log p_v + H| + 4 dmax) delta_v.
  both get + EPS32 (1e-5): the fp32 statistics' own rounding, the tolerance of the fp32 paths' tests.
  gradients  dz (= dloss / d(h W^T), 1/T included) moves with p and, in the loss, with g = dloss/dlogp:
          |d p_v| <= e^(2 dmax) p_v (delta_v + sum p delta); then dz is rounded to bf16 for the GEMMs (u |dz|),
          each GEMM output is rounded to bf16 (u (1 + u) |dz| @ |W| summed over the tiles) after an fp32
          accumulation over at most K terms and the tiles (K + 2) 2^-24 |dz| @ |W|), and bf16 results are rounded
          once more on the way out (u |dhidden~|), so with E the bound on |d dz|:
          |d dhidden| <= E @ |W| + (2u + u^2 + (K + 2) 2^-24) (|dz| + E) @ |W|  [+ u |dhidden~|],
          and the same for dweight = dz.T @ hidden with |hidden|.
These are worst-case bounds (every rounding at its maximum, all of one sign); the errors measured here reach
20-70% of them, and test_fp32_statistics shows that they are tight enough to fail a path with bf16 statistics.
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("ppo_core.algo")
import ppo_kernels.linear_logprobs as linear_module  # noqa: E402
import ppo_kernels.loss as loss_module  # noqa: E402
from ppo_kernels.linear_logprobs import linear_token_logprobs_torch  # noqa: E402
from ppo_kernels.logprobs import token_logprobs_reference, token_logprobs_torch  # noqa: E402
from ppo_core import algo  # noqa: E402
from ppo_kernels.loss import linear_logprob_loss_reference, linear_logprob_loss_torch  # noqa: E402
from test_kernels_loss import objective  # noqa: E402  the loss as ppo_core.update.policy_objective builds it

U = 2.0 ** -8  # bf16 unit roundoff (round to nearest, 8 significant bits)
F32 = 2.0 ** -24  # fp32 unit roundoff
EPS32 = 1e-5  # the fp32 statistics' rounding: what tests/test_kernels_linear.py holds the fp32 path to
MODES = ["bf16", "autocast"]  # (a) plain bf16 tensors, (b) fp32 tensors under CPU bf16 autocast


def bf16_head(N, H, V, logit_scale, seed):
    """hidden [N, H] and weight [V, H] in bf16, logits ~ N(0, logit_scale^2)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).bfloat16()
    weight = (torch.randn(V, H, generator=gen) * (logit_scale / H**0.5)).bfloat16()
    return hidden, weight


def leaves(hidden, weight, mode):
    """The tensors the caller differentiates: bf16 as they are, or their exact fp32 copies for autocast."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()


def autocast_if(mode):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")


class Truth:
    """float64 logits, probabilities, log-probs and entropy of the bf16 operands, and the rounding bounds above."""

    def __init__(self, hidden, weight, labels, temperature):
        h, w = hidden.double(), weight.double()
        self.h, self.w, self.T = h, w, temperature
        self.valid = labels != -100
        self.labels = labels.masked_fill(~self.valid, 0)
        z = h @ w.T / temperature  # [N, V]
        self.logp_all = torch.log_softmax(z, -1)
        self.p = self.logp_all.exp()
        self.entropy = -(self.p * self.logp_all).sum(-1)  # [N]
        self.logp = self.logp_all.gather(1, self.labels[:, None]).squeeze(1)  # [N]
        A = h.abs() @ w.abs().T / temperature
        self.delta = U * z.abs() + (h.shape[1] + 4) * F32 * A  # [N, V] bound on |z~ - z|
        dmax = self.delta.max(1).values
        self.grow = torch.exp(2 * dmax)  # [N] how far p can move across the perturbation
        self.lse_bound = self.grow * (self.p * self.delta).sum(1)
        self.logp_bound = self.delta.gather(1, self.labels[:, None]).squeeze(1) + self.lse_bound + EPS32
        spread = (self.logp_all + self.entropy[:, None]).abs()  # |log p_v + H|
        self.entropy_bound = self.grow * (self.p * (spread + 4 * dmax[:, None]) * self.delta).sum(1) + EPS32
        # |d p_v| and |d (log p_v + H)|, for the gradients
        self.p_bound = self.grow[:, None] * self.p * (self.delta + (self.p * self.delta).sum(1, keepdim=True))
        self.spread, self.spread_bound = spread, self.delta + (self.lse_bound + self.entropy_bound)[:, None]

    def dz(self, g_logp, g_entropy, g_logp_bound=None):
        """dloss / d(h W^T) [N, V] for upstream gradients g_logp, g_entropy [N] (0 on ignored rows), and E, the
        bound on its error (g_logp_bound: how far the path's g_logp may be from g_logp, for the loss)."""
        onehot = torch.zeros_like(self.p).scatter_(1, self.labels[:, None], 1.0)
        g_logp_bound = torch.zeros_like(g_logp) if g_logp_bound is None else g_logp_bound
        g, gb, ge = g_logp[:, None], g_logp_bound[:, None], g_entropy[:, None]
        # dz = g (onehot - p) - g_H p (log p + H), divided by T for the logits hidden @ weight.T
        dz = g * (onehot - self.p) - ge * self.p * (self.logp_all + self.entropy[:, None])
        err = (gb * (onehot - self.p).abs() + (g.abs() + gb) * self.p_bound
               + ge.abs() * (self.p_bound * self.spread + (self.p + self.p_bound) * self.spread_bound))
        return dz / self.T, err / self.T

    def grad_bounds(self, dz, err, hidden_rounded, weight_rounded):
        """Bounds on |dhidden~ - dhidden| [N, H] and |dweight~ - dweight| [V, H] (see the module docstring)."""
        magnitude = dz.abs() + err
        bounds = []
        for other, K, rounded in ((self.w, self.w.shape[0], hidden_rounded), (self.h, self.h.shape[0],
                                                                              weight_rounded)):
            product = (lambda a, b: a @ b) if other is self.w else (lambda a, b: a.T @ b)
            exact = product(dz, other)
            bound = product(err, other.abs()) + (2 * U + U * U + (K + 2) * F32) * product(magnitude, other.abs())
            if rounded:  # the result is rounded to bf16 once more on its way out
                bound = bound + U * (exact.abs() + bound)
            bounds.append((exact, bound))
        return bounds


def assert_within(name, got, want, bound):
    err = (got.double() - want).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"{name}: error {err.flatten()[worst].item():.3g} > bound "
                                  f"{bound.flatten()[worst].item():.3g} (max error {err.max().item():.3g})")


# ------------------------------------------------------------------------------------------ linear_token_logprobs
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tiles", ["one", "many"])
def test_linear_token_logprobs_against_float64(mode, tiles, monkeypatch):
    # entropy, T != 1, ignored labels; "many": 3 row tiles x 9 V tiles with ragged ends (dW summed over row tiles
    # in the fp32 slab, dhidden over V tiles), "one": the whole [N, V] in one tile (dW straight from the GEMM)
    if tiles == "many":
        monkeypatch.setattr(linear_module, "TORCH_TILE_ELEMENTS", 128 * 16)  # tiles of 16 rows x 128 columns
    N, H, V, T = 40, 64, 1100, 0.7
    hidden, weight = bf16_head(N, H, V, logit_scale=3.0, seed=1)
    gen = torch.Generator().manual_seed(2)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::5] = -100
    g_logp, g_entropy = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    h, w = leaves(hidden, weight, mode)
    with autocast_if(mode):
        logp, entropy = linear_token_logprobs_torch(h, w, labels, temperature=T, return_entropy=True)
    (logp * g_logp + entropy * g_entropy).sum().backward()

    truth = Truth(hidden, weight, labels, T)
    valid = truth.valid
    assert logp.dtype == entropy.dtype == torch.float32
    assert (logp[~valid] == 0).all() and (entropy[~valid] == 0).all() and (h.grad[~valid] == 0).all()
    assert_within("logprobs", logp[valid], truth.logp[valid], truth.logp_bound[valid])
    assert_within("entropy", entropy[valid], truth.entropy[valid], truth.entropy_bound[valid])
    zero = torch.zeros(N, dtype=torch.float64)
    dz, err = truth.dz(torch.where(valid, g_logp.double(), zero), torch.where(valid, g_entropy.double(), zero))
    # both gradients leave the Function in bf16 (under autocast, autograd widens them to the fp32 leaves)
    (dh, dh_bound), (dw, dw_bound) = truth.grad_bounds(dz, err, hidden_rounded=True, weight_rounded=True)
    assert_within("dhidden", h.grad, dh, dh_bound)
    assert_within("dweight", w.grad, dw, dw_bound)


# ------------------------------------------------------------------------------------------ linear_logprob_loss
# PPO's loss from ppo_core.algo (test_kernels_loss.objective: clip, dual clip, the KL term, the entropy bonus)
LOSS_CONFIGS = {
    "clipped": dict(temperature=1.0, clip_low=0.2, clip_high=0.28, agg="token-mean"),
    "dual-clip-kl-entropy": dict(temperature=0.7, dual_clip=3.0, kl_coef=0.1, kl_kind="k3", entropy_coef=0.05,
                                 agg="seq-mean-token-mean"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", sorted(LOSS_CONFIGS))
def test_linear_logprob_loss_against_float64(mode, config, monkeypatch):
    # 13 tokens per chunk against rows of 9-12: 4 chunks of one row, dW summed over them
    monkeypatch.setattr(loss_module, "TORCH_LOSS_TILE_ELEMENTS", 13 * 1100)
    kwargs = dict(LOSS_CONFIGS[config])
    T = kwargs.pop("temperature")
    need_entropy = "entropy_coef" in kwargs
    B, S, H, V = 4, 12, 64, 1100
    hidden, weight = bf16_head(B * S, H, V, logit_scale=3.0, seed=3)
    gen = torch.Generator().manual_seed(4)
    labels = torch.randint(0, V, (B * S,), generator=gen)
    labels[:3] = -100  # prompt positions
    mask = (labels != -100).double()
    mask[S:S + 2] = 0  # padding with a real label: its logits are formed, its gradient is 0
    truth = Truth(hidden, weight, labels, T)
    # ratios r = exp(logp - old) away from every kink (1 - clip_low, 1 + clip_high, and the dual clip's) by more
    # than the log-prob bound, so that the path and the truth take the same branch; half of them clipped
    targets = torch.tensor([0.5, 0.9, 1.05, 1.6])[torch.arange(B * S) % 4].double()
    old = (truth.logp - targets.log()).float().double()  # the fp32 values the path gets
    advantages = torch.randn(B * S, generator=gen).float().double()
    ref = (truth.logp + 0.3 * torch.randn(B * S, generator=gen).double()).float().double()
    ratios = torch.exp(truth.logp - old)
    kinks = torch.tensor([1 - kwargs["clip_low"] if "clip_low" in kwargs else 0.8,
                          1 + kwargs.get("clip_high", 0.2)]).log()
    assert ((ratios.log()[:, None] - kinks).abs().min(1).values > truth.logp_bound).all()
    if "dual_clip" in kwargs:  # -A r against -A c for A < 0: r = 1.6 < c = 3 keeps off that kink as well
        assert ratios.max() * math.exp(truth.logp_bound.max()) < kwargs["dual_clip"]
    shape = lambda t: t.view(B, S)  # noqa: E731
    tokens = [shape(t.float()) for t in (old, advantages, mask, ref)]  # [B, S] each: (old, A, mask, ref) in fp32
    loss_fn = objective("ppo", tokens, **kwargs)
    loss_fn64 = objective("ppo", [t.double() for t in tokens], **kwargs)  # the same values, in float64

    h, w = leaves(hidden, weight, mode)
    with autocast_if(mode):
        loss, stats, logp, entropy = linear_logprob_loss_torch(h.view(B, S, H), w, shape(labels), loss_fn,
                                                               temperature=T, need_entropy=need_entropy)
    loss.backward()

    # The truth: the float64 loss, and its gradients with respect to each token's log-prob and entropy (autograd
    # through ppo_core.algo's policy loss on float64 leaves)
    logp_leaf = truth.logp.masked_fill(~truth.valid, 0.0).clone().requires_grad_()
    entropy_leaf = truth.entropy.masked_fill(~truth.valid, 0.0).clone().requires_grad_()
    want, _ = loss_fn64(shape(logp_leaf), shape(entropy_leaf) if need_entropy else None, slice(None))
    g_logp, g_entropy = torch.autograd.grad(want, (logp_leaf, entropy_leaf), allow_unused=True)
    g_entropy = torch.zeros_like(g_logp) if g_entropy is None else g_entropy
    # the same loss through the naive float64 path (hidden @ weight.T, then the loss): the same number
    naive, *_ = linear_logprob_loss_reference(hidden.double().view(B, S, H), weight.double(), shape(labels),
                                              loss_fn64, temperature=T, need_entropy=need_entropy)
    assert abs(naive.item() - want.item()) <= 1e-12

    in_loss = truth.valid & (mask > 0)
    assert loss.dtype == logp.dtype == torch.float32
    assert (logp.reshape(-1)[~truth.valid] == 0).all() and (h.grad.view(-1, H)[~in_loss] == 0).all()
    # every token with a label has its log-prob (those out of the loss too: the loop reports the KL from them)
    assert_within("logp", logp.reshape(-1)[truth.valid], truth.logp[truth.valid], truth.logp_bound[truth.valid])
    if need_entropy:
        assert_within("entropy", entropy.reshape(-1)[truth.valid], truth.entropy[truth.valid],
                      truth.entropy_bound[truth.valid])
    # g moves with logp: |dg/dlogp| <= w (|A| r + kl_coef e^(ref - logp)) (the clipped branches have 0), and
    # the weights w are those of the aggregation (mask-only)
    weight_leaf = torch.zeros(B * S, dtype=torch.float64, requires_grad=True)  # d aggregate / d L_t = w_t
    weights, = torch.autograd.grad(algo.aggregate(shape(weight_leaf), shape(mask), kwargs["agg"]), weight_leaf)
    b = truth.logp_bound.masked_fill(~in_loss, 0.0)
    slope = advantages.abs() * ratios + kwargs.get("kl_coef", 0.0) * torch.exp(ref - truth.logp)
    g_logp_bound = b * torch.exp(2 * b) * weights * slope
    # |d loss| <= sum_t (|g_t| + |dg_t|) b_t + sum_t |g_H,t| |d H_t|, plus the fp32 sum's rounding
    loss_bound = ((g_logp.abs() + g_logp_bound) * b).sum() + (g_entropy.abs() * truth.entropy_bound).sum()
    assert_within("loss", loss, want.detach(), loss_bound + 1e-6 * max(1.0, abs(want.item())))
    dz, err = truth.dz(g_logp, g_entropy, g_logp_bound)
    # dhidden / dweight come out of fp32 accumulators: rounded to bf16 for bf16 leaves, as they are for fp32 ones
    (dh, dh_bound), (dw, dw_bound) = truth.grad_bounds(dz, err, hidden_rounded=mode == "bf16",
                                                       weight_rounded=mode == "bf16")
    assert_within("dhidden", h.grad.view(-1, H), dh, dh_bound)
    assert_within("dweight", w.grad, dw, dw_bound)


# ------------------------------------------------------------------------------------------ fp32 statistics
def test_fp32_statistics():
    # V = 32768 small logits: log-probs near -log V = -10.4, where bf16's spacing is 2^-4. bf16 logits cost at
    # most u |z| <= 2^-8 each here, so the bound holds the path to ~0.008, which bf16 statistics (a log_softmax
    # rounded to bf16, as a pure-bf16 eager path gives it) cannot meet.
    N, H, V = 24, 32, 32768
    hidden, weight = bf16_head(N, H, V, logit_scale=0.5, seed=5)
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(6))
    truth = Truth(hidden, weight, labels, 1.0)
    logp = linear_token_logprobs_torch(hidden, weight, labels)
    assert_within("logprobs", logp, truth.logp, truth.logp_bound)
    naive = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels[:, None]).squeeze(1)  # bf16 throughout
    err, err_naive = (logp.double() - truth.logp).abs().max(), (naive.double() - truth.logp).abs().max()
    assert (err_naive > truth.logp_bound).any(), "bf16 statistics would pass this test: it checks nothing"
    assert err < err_naive / 4, (err, err_naive)


# ------------------------------------------------------------------------------------------ dtypes
class MatmulDtypes(TorchDispatchMode):
    """Records the operand dtypes of every matmul that runs (the real ones: nothing is replaced)."""

    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
               torch.ops.aten.addmm.out, torch.ops.aten.addmm_.default, torch.ops.aten.bmm.default}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS:
            self.seen.append((str(func), tuple(a.dtype for a in args if torch.is_tensor(a) and a.dim() == 2)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
def test_matmuls_run_in_bf16_and_gradients_come_back_in_the_leaves_dtypes(mode):
    # bf16 leaves get bf16 gradients, fp32 leaves under autocast fp32 ones; every [*, H] x [H, *] product of
    # the forward and the backward (torch.mm: logits, dhidden, dweight) has bf16 operands, and the outputs are fp32
    N, H, V = 12, 32, 600
    hidden, weight = bf16_head(N, H, V, logit_scale=3.0, seed=7)
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(8))
    leaf_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    for run in ("logprobs", "loss"):
        h, w = leaves(hidden, weight, mode)
        with MatmulDtypes() as spy:
            with autocast_if(mode):
                if run == "logprobs":
                    logp, entropy = linear_token_logprobs_torch(h, w, labels, temperature=0.7, return_entropy=True)
                    out = logp.sum() + entropy.sum()
                    assert logp.dtype == entropy.dtype == torch.float32
                else:
                    tokens = (torch.full((1, N), -6.0), torch.randn(1, N), torch.ones(1, N), torch.zeros(1, N))
                    out, *_ = linear_logprob_loss_torch(h[None], w, labels[None], objective(
                        "ppo", tokens, entropy_coef=0.01), need_entropy=True)  # [1, N, H]: one row
                    assert out.dtype == torch.float32
            out.backward()
        mm = [operands for name, operands in spy.seen if "bmm" not in name]  # bmm: the fp32 entropy dot product
        assert len(mm) >= 3 and all(operands == (torch.bfloat16, torch.bfloat16) for operands in mm), (run, spy.seen)
        assert h.grad.dtype == w.grad.dtype == leaf_dtype, run


def test_token_logprobs_bf16_logits():
    # token_logprobs widens bf16 logits to fp32 for its statistics: log-probs and entropy within fp32 rounding
    # of the float64 truth on the same logits; the logits' gradient (bf16, like the logits) is the truth's
    # rounded to bf16 (u relative) up to fp32 rounding. Under autocast, fp32 logits stay fp32.
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(6, 40, 3000, generator=gen) * 4).bfloat16()
    labels = torch.randint(0, 3000, (6, 40), generator=gen)
    labels[0, :5] = -100
    x = logits.clone().requires_grad_()
    logp, entropy = token_logprobs_torch(x, labels, temperature=0.7, return_entropy=True)
    g = torch.randn(6, 40, generator=gen)
    (logp * g + entropy).sum().backward()
    x64 = logits.double().requires_grad_()
    logp64, entropy64 = token_logprobs_reference(x64, labels, temperature=0.7, return_entropy=True)
    (logp64 * g.double() + entropy64).sum().backward()
    assert logp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert (logp.double() - logp64).abs().max() <= EPS32 and (entropy.double() - entropy64).abs().max() <= EPS32
    # dz = (g (onehot - p) - p (log p + H)) / T, formed in fp32 (32 ulp of its terms' magnitude covers the few
    # roundings of each of them), then rounded to bf16 (u relative)
    logp_all = torch.log_softmax(logits.double() / 0.7, -1)
    p = logp_all.exp()
    onehot = torch.zeros_like(p).scatter_(-1, labels.clamp(min=0)[..., None], 1.0)
    terms = (g.double()[..., None].abs() * (onehot + p) + p * (logp_all.abs() + entropy64.detach()[..., None])) / 0.7
    assert_within("dlogits", x.grad, x64.grad, U * x64.grad.abs() + 32 * F32 * terms * (1 + U))
    x32 = logits.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = token_logprobs_torch(x32 * 1.1, labels, return_entropy=True)
    for got, want in zip(under_autocast, token_logprobs_torch(x32 * 1.1, labels, return_entropy=True)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
@pytest.mark.parametrize("empty", ["labels", "mask"])
def test_no_token_in_the_loss_gives_zero_gradients(mode, empty):
    """A micro-batch with no token in the loss (what a process short of rows runs under DDP so that its gradient
    reduction pairs up, with the global counts of the others) must contribute exactly 0 to every gradient. Every
    label -100: no row is projected, and the dW accumulator must not be left uninitialised (a bf16 path once copied
    its first row tile into an empty buffer and returned garbage when there was none); mask 0 with real labels: the
    rows are projected, and each token's gradient is 0."""
    hidden, weight = bf16_head(12, 32, 40, 1.0, seed=5)
    labels = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(5))
    if empty == "labels":
        labels = torch.full_like(labels, -100)
    h, w = leaves(hidden, weight, mode)
    zeros = torch.zeros(2, 6)
    policy_loss = algo.policy_loss_function("ppo")
    loss_fn = lambda logp, entropy, rows: policy_loss(  # noqa: E731
        logp, zeros[rows], torch.randn(2, 6)[rows], zeros[rows],
        agg=algo.Aggregation(num_tokens=torch.tensor(5.0), num_seqs=torch.tensor(2.0)))
    with autocast_if(mode):
        loss, *_ = linear_logprob_loss_torch(h.view(2, 6, 32), w, labels, loss_fn)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))
