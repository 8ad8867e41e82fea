"""Packed micro-batches: the training passes without padding (config micro_batch_tokens > 0).

    bins = token_budget_micro_batches(rows, lengths, cfg.micro_batch_tokens)  # lists of rows, each <= the budget
    shares = balanced_split(rows, lengths, world)                            # one list of rows per process
    pack = pack_rows(input_ids[rows], host_mask[rows], prompt_len)           # the rows' real tokens, one after another
    hidden = model(pack.input_ids, packed=pack.args)                         # [N, H] (ppo_core.models.model.forward_packed)
    hidden_responses = unpack_rows(hidden, pack.response_index)             # [b, R, H], what the padded heads read

The experience stays padded ([B, P+R] tokens, [B, R] per-token tensors: ppo_core.rollout) and so does every piece of
math on it (ppo_core.algo); only the model's forward runs packed: the rows' real tokens concatenated, positions
restarting at 0 for each row, attention within each row (ppo_core.models.model.packed_attention). The hidden states that
predict the response tokens are then laid out as the padded heads read them, zeros where a row has no token, so the
log-prob and loss heads, and every loss_agg mode, are unchanged; the fused heads compute only rows that are in the
loss (ppo_kernels skips label -100 and weight-0 rows), the reference heads only rows with a label (rollout).

Index tensors are built on the host from a host copy of the attention mask (one copy per rollout), so packing a
micro-batch reads nothing back from a GPU.
"""
from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """b rows of a padded batch, packed: N real tokens."""

    input_ids: torch.Tensor  # [N] int64, the rows' real tokens one row after another (on the model's device)
    positions: torch.Tensor  # [N] int64, each token's place among its row's real tokens
    seq_lens: list  # b host ints: each row's real-token count (sum N)
    response_index: torch.Tensor  # [b, R] int64 into N + 1 rows: the token that predicts response token j of row i; N = none

    @property
    def args(self):
        """What CausalLM / ScoreModel.forward(packed=...) take."""
        return self.positions, self.seq_lens


def pack_rows(input_ids, host_mask, prompt_len) -> Packed:
    """Pack rows of a padded batch. input_ids [b, P+R] on the model's device; host_mask [b, P+R] bool on the CPU,
    True on real tokens (any layout: left-padded prompts, right-padded responses, holes); prompt_len P: response
    token j of a row sits in column P + j and is predicted by column P - 1 + j."""
    b, T = host_mask.shape
    flat = host_mask.reshape(-1).nonzero().squeeze(1)  # [N] the real tokens' places in the flattened batch
    N = flat.numel()
    seq_lens = host_mask.sum(-1).tolist()
    positions = (host_mask.long().cumsum(-1) - 1)[host_mask]  # [N]
    place = torch.full((b, T), N, dtype=torch.long)  # [b, P+R]: each real token's row in the pack, N for a pad
    place[host_mask] = torch.arange(N)
    device = input_ids.device
    return Packed(input_ids.reshape(-1)[flat.to(device)], positions.to(device), seq_lens,
                  place[:, prompt_len - 1 : -1].to(device))


def unpack_rows(packed_rows, index):
    """packed_rows [N, ...] -> [*index.shape, ...]: row index[i, j] of packed_rows, zeros where index is N.
    Differentiable (its backward adds each gradient row back to the packed row it came from)."""
    padded = torch.cat([packed_rows, packed_rows.new_zeros((1, *packed_rows.shape[1:]))])  # [N + 1, ...]
    return padded[index]


def token_budget_micro_batches(rows, lengths, budget):
    """Rows packed into micro-batches of at most `budget` tokens, first-fit decreasing: the longest row first, each
    row into the first micro-batch it fits in (a row longer than the budget gets one of its own). rows: row ids;
    lengths: their token counts (host ints). -> lists of row ids, each micro-batch's in the order they went in.
    Deterministic: ties are taken in the order of `rows`."""
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    bins, room = [], []
    for i in order:
        for k, free in enumerate(room):
            if lengths[i] <= free:
                bins[k].append(rows[i])
                room[k] -= lengths[i]
                break
        else:
            bins.append([rows[i]])
            room.append(budget - lengths[i])
    return bins


def balanced_split(rows, lengths, world):
    """Rows split across `world` processes so that their token counts are close: the longest row first, each to the
    process with the fewest tokens so far (greedy longest-processing-time; ties to the lowest rank). -> one list of
    row ids per process, each in the order of `rows`. Every process computes the same split from the same lengths."""
    load, shares = [0] * world, [[] for _ in range(world)]
    position = {row: i for i, row in enumerate(rows)}
    for i in sorted(range(len(rows)), key=lambda i: -lengths[i]):
        p = min(range(world), key=lambda r: load[r])
        shares[p].append(rows[i])
        load[p] += lengths[i]
    return [sorted(share, key=position.__getitem__) for share in shares]
