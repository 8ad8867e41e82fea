"""The forward heads both passes over the experience run: the scoring pass (ppo_core.rollout) and
the update (ppo_core.update) read log-probs, entropies and values through these, so the first
minibatch's ratio is 1 up to the order of a log-sum-exp (as measured:
docs/update.md#the-first-ratio-is-1-up-to-rounding).

    # [B, R], IGNORE_INDEX off the response
    labels = response_labels(input_ids, response_mask, prompt_len)
    logprobs, entropy = response_logprobs(policy, input_ids, attention_mask, response_mask,
                                          prompt_len, T, fused)  # [B, R] each
    values = response_values(critic, input_ids, attention_mask, prompt_len)  # [B, R]
    # head(hidden [B, R, H], weight [V, H])
    out = response_head(policy, input_ids, attention_mask, prompt_len, head)

B sequences, prompts left-padded to P, responses right-padded to R; packed
(ppo_core.data.packing.Packed): the forward runs on the rows' real tokens only and the heads see the
same [B, R, ...] layout.
"""
import torch

import ppo_kernels

from .models import lora
from .data.packing import unpack_rows

IGNORE_INDEX = -100  # label of a position that has no log-prob (padding, tool output)


def micro_batches(n, size, order=None):
    """Index tensors of consecutive chunks of `order` (default 0..n-1, on the CPU: indexing a CUDA
    tensor with a CPU index tensor is allowed and copies the index over)."""
    order = torch.arange(n) if order is None else order
    return [order[i : i + size] for i in range(0, n, size)]


def response_logprobs(policy, input_ids, attention_mask, response_mask, prompt_len, temperature,
                      fused, packed=None):
    """Log-probs and entropy of the response tokens under `policy`, at `temperature`.

    input_ids, attention_mask: [B, P+R]; response_mask: [B, R]; packed: see response_head.
    Returns logprobs, entropy: [B, R] float32 (0 where response_mask is 0). `fused` picks
    ppo_kernels' LM-head-fused path, which never forms the [B*R, V] logits; the reference path is
    log_softmax + gather on full logits.
    """
    labels = response_labels(input_ids, response_mask, prompt_len)  # [B, R]

    def head(hidden, weight):
        B, R, H = hidden.shape
        if fused:
            logprobs, entropy = ppo_kernels.linear_token_logprobs(
                hidden.reshape(B * R, H), weight, labels.reshape(B * R), temperature=temperature,
                return_entropy=True)
            return logprobs.view(B, R), entropy.view(B, R)
        logits = torch.nn.functional.linear(hidden, weight)  # [B, R, V]
        return ppo_kernels.token_logprobs_reference(logits, labels, temperature=temperature,
                                                    return_entropy=True)

    return response_head(policy, input_ids, attention_mask, prompt_len, head, packed)


def reference_logprobs(policy, reference, *args, packed=None):
    """response_logprobs under the reference. With LoRA and no separate reference checkpoint the
    reference IS the policy object: its base weights, computed with the adapters switched off."""
    if reference is policy:
        with lora.adapters_disabled(policy):
            return response_logprobs(policy, *args, packed=packed)
    return response_logprobs(reference, *args, packed=packed)


def response_labels(input_ids, response_mask, prompt_len):
    """The response tokens as labels [B, R]: IGNORE_INDEX where response_mask is 0."""
    return input_ids[:, prompt_len:].masked_fill(response_mask == 0, IGNORE_INDEX)


def response_head(policy, input_ids, attention_mask, prompt_len, head, packed=None):
    """Run `policy` and hand head(hidden [B, R, H], lm_head_weight [V, H]) the hidden states at the
    positions that predict the response tokens; returns what `head` returns. The head runs inside
    the model's forward (CausalLM's head_fn), so it sees the full LM-head weight under FSDP and goes
    through DDP's wrapper. packed (ppo_core.data.packing.Packed, these rows packed): the forward
    runs on the rows' real tokens only, and the head gets the same [B, R, H] layout, zeros where a
    row has no response token."""
    if packed is not None:
        return policy(packed.input_ids, None, packed=packed.args,
                      head_fn=lambda hidden, weight: head(
                          unpack_rows(hidden, packed.response_index), weight))
    return policy(input_ids, attention_mask,
                  head_fn=lambda hidden, weight: head(hidden[:, prompt_len - 1 : -1], weight))


def response_values(critic, input_ids, attention_mask, prompt_len, packed=None):
    """V(s_t) for each response token t: the critic read at the position that predicts it. -> [B, R]
    (with packed, 0 where a row has no response token)."""
    if packed is not None:
        return unpack_rows(critic(packed.input_ids, None, packed=packed.args),
                           packed.response_index)
    return critic(input_ids, attention_mask)[:, prompt_len - 1 : -1]
