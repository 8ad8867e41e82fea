"""ppo-plan: how much GPU memory a PPO run needs, per role and per GPU, from the models' config.json alone.

    ppo-plan --policy configs/models/Qwen3-4B --gpus 8 --sharding fsdp --prompt-len 512 --response-len 1024
    ppo-plan --policy ckpt/Qwen3-8B --reward-model ckpt/Skywork-Reward-V2-Qwen3-8B --lora-rank 64 --json
    ppo-plan --config configs/default.toml --prompt-len 8            # the run config of ppo-train
    ppo-plan --policy configs/models/Qwen3-0.6B --micro-batch-tokens 16384   # packed micro-batches of 16384 tokens
    ppo-plan --policy configs/models/Qwen3-1.7B --no-critic           # GRPO, RLOO, REINFORCE++: no critic

A role's checkpoint is a directory holding config.json or the config.json itself; nothing else is read.
Options take dashes or underscores alike (`--gpu-memory-gb` or `--gpu_memory_gb`, as ppo-train's keys).
Parameters are counted by building the model on the meta device (no memory, no weights), so they are
this library's models exactly: `CausalLM` for the policy and reference, `ScoreModel` (backbone + a
1-output head, no LM head) for the critic and reward model. GB = 1e9 bytes.

Roles. policy: trainable CausalLM. reference: frozen CausalLM (default: the policy's config; with LoRA and
no --reference it is the policy's own base with adapters off, so it costs nothing). critic: trainable
ScoreModel (default: the policy's backbone; none at all with --no-critic, for the critic-free estimators grpo,
dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, which build, train and run no critic). reward model: frozen
ScoreModel (default: none, the reward is a function). teacher: frozen CausalLM (default: none; --teacher, on-policy
distillation).

Model state, n = parameters of the role, G = GPUs:
  trainable, full fine-tuning (mixed-precision AdamW), 18 B/param:
      weights   = 4 n (fp32 master) + 2 n (bf16 copy the matmuls read)
      gradients = 4 n (fp32)
      optimizer = 8 n (AdamW m and v, fp32)
  trainable with LoRA rank r: the base is frozen (2 n, bf16) and only the adapters train (18 B each), plus
      the critic's score head; adapters on q,k,v,o,gate,up,down of every block, r (d_in + d_out) each.
  frozen: weights = 2 n (bf16).
  --sharding fsdp (FSDP2, bf16 params, fp32 reduction): the fp32 master weights, gradients and optimizer
      state (16 B/param) and frozen bf16 weights are divided by G; the bf16 copy is not kept between uses:
      a gather working set instead, 2 B x (root + 2 blocks) of the largest model, the unit being computed
      and the prefetched one (root = embeddings, final norm, LM or score head), + 2 B x 1 block of unsharded
      gradients before their reduce-scatter when that model trains.
  --offload (needs fsdp): the sharded state lives in CPU memory (reported as cpu_offload_gb), only the
      gather working set stays on the GPU.
  --sharding none with G > 1 is DDP (gradient_as_bucket_view: no second copy of the gradients).

Training activations of one micro-batch: M sequences of T = P + R tokens per GPU, N = M T tokens,
a = 2 (bf16 activations), f = 4 (the fp32 copy every norm makes), Dq = nh hs, Dkv = nkv hs. What autograd
saves in this hand-written model (ppo_core/models/model.py), per block:
      norms      2 N H (f + a_w) + 2 a N H    input copy in fp32 (+ the normalised x for the weight's grad,
                                              a_w = a, or 0 when the norm weight is frozen: LoRA, OLMo's LayerNorm)
                                              + the norm outputs, the inputs of q/k/v and of gate/up
      q/k norm   (f + a_w) N (Dq + Dkv)       Qwen3, OLMo 2/3 only
      attention  a N (2 Dq + 2 Dkv)           q, k after RoPE, v, the attention output (= o_proj's input)
                 + 4 N nh                     log-sum-exp of the fused kernel. No mask: the rows are rolled so
                                              that their pads follow their real tokens (model.Backbone.forward)
                                              and causal attention runs as flash with native GQA
                 + 2 a N (Dq - Dkv) + a T^2   only in a sliding-window layer whose window < T: K and V repeated
                                              to nh heads and the causal-window mask as one [T, T] float bias
                                              (the memory-efficient kernel: a mask, no GQA)
      MLP        4 a N I                      gate, silu(gate), up, silu(gate) * up
      LoRA       7 a N r                      the rank-r intermediate of each adapter
  once per model: 16 N (token ids, rolled, and the roll back) + 2 a M T hs (RoPE cos, sin per RoPE type)
      + N H (f + a_w) (final norm), and the head:
      policy   a M R H   the response hidden states fed to the fused log-prob kernel (it never forms [N, V])
      critic   a N H     the score head's input
  backward transients on top of what is saved:
      last block    2 a N I   the gradients of silu(gate) and up before gate and up are freed
      policy head   the fused log-prob backward: dW of the LM head (V H, gradient dtype), dhidden (M R H, fp32)
                    and its tile workspace (ppo_kernels.linear_logprobs)
  peak = saved + the larger transient.
  With activation checkpointing each block keeps only its input, a N H, and one block is recomputed at a time,
  after the head's backward has finished: kept = L a N H + once + head, and
  peak = max(kept + head transient, kept + (one block) + last-block transient).
  The policy and the critic run their forward + backward one after the other, so the training phase needs the
  larger of the two, not the sum (the policy's alone without a critic).

Packed micro-batches (the run's micro_batch_tokens > 0, or --micro-batch-tokens): every training and scoring pass
runs on the real tokens of several sequences concatenated, at most the budget of them (ppo_core.data.packing), so N is
the budget, not M T: N = max(budget, T), a sequence longer than the budget getting a micro-batch of its own. What
changes in the terms above:
      attention  per sequence, torch's variable-length flash attention on a GPU: no mask and no [T, T] bias in any
                 layer (its sliding window is the kernel's), K and V not repeated (GQA native; a torch whose
                 varlen_attn lacks enable_gqa repeats them, 2 a N (Dq - Dkv) more per block, not counted)
      once       8 N (the packed token ids the embedding keeps) + 8 M R (the [M, R] index that lays the hidden
                 states out per sequence again) + 2 a N hs (RoPE cos, sin per RoPE type)
                 + N H (f + a_w) (final norm)
      policy head  a M R H: the fused log-prob kernel still reads [M, R, H], the hidden states unpacked per sequence
                 (zeros where a row has no response token); it computes only real response tokens, but its input
                 and its backward's dhidden have M R rows
      critic head  a N H: the score head projects the packed [N, H] before the values are unpacked
  M here is the sequences in one micro-batch. The planner assumes sequences of the planned length, M = max(1,
  budget // T), as it assumes full-length rows everywhere else; shorter sequences pack more of them into the budget:
  the terms in N stay bounded by it, the head terms in M R grow with M (at most the minibatch's sequences per GPU).

Rollouts (B sequences per GPU, B = ceil(rollout_batch / G)), with the paged rollout engine (ppo_core.engine, the
default; --rollout-engine padded for ppo_core.generate):
  KV pool = the budget --kv-cache-gb (GiB, the run's rollout_kv_cache_gb), or by default what the engine takes:
             80% of the memory free when the rollout starts (after model state, gather working set, rollout buffers
             and CUDA overhead); never more than B sequences of P + R tokens hold (the engine allocates no more).
             One sequence of T = P + R tokens holds 2 x nkv x hs x 2 bytes x the sum over layers of its slots:
             ceil(T / 16) x 16 for full attention, min(that, (ceil((window - 1) / 16) + 1) x 16) for a sliding
             window (blocks of 16 positions); the plan prints how many such sequences fit in the pool at once (the
             engine runs the rest as others finish, and preempts when the pool runs out: nothing fails).
  padded KV cache (--rollout-engine padded) = 2 (k and v) x B x nkv x hs x 2 bytes (bf16) x sum over layers of
             their slots: P + R for full attention, min(window, P + R) for a sliding-window layer (a ring): exactly
             ppo_core.models.model.KVCache's tensors (+ its [B, P+R] mask, [B] counters and write slot).
  generation working set, the larger of: prefill a b T (3 I + 2 H) + f b T H + (a + 1) b T^2 + 2 a b T Dq (the
             biggest block temporaries, the mask as bool and float bias, K and V repeated to nh heads; padded: the
             B left-padded prompts, b = B and T = P; paged: one prefill chunk, b = 1 and T = min(4096, B P)) and
             decoding 40 B V (paged: 40 min(B, 256) V, the engine's most sequences at once) (about ten fp32 [B, V] sampling buffers; a decoding step's attention copies
             nothing: each kv head's query heads become its query rows).
  scoring (policy, reference, critic and reward no-grad forwards in micro-batches of M): M rows of the same
             block temporaries at T = P + R, rolled: no mask, unless a sliding window < T (then one [T, T] mask,
             (a + 1) T^2, and the repeated K and V, 2 a M T Dq); no autograd state. Packed: the block temporaries
             of N = max(budget, T) tokens, never a mask.
  rollout buffers: token ids and mask 9 B T + ten fp32 [B, R] tensors.

Per GPU = model state of every role + gather working set + max(rollout phase, training phase) + rollout buffers
          + 1 GB (CUDA context, cuBLAS and NCCL workspaces; allocator fragmentation is not modelled).
It fits when that is <= --gpu-memory-gb. Everything assumes bf16 compute as in the distributed trainer; the
single-process loop with dtype=auto keeps fp32 weights under autocast, so its reference weights and KV cache
take twice the bytes shown there.

How the activation estimate was checked (tests/test_plan.py): a Qwen3-family model at a scaled-down size,
trained on the CPU for one micro-batch with the loop's own code path (heads.response_logprobs + algo.policy_loss,
then heads.response_values + algo.value_loss), float32, left-padded prompts. Measured twice: (1) the bytes of
every distinct non-parameter storage autograd saves (torch.autograd.graph.saved_tensors_hooks), against the
"saved" term above; (2) the process's peak resident memory over the forward + backward above the memory before
it (Linux: VmHWM reset through /proc/self/clear_refs, glibc's mmap threshold pinned at 64 KiB so every freed
tensor leaves RSS), against saved + transient. The same formulas are evaluated there with a = f = 4 and the
CPU (torch) log-prob path; the KV cache is compared with KVCache's tensors built on the meta device.
Found (8 sequences x 128 tokens, H 128, 3 blocks): peaks within -2% to +9% of the measured ones for policy
and critic, with and without activation checkpointing; saved bytes within 0.4%, also for the default job itself
and for an OLMo-3-style model whose sliding windows are shorter than the sequence. The same micro-batch packed (its
928 real tokens, rollout's packed path, attention one sequence at a time as the CPU runs it): peaks within +0.5% to
+13% (the critic with checkpointing the furthest), saved bytes within 0.4%. On the CPU, SDPA's flash
kernel saves what the fused CUDA kernels save (q, k, v, output, log-sum-exp, the float bias of a mask); that
each CUDA pass does take a fused kernel is for a GPU run to show (run it under torch.nn.attention.sdpa_kernel
without the math backend).
"""
import argparse
import dataclasses
import functools
import json
import math
import os
import sys

import torch

from ..models.lora import LORA_TARGETS
from ..models.model import CausalLM, CheckpointError, ModelArgs, ScoreModel, read_config

GB = 1e9
DEMO_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo", "reverse-demo")
CUDA_OVERHEAD_BYTES = 1 * GB

# bytes per trainable parameter of mixed-precision AdamW, and of a frozen one
FP32_MASTER, BF16_COPY, FP32_GRAD, ADAM_STATE, FROZEN = 4, 2, 4, 8, 2
BYTES_PER_TRAINABLE_PARAM = FP32_MASTER + BF16_COPY + FP32_GRAD + ADAM_STATE  # 18


class PlanError(ValueError):
    """An input the planner cannot use; the message is shown as is."""


# ---------------------------------------------------------------------------- the models, counted on meta

def load_config(path) -> dict:
    """config.json of a checkpoint directory, or a config.json path (`~` expanded)."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        return read_config(path)
    if not os.path.isfile(path):
        raise PlanError(f"no such checkpoint directory or config file: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: not valid JSON ({e})") from None


def model_shape(cfg: dict, score: bool, lora_rank: int = 0) -> dict:
    """Parameter counts of CausalLM (score=False) or ScoreModel (score=True) built from `cfg` on the meta device.

    Returns args (ModelArgs), params (tied weights once), block (largest block), root (everything outside the
    blocks), head (the score head, 0 for a CausalLM) and lora (adapter params at rank lora_rank)."""
    counts = _meta_counts(json.dumps(cfg, sort_keys=True), score)
    return dict(counts, args=ModelArgs.from_hf_config(cfg), lora=lora_rank * counts["lora_per_rank"])


@functools.lru_cache(maxsize=64)
def _meta_counts(cfg_json: str, score: bool) -> dict:
    args = ModelArgs.from_hf_config(json.loads(cfg_json))
    with torch.device("meta"):
        model = ScoreModel(args) if score else CausalLM(args)
    params = model.num_parameters()
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.model.layers]
    # a rank-r adapter on a d_in -> d_out projection: A [r, d_in], B [d_out, r]
    lora_per_rank = sum(m.in_features + m.out_features for name, m in model.named_modules()
                        if name.rsplit(".", 1)[-1] in LORA_TARGETS)
    return dict(params=params, block=max(blocks), root=params - sum(blocks),
                head=args.hidden_size if score else 0, lora_per_rank=lora_per_rank)


# ---------------------------------------------------------------------------- activations and KV cache

# ppo_kernels.linear_logprobs' tile sizes and rule, repeated so that planning never imports Triton
# (tests/test_plan.py checks they agree)
TRITON_TILE_ELEMENTS = 1 << 26
TORCH_TILE_ELEMENTS = 1 << 23


def _tile_shape(n_rows, n_cols, tile_elements, align=128, max_cols=8192):
    """(rows, cols) of one logits tile of the fused log-prob kernels."""
    rows = max(1, min(n_rows, tile_elements // align))
    cols = max(align, min(max_cols, (tile_elements // rows) // align * align))
    return rows, min(cols, n_cols)


def logprob_backward_bytes(n_rows, vocab, hidden, *, act=2, grad_bytes=4, head_trainable=True, backend="triton"):
    """Temporaries of the fused log-prob backward (ppo_kernels.linear_logprobs) for n_rows response tokens."""
    fp32_input = act == 4
    if backend == "triton":
        rows, cols = _tile_shape(n_rows, vocab, TRITON_TILE_ELEMENTS)
        workspace = rows * cols * (4 if fp32_input else act)  # dz tile
        dh = n_rows * hidden * (8 if fp32_input else 4) + n_rows * hidden * 4  # accumulator + its fp32 result
        slab = cols * hidden * 4 if head_trainable else 0
    else:  # the chunked torch path, what CPU tensors run
        rows, cols = _tile_shape(n_rows, vocab, TORCH_TILE_ELEMENTS)
        workspace = 2 * rows * cols * 4 + rows * hidden * 4  # z and dz tiles + one dhidden tile
        dh = n_rows * hidden * 8  # fp64 accumulator
        slab = 0 if (rows >= n_rows and fp32_input) or not head_trainable else cols * hidden * 4
    dw = vocab * hidden * grad_bytes if head_trainable else 0
    return workspace + dh + slab + dw


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One training micro-batch: M sequences of P prompt and R response tokens; tokens = 0: M padded rows of P + R
    tokens; tokens > 0: packed, the sequences' real tokens, `tokens` in all, run concatenated (ppo_core.data.packing)
    and their response hidden states are laid out [M, R, H] again for the policy's head."""
    M: int
    P: int
    R: int
    tokens: int = 0


@dataclasses.dataclass(frozen=True)
class ElementBytes:
    """Bytes of one element: of an activation (act), of the norms' float copy (fp32), of a gradient (grad)."""
    act: int = 2
    fp32: int = 4
    grad: int = 4


def training_activations(args: ModelArgs, role, batch: MicroBatch, *, sizes=ElementBytes(), lora_rank=0,
                         checkpointing=False, backend="triton") -> dict:
    """Bytes of one training micro-batch's activations for `role` ("policy" or "critic"): saved, transient, peak.

    The formulas of the module docstring. backend "torch" is what CPU tensors run: the chunked log-prob path and,
    packed, attention one sequence at a time, whose outputs are concatenated (a N Dq more per block than one
    kernel)."""
    M, P, R, tokens = batch.M, batch.P, batch.R, batch.tokens
    act, fp32 = sizes.act, sizes.fp32
    H, I, L, hs = args.hidden_size, args.intermediate_size, args.num_hidden_layers, args.head_dim
    nh, nkv, V = args.num_attention_heads, args.num_key_value_heads, args.vocab_size
    T = P + R
    packed = tokens > 0
    N = tokens if packed else M * T
    Dq, Dkv = nh * hs, nkv * hs
    # the weight * normalised-x product saves x only when the weight trains (RMSNorm, not LoRA's frozen base)
    a_w = act if (args.norm == "rmsnorm" and lora_rank == 0) else 0
    norm_input = N * H * (fp32 + a_w)
    block = 2 * norm_input + 2 * act * N * H  # the two norms and their outputs (the linears' inputs)
    if args.qk_norm:
        block += (fp32 + a_w) * N * (Dq + Dkv)
    if args.clip_qkv is not None:
        block += act * N * (Dq + 2 * Dkv)  # clamp saves the projections
    block += act * N * (2 * Dq + 2 * Dkv) + 4 * N * nh  # q, k, v, out; lse (rolled rows: causal, no mask)
    if packed and backend == "torch" and M > 1:
        block += act * N * Dq  # the per-sequence outputs each saved, and their concatenation (o_proj's input)
    block += 4 * act * N * I  # gate, silu(gate), up, product
    block += 7 * act * N * lora_rank
    # a sliding window shorter than the sequence needs a mask: K, V repeated to nh heads, the [T, T] float bias.
    # Packed, varlen flash attention takes the window itself: no mask (the CPU reference's per-sequence masks are
    # not modelled)
    masked_extra = 2 * act * N * (Dq - Dkv) + act * T * T
    n_masked = 0 if packed else sum(w is not None and w < T for w in args.sliding_windows)
    rope_bytes = fp32 if args.float32_rope_and_norm_weight else act
    n_rope = len({t for t, r in zip(args.layer_types, args.use_rope) if r})
    if packed:  # the packed ids the embedding keeps, the [M, R] index of unpack_rows (policy and critic)
        once = 8 * N + 8 * M * R + n_rope * 2 * N * hs * rope_bytes + norm_input
    else:  # token ids, rolled, and the roll back
        once = 16 * N + n_rope * 2 * M * T * hs * rope_bytes + norm_input
    if role == "policy":
        # packed too, the head reads [M, R, H]: unpack_rows lays the hidden states out per sequence again
        head = act * M * R * H
        head_transient = logprob_backward_bytes(M * R, V, H, act=act, grad_bytes=sizes.grad,
                                                head_trainable=lora_rank == 0, backend=backend)
    else:  # the score head's input: every token, [M, T, H] or packed [N, H]
        head, head_transient = act * N * H, 0
    layer_transient = 2 * act * N * I
    largest_block = block + (masked_extra if n_masked else 0)
    if checkpointing:
        # the head's backward runs before any block is recomputed; then one block at a time is live
        kept = L * act * N * H + once + head
        saved = kept + largest_block
        peak = max(kept + head_transient, saved + layer_transient)
    else:
        saved = L * block + n_masked * masked_extra + once + head
        peak = saved + max(head_transient, layer_transient)
    return dict(per_block=largest_block, saved=saved, transient=peak - saved, peak=peak)


def paged_sequence_bytes(args: ModelArgs, length, kv_bytes=2, block_size=16) -> int:
    """KV bytes one sequence of `length` tokens holds in the paged engine's pool at most: whole blocks, and for a
    sliding-window layer only the blocks its window spans (ppo_core.engine.scheduler frees the others)."""
    blocks = -(-length // block_size)
    slots = sum(block_size * (blocks if w is None else min(blocks, -(-(w - 1) // block_size) + 1))
                for w in args.sliding_windows)
    return 2 * slots * args.num_key_value_heads * args.head_dim * kv_bytes


def kv_cache_bytes(args: ModelArgs, batch, max_len, kv_bytes=2) -> int:
    """ppo_core.models.model.KVCache: k and v [L, B, nkv, P+R, hs] for full-attention layers and a ring of
    min(window, P+R) slots for sliding-window ones, the [B, P+R] bool mask, [B] int64 counters, the slot."""
    slots = sum(max_len if w is None else min(w, max_len) for w in args.sliding_windows)  # over layers
    elements = slots * batch * args.num_key_value_heads * args.head_dim
    return 2 * elements * kv_bytes + batch * max_len + 8 * batch + 8


def forward_working_set(args: ModelArgs, rows, length, act=2, fp32=4, prefill=False, packed=False) -> int:
    """Temporaries of a no-grad forward of rows x length tokens: the largest block's, and attention's masks.

    prefill=False (scoring: rows rolled, pads after the real tokens): a mask only where a sliding window is
    shorter than `length`, one [T, T] for the batch. prefill=True (the left-padded prompt into the KV cache):
    a mask per row. A mask comes as bool and float bias, with K and V repeated to nh heads (model.attention).
    packed=True (micro_batch_tokens: rows x length real tokens of sequences packed, attention per sequence by
    varlen flash attention): never a mask."""
    n = rows * length
    block = act * n * (3 * args.intermediate_size + 2 * args.hidden_size) + fp32 * n * args.hidden_size
    if packed:
        return block
    mask_rows = rows if prefill else int(any(w is not None and w < length for w in args.sliding_windows))
    if not mask_rows:
        return block
    gqa = args.num_attention_heads != args.num_key_value_heads
    repeated_kv = 2 * act * n * args.num_attention_heads * args.head_dim if gqa else 0
    return block + (act + 1) * mask_rows * length * length + repeated_kv


# ---------------------------------------------------------------------------- the plan

@dataclasses.dataclass(frozen=True)
class PlanShape:
    """The run a plan is for, beside its checkpoints (plan(policy, ..., **shape) takes these by name; ppo-plan's
    flags of the same names): the machine (gpus, gpu_memory_gb, sharding, offload), the batch (prompt_len,
    response_len, rollout_batch, micro_batch, micro_batch_tokens), the training (lora_rank,
    activation_checkpointing, critic_free) and the rollout (rollout_engine, kv_cache_gb); `plan` says what each
    means."""
    gpus: int = 1
    gpu_memory_gb: float = 80.0
    prompt_len: int = 512
    response_len: int = 1024
    rollout_batch: int = 64
    micro_batch: int = 4
    micro_batch_tokens: int = 0
    lora_rank: int = 0
    sharding: str = "none"
    offload: bool = False
    activation_checkpointing: bool = False
    critic_free: bool = False
    rollout_engine: str = "paged"
    kv_cache_gb: float = None


def plan(policy, critic="", reference="", reward_model="", teacher="", **shape) -> dict:
    """The memory plan as a dict (what --json prints). Raises PlanError / CheckpointError on bad input.
    shape: the fields of PlanShape, by name (an unknown one is a TypeError that names it).

    micro_batch_tokens > 0: packed micro-batches of at most that many real tokens (the run's micro_batch_tokens;
    micro_batch is then not read); the result's micro_batch is how many sequences of prompt_len + response_len
    tokens one holds (at least 1: a longer sequence runs alone). 0: padded micro-batches of micro_batch sequences.

    rollout_engine: "paged" (ppo_core.engine: a KV pool of kv_cache_gb GiB, None = the engine's default) or
    "padded" (ppo_core.generate's KVCache for the whole batch).

    critic_free: a critic-free estimator (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline): no "critic"
    role at all (no weights, gradients, optimizer state, activations or scoring forward).

    teacher: on-policy distillation's teacher checkpoint (ppo-train --teacher): one more frozen CausalLM, held and
    run in the scoring pass like the reference."""
    s = PlanShape(**shape)
    gpus, gpu_memory_gb, sharding, offload = s.gpus, s.gpu_memory_gb, s.sharding, s.offload
    prompt_len, response_len, rollout_batch = s.prompt_len, s.response_len, s.rollout_batch
    micro_batch, micro_batch_tokens = s.micro_batch, s.micro_batch_tokens
    lora_rank, activation_checkpointing, critic_free = s.lora_rank, s.activation_checkpointing, s.critic_free
    rollout_engine, kv_cache_gb = s.rollout_engine, s.kv_cache_gb
    for name, value in (("gpus", gpus), ("prompt_len", prompt_len), ("response_len", response_len),
                        ("rollout_batch", rollout_batch), ("micro_batch", micro_batch)):
        if value < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if micro_batch_tokens < 0:
        raise PlanError(f"--micro-batch-tokens must be >= 0 (0 = padded micro-batches), got {micro_batch_tokens}")
    if lora_rank < 0:
        raise PlanError(f"--lora-rank must be >= 0, got {lora_rank}")
    if gpu_memory_gb <= 0:
        raise PlanError(f"--gpu-memory-gb must be > 0, got {gpu_memory_gb}")
    if sharding not in ("none", "fsdp"):
        raise PlanError(f"--sharding must be none or fsdp, got {sharding!r}")
    if offload and sharding != "fsdp":
        raise PlanError("--offload needs --sharding fsdp (FSDP2 offloads the sharded state)")
    if rollout_engine not in ("paged", "padded"):
        raise PlanError(f"--rollout-engine must be paged or padded, got {rollout_engine!r}")
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        raise PlanError(f"--kv-cache-gb must be > 0, got {kv_cache_gb}")
    if critic_free and critic:
        raise PlanError(f"--critic {critic} and --no-critic: a critic-free run has no critic")
    fsdp = sharding == "fsdp"
    shard = gpus if fsdp else 1
    P, R, M = prompt_len, response_len, micro_batch
    B = math.ceil(rollout_batch / gpus)  # rollouts per GPU
    N = M * (P + R)  # tokens of one micro-batch, padding included
    if micro_batch_tokens:
        # packed: sequences of the planned length, as many as the budget holds (a longer one runs alone), and the
        # budget's worth of tokens (shorter sequences fill it: more of them, see the module docstring)
        M = max(1, micro_batch_tokens // (P + R))
        N = max(micro_batch_tokens, P + R)

    configs = {"policy": policy, "reference": reference or policy}
    if not critic_free:
        configs["critic"] = critic or policy
    if reward_model:
        configs["reward_model"] = reward_model
    if teacher:
        configs["teacher"] = teacher
    shared_base = lora_rank > 0 and (not reference or os.path.abspath(reference) == os.path.abspath(policy))
    roles, shapes = {}, {}
    for role, path in configs.items():
        trainable = role in ("policy", "critic")
        shapes[role] = shape = model_shape(load_config(path), score=role in ("critic", "reward_model"), lora_rank=lora_rank)
        n = shape["params"]
        if trainable and lora_rank == 0:
            n_train, n_frozen = n, 0
        elif trainable:  # LoRA: the adapters (and a critic's score head) train, the base is frozen
            n_train, n_frozen = shape["lora"] + shape["head"], n - shape["head"]
        else:
            n_train, n_frozen = 0, 0 if (role == "reference" and shared_base) else n
        # per GPU, before offload: the fp32 master, grads and AdamW state of trainables, bf16 frozen weights
        weights = (FP32_MASTER * n_train + FROZEN * n_frozen) / shard + (0 if fsdp else BF16_COPY * n_train)
        grads, optimizer = FP32_GRAD * n_train / shard, ADAM_STATE * n_train / shard
        entry = dict(config=path, model="ScoreModel" if role in ("critic", "reward_model") else "CausalLM",
                     trainable=trainable, params=n, trainable_params=n_train,
                     weight_gb=weights / GB, grad_gb=grads / GB, optimizer_gb=optimizer / GB,
                     train_state_gb=(weights + grads + optimizer) / GB)
        if role == "reference" and shared_base:
            entry["note"] = "the policy's frozen base with adapters disabled: no second copy"
        if trainable:
            acts = training_activations(shape["args"], role, MicroBatch(M, P, R, N if micro_batch_tokens else 0),
                                        sizes=ElementBytes(grad=2 if fsdp else 4), lora_rank=lora_rank,
                                        checkpointing=activation_checkpointing)
            entry.update(activation_gb=acts["peak"] / GB, activation_saved_gb=acts["saved"] / GB,
                         activation_transient_gb=acts["transient"] / GB)
        if role == "policy" and rollout_engine == "padded":
            entry["kv_cache_gb"] = kv_cache_bytes(shape["args"], B, P + R) / GB
        roles[role] = entry

    state = sum(entry["train_state_gb"] for entry in roles.values()) * GB
    cpu_offload = 0.0
    if offload:
        cpu_offload, state = state, 0.0
        for entry in roles.values():
            entry["offloaded_gb"] = entry["train_state_gb"]
            entry["weight_gb"] = entry["grad_gb"] = entry["optimizer_gb"] = entry["train_state_gb"] = 0.0
    gather = 0
    if fsdp:  # one model computes at a time: the largest one's units (a shared reference is the policy's)
        for role, shape in shapes.items():
            unsharded_grads = shape["block"] if roles[role]["trainable"] and lora_rank == 0 else 0
            gather = max(gather, BF16_COPY * (shape["root"] + 2 * shape["block"] + unsharded_grads))
    policy_args = shapes["policy"]["args"]
    buffers = 9 * B * (P + R) + 10 * 4 * B * R
    per_sequence = paged_sequence_bytes(policy_args, P + R)
    if rollout_engine == "padded":
        kv = roles["policy"]["kv_cache_gb"] * GB
        generation = max(forward_working_set(policy_args, B, P, prefill=True), 40 * B * policy_args.vocab_size)
        at_once = B
    else:
        generation = max(forward_working_set(policy_args, 1, min(4096, B * P), prefill=True),
                         40 * min(B, 256) * policy_args.vocab_size)  # the engine decodes 256 sequences at most
        if kv_cache_gb is None:  # the engine's default: 80% of what is free when the rollout starts
            free = gpu_memory_gb * GB - state - gather - buffers - CUDA_OVERHEAD_BYTES
            kv = max(0.0, 0.8 * free)
        else:
            kv = kv_cache_gb * 2**30
        kv = min(kv, B * per_sequence)  # the engine allocates no more than all B sequences can hold
        at_once = min(B, int(kv // per_sequence))
        roles["policy"]["kv_cache_gb"] = kv / GB
    if micro_batch_tokens:
        scoring = max(forward_working_set(shape["args"], 1, N, packed=True) for shape in shapes.values())
    else:
        scoring = max(forward_working_set(shape["args"], M, P + R) for shape in shapes.values())
    rollout_phase = max(kv + generation, scoring)
    training_phase = max(roles[r]["activation_gb"] * GB for r in ("policy", "critic") if r in roles)
    per_gpu = state + gather + max(rollout_phase, training_phase) + buffers + CUDA_OVERHEAD_BYTES
    return {
        "roles": roles,
        "gpus": gpus, "gpu_memory_gb": gpu_memory_gb, "sharding": sharding, "offload": offload,
        "lora_rank": lora_rank, "activation_checkpointing": activation_checkpointing, "critic_free": critic_free,
        "prompt_len": P, "response_len": R, "rollout_batch": rollout_batch, "rollout_batch_per_gpu": B,
        "micro_batch": M, "micro_batch_tokens": micro_batch_tokens,
        "model_state_gb": state / GB,
        "fsdp_gather_gb": gather / GB,
        "rollout_phase_gb": rollout_phase / GB,
        "kv_cache_gb": kv / GB,
        "rollout_engine": rollout_engine,
        "kv_sequence_gb": per_sequence / GB,
        "sequences_at_once": at_once,
        "generation_working_set_gb": generation / GB,
        "scoring_working_set_gb": scoring / GB,
        "training_phase_gb": training_phase / GB,
        "rollout_buffers_gb": buffers / GB,
        "cuda_overhead_gb": CUDA_OVERHEAD_BYTES / GB,
        "cpu_offload_gb": cpu_offload / GB,
        "per_gpu_gb": per_gpu / GB,
        "fits": per_gpu <= gpu_memory_gb * GB and at_once >= 1,
        "headroom_gb": gpu_memory_gb - per_gpu / GB,
    }


# ---------------------------------------------------------------------------- a run's batch against this machine

HOST_BYTES_PER_ROLLOUT_ROW = 16_000
"""Host memory a rollout row holds beyond the tensors plan() counts: its prompt and sampled tokens, log-probs and
entropies as Python lists, the engine's per-sequence state, the reward's inputs. Measured as the peak resident memory
of one demo iteration (ppo-train --rollout_batch_size B --iterations 1) from B = 512 to 8,192: 22 to 31 kB a row
(responses of 12 and 36 tokens alike); this is a lower bound under that, so that a batch refused for it is one that
cannot run."""


def available_memory(device) -> tuple[float, str]:
    """(bytes, where they were read) that a run on `device` can still take: a GPU's free memory
    (torch.cuda.mem_get_info), else the host's MemAvailable (/proc/meminfo; elsewhere the free pages, os.sysconf)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0]), f"free on {torch.cuda.get_device_name(device)}"
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kb * 1024.0, "MemAvailable"
    except (OSError, StopIteration, ValueError):
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "free memory"


def check_run_fits(cfg, policy_path, prompt_len: int, processes: int, device):
    """PlanError unless the run's rollout and update fit the memory this machine has now (before any model is built),
    by plan()'s estimate for the run's config: on a GPU its per-GPU total against the device's free memory; on the CPU,
    where the single-process loop computes in float32 (so the estimate is a lower bound), the same total less the CUDA
    overhead, plus HOST_BYTES_PER_ROLLOUT_ROW a row, for every process on the machine against MemAvailable. The line
    says the estimate, the memory there is, and the keys that lower it. A model the planner cannot read is left to
    the loader's own message."""
    from ..config import rollout_rows, uses_critic  # here: the planner's command line does not need the trainer's config

    available, where = available_memory(device)
    rows = rollout_rows(cfg)
    try:
        p = plan(policy_path, critic=(cfg.critic or policy_path) if uses_critic(cfg) else "", reference=cfg.reference,
                 teacher=cfg.teacher,
                 reward_model=cfg.reward_model if os.path.exists(os.path.expanduser(cfg.reward_model or "-")) else "",
                 gpus=processes, gpu_memory_gb=max(available, 1.0) / GB, prompt_len=max(prompt_len, 1),
                 response_len=cfg.max_new_tokens, rollout_batch=rows,
                 micro_batch=cfg.micro_batch_size or 1,  # 0: packed micro-batches, micro_batch not read
                 micro_batch_tokens=cfg.micro_batch_tokens, lora_rank=cfg.lora_rank,
                 sharding="fsdp" if cfg.parallel == "fsdp" and processes > 1 else "none",
                 offload=cfg.cpu_offload and cfg.parallel == "fsdp" and processes > 1,
                 activation_checkpointing=cfg.gradient_checkpointing, critic_free=not uses_critic(cfg),
                 rollout_engine=cfg.rollout_engine,
                 kv_cache_gb=cfg.rollout_kv_cache_gb or (None if device.type == "cuda" else _cpu_kv_cache_gb()))
    except (PlanError, CheckpointError, OSError, KeyError, ValueError, TypeError):
        return
    need = p["per_gpu_gb"] * GB
    if device.type != "cuda":  # one machine holds every process, and each one's rows as Python objects too
        need = processes * (need - CUDA_OVERHEAD_BYTES + HOST_BYTES_PER_ROLLOUT_ROW * p["rollout_batch_per_gpu"])
    if need > available:
        raise PlanError(f"config key 'rollout_batch_size': a rollout of {rows} sequences of up to {prompt_len} + "
                        f"{cfg.max_new_tokens} tokens and its update need about {need / GB:.1f} GB (ppo-plan's "
                        f"estimate), and this machine has {available / GB:.1f} GB ({where}); lower rollout_batch_size "
                        f"or n_samples_per_prompt, max_new_tokens, micro_batch_size or micro_batch_tokens")


def _cpu_kv_cache_gb():
    from ..engine.rollout_engine import CPU_KV_CACHE_GB  # the engine's CPU pool budget (GiB), an upper bound

    return CPU_KV_CACHE_GB


# ---------------------------------------------------------------------------- the command line

def _fmt_params(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_plan(p: dict) -> str:
    """The human-readable table."""
    mode = (f"LoRA rank {p['lora_rank']}" if p["lora_rank"]
            else f"full fine-tuning (mixed-precision AdamW, {BYTES_PER_TRAINABLE_PARAM} B/param)")
    extras = [p["sharding"] if p["sharding"] != "none" else ("DDP" if p["gpus"] > 1 else "one process")]
    if p["offload"]:
        extras.append("CPU offload")
    if p["activation_checkpointing"]:
        extras.append("activation checkpointing")
    if p["critic_free"]:
        extras.append("no critic")
    micro_batch = (f"micro-batch {p['micro_batch_tokens']} tokens per GPU, packed" if p["micro_batch_tokens"]
                   else f"micro-batch {p['micro_batch']} per GPU")
    lines = [
        f"{p['gpus']} GPU(s) x {p['gpu_memory_gb']:g} GB; prompt {p['prompt_len']} + response {p['response_len']} tokens; "
        f"rollout batch {p['rollout_batch']} ({p['rollout_batch_per_gpu']} per GPU), {micro_batch}",
        f"{mode}; {', '.join(extras)}",
        "",
        f"{'role':<13}{'model':<11}{'params':>9}{'trainable':>11}{'weights':>9}{'grads':>8}{'optim':>8}"
        f"{'state':>8}{'activ.':>8}   (GB per GPU)",
    ]
    for role, r in p["roles"].items():
        act = f"{r['activation_gb']:8.2f}" if "activation_gb" in r else f"{'-':>8}"
        trainable = _fmt_params(r["trainable_params"]) if r["trainable"] else "frozen"
        lines.append(f"{role:<13}{r['model']:<11}{_fmt_params(r['params']):>9}{trainable:>11}{r['weight_gb']:9.2f}"
                     f"{r['grad_gb']:8.2f}{r['optimizer_gb']:8.2f}{r['train_state_gb']:8.2f}{act}"
                     + (f"   {r['note']}" if "note" in r else ""))
    lines += [
        "",
        f"model state, all roles          {p['model_state_gb']:9.2f} GB"
        + (f"   (+ {p['cpu_offload_gb']:.2f} GB in CPU memory)" if p["offload"] else ""),
    ]
    if p["sharding"] == "fsdp":
        lines.append(f"FSDP gather working set         {p['fsdp_gather_gb']:9.2f} GB")
    lines += [
        f"rollout phase                   {p['rollout_phase_gb']:9.2f} GB   (KV "
        + ("cache" if p["rollout_engine"] == "padded" else "pool") + f" {p['kv_cache_gb']:.2f} + "
        f"generation {p['generation_working_set_gb']:.2f}; scoring {p['scoring_working_set_gb']:.2f})",
    ]
    if p["rollout_engine"] == "paged":
        T = p["prompt_len"] + p["response_len"]
        lines.append(f"KV pool holds                   {p['sequences_at_once']:9d} of {p['rollout_batch_per_gpu']} "
                     f"sequences of {T} tokens at once ({p['kv_sequence_gb']:.3f} GB each; the rest decode as "
                     "others finish)")
    if p["micro_batch_tokens"]:
        T = p["prompt_len"] + p["response_len"]
        sequences = f"{p['micro_batch']:9d} sequence" + ("s" if p["micro_batch"] > 1 else "")
        lines.append(f"micro-batch holds               {sequences} of {T} tokens "
                     + (f"({p['micro_batch'] * T} of its {p['micro_batch_tokens']} tokens; shorter ones pack more)"
                        if T <= p["micro_batch_tokens"] else f"(longer than its {p['micro_batch_tokens']} tokens: "
                        "each runs alone)"))
    lines += [
        f"training phase (activations)    {p['training_phase_gb']:9.2f} GB   "
        + ("(the policy's)" if p["critic_free"] else "(the larger of policy and critic)"),
        f"rollout buffers + CUDA overhead {p['rollout_buffers_gb'] + p['cuda_overhead_gb']:9.2f} GB",
        f"per GPU                         {p['per_gpu_gb']:9.2f} GB of {p['gpu_memory_gb']:g}: "
        + ("fits" if p["fits"] else "does NOT fit") + f" ({p['headroom_gb']:+.2f} GB)",
    ]
    return "\n".join(lines)


def build_parser():
    parser = argparse.ArgumentParser(prog="ppo-plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", help="policy checkpoint directory or its config.json")
    parser.add_argument("--critic", default="", help="critic checkpoint or config.json (default: the policy's backbone)")
    parser.add_argument("--reference", default="", help="reference checkpoint or config.json (default: the policy)")
    parser.add_argument("--reward-model", default="", help="reward model checkpoint or config.json (default: none)")
    parser.add_argument("--teacher", default="", help="on-policy distillation's teacher checkpoint or config.json "
                        "(default: none)")
    parser.add_argument("--config", default="", help="a ppo-train TOML: policy, reference, critic, "
                        "rollout_batch_size x n_samples_per_prompt, max_new_tokens, micro_batch_size or "
                        "micro_batch_tokens, gradient_checkpointing, adv_estimator (no critic unless gae) "
                        "(flags given here win)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs in the run (default 1)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU, GB = 1e9 bytes (default 80)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens P (default 512)")
    parser.add_argument("--response-len", type=int, default=None, help="response tokens R (default 1024)")
    parser.add_argument("--rollout-batch", type=int, default=None, help="rollouts per iteration, all GPUs (default 64)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward per GPU "
                        "(default 4; given alone, it plans padded micro-batches even where the --config packs them)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="packed micro-batches of at most N real "
                        "tokens per GPU (the run's micro_batch_tokens; 0 = padded micro-batches of --micro-batch)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank r (0 = full fine-tuning)")
    parser.add_argument("--sharding", default="none", choices=("none", "fsdp"), help="none (replicas, DDP) or fsdp")
    parser.add_argument("--offload", action="store_true", help="FSDP CPU offload of the sharded state")
    parser.add_argument("--activation-checkpointing", action="store_true", default=None,
                        help="recompute each block's activations in the backward pass")
    parser.add_argument("--no-critic", action="store_true", default=None, help="critic-free estimator "
                        "(grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline): no critic model")
    parser.add_argument("--rollout-engine", default=None, choices=("paged", "padded"),
                        help="paged (ppo_core.engine, the default) or padded (ppo_core.generate's KV cache)")
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="the paged engine's KV pool in GiB (default: the run's rollout_kv_cache_gb, else 80%% "
                        "of the memory free when the rollout starts)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def dashed_options(argv: list[str]) -> list[str]:
    """argv with `_` turned into `-` in every option name (`--gpu_memory_gb=80` -> `--gpu-memory-gb=80`), so the
    planner takes ppo-train's underscore spelling too. Values are left alone, and everything after a bare `--`."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(dashed_options(list(argv)))
    values = dict(policy=args.policy, critic=args.critic, reference=args.reference, teacher=args.teacher, gpus=args.gpus,
                  prompt_len=args.prompt_len, response_len=args.response_len, rollout_batch=args.rollout_batch,
                  micro_batch=args.micro_batch, micro_batch_tokens=args.micro_batch_tokens,
                  activation_checkpointing=args.activation_checkpointing, critic_free=args.no_critic,
                  rollout_engine=args.rollout_engine, kv_cache_gb=args.kv_cache_gb)
    defaults = dict(gpus=1, prompt_len=512, response_len=1024, rollout_batch=64, micro_batch=4, micro_batch_tokens=0,
                    activation_checkpointing=False, critic_free=False, rollout_engine="paged", kv_cache_gb=None)
    try:
        if args.config:
            from ..config import ConfigError, build_config, fit_batch_sizes, load_toml, rollout_rows, uses_critic
            try:
                run = build_config(load_toml(args.config), toml_path=args.config)
            except ConfigError as e:
                raise PlanError(str(e)) from None
            defaults.update(policy=run.policy or DEMO_CHECKPOINT, critic=run.critic, reference=run.reference,
                            teacher=run.teacher,
                            rollout_batch=rollout_rows(run), response_len=run.max_new_tokens,
                            # packed (micro_batch_size 0, unread): what padded ones would be, for --micro-batch-tokens 0
                            micro_batch=run.micro_batch_size or fit_batch_sizes(
                                dataclasses.replace(run, micro_batch_tokens=0)).micro_batch_size,
                            micro_batch_tokens=run.micro_batch_tokens,
                            activation_checkpointing=run.gradient_checkpointing,
                            critic_free=not uses_critic(run), rollout_engine=run.rollout_engine,
                            kv_cache_gb=run.rollout_kv_cache_gb or None)
        if args.micro_batch is not None and args.micro_batch_tokens:
            raise PlanError("--micro-batch counts padded sequences, --micro-batch-tokens sizes packed micro-batches: "
                            "give one")
        if args.micro_batch is not None:
            defaults["micro_batch_tokens"] = 0  # a padded micro-batch asked for beats the config's token budget
        values = {k: (v if v not in (None, "") else defaults.get(k, v)) for k, v in values.items()}
        if values["critic_free"] and not args.critic:
            values["critic"] = ""  # a critic named in the TOML does not count in a critic-free run
        if not values["policy"]:
            raise PlanError("--policy is required (a checkpoint directory or config.json), or --config with a policy")
        result = plan(values.pop("policy"), reward_model=args.reward_model, gpu_memory_gb=args.gpu_memory_gb,
                      lora_rank=args.lora_rank, sharding=args.sharding, offload=args.offload, **values)
    except (PlanError, CheckpointError, OSError, KeyError) as e:
        message = f"config is missing the field {e}" if isinstance(e, KeyError) else str(e)
        print(f"ppo-plan: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
