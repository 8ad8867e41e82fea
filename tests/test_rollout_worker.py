"""How a rollout's rows go from the rollout workers to the trainers (ppo_core.run.rollout_worker.trainer_shares), on
hand-written parts: the runs themselves are in tests/test_distributed.py."""
import json

import torch

from ppo_core.rollout import Sampled, sampled_from_state, sampled_state
from ppo_core.run.checkpoint import state_lists
from ppo_core.run.rollout_worker import (pack_message, trainer_shares, unpack_message, updated_names, weight_buckets,
                                     wire_dtypes)

PAD = 7


def part(first_row, responses, generate_s=1.0):
    """A worker's rows: responses as token lists, all right-padded with PAD to the part's widest."""
    width = max(map(len, responses))
    n = len(responses)
    sampled = Sampled(
        rows=[{"prompt": f"p{first_row + i}"} for i in range(n)], prompts=[f"p{first_row + i}" for i in range(n)],
        responses=[f"r{first_row + i}" for i in range(n)],
        prompt_ids=torch.tensor([[first_row + i, 1] for i in range(n)]), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        tokens=torch.tensor([r + [PAD] * (width - len(r)) for r in responses]),
        response_mask=torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses]),
        ended=torch.tensor([True] * n), scores=torch.tensor([float(first_row + i) for i in range(n)]),
        reward_metrics={"reward/fn": torch.tensor([0.5 * (first_row + i) for i in range(n)])},
        reward_texts={"why": [f"w{first_row + i}" for i in range(n)]}, generate_s=generate_s)
    group = torch.tensor([(first_row + i) // 2 for i in range(n)])
    return sampled_state(sampled, group, {"reward/fn": 1.5, "time/generate_s": generate_s}, lists=False)


def tokens(state):
    return state["tensors"]["tokens"]["values"].tolist()


def test_one_trainer_takes_every_worker_s_rows_padded_to_the_widest():
    parts = [part(0, [[1, 2, 3], [4]], generate_s=2.0), part(2, [[5, 6], [8, 9]], generate_s=3.0)]
    [whole] = trainer_shares(parts, 1, PAD)
    assert tokens(whole) == [[1, 2, 3], [4, PAD, PAD], [5, 6, PAD], [8, 9, PAD]]
    assert whole["tensors"]["response_mask"]["values"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]
    assert whole["tensors"]["prompt_ids"]["values"].tolist() == [[0, 1], [1, 1], [2, 1], [3, 1]]
    assert whole["prompts"] == ["p0", "p1", "p2", "p3"] and whole["reward_texts"] == {"why": ["w0", "w1", "w2", "w3"]}
    assert whole["reward_metrics"]["reward/fn"]["values"].tolist() == [0.0, 0.5, 1.0, 1.5]
    assert whole["group"]["values"].tolist() == [0, 0, 1, 1]
    assert whole["generate_s"] == 3.0 and whole["stats"] == {"reward/fn": 1.5, "time/generate_s": 3.0}
    sampled, group, _ = sampled_from_state(whole, "cpu")  # it loads as one rollout
    assert sampled.tokens.shape == (4, 3) and sampled.response_mask.dtype == torch.float32
    assert torch.equal(group, torch.tensor([0, 0, 1, 1]))


def test_as_many_trainers_as_workers_take_the_parts_as_they_are():
    parts = [part(0, [[1, 2, 3], [4]]), part(2, [[5, 6], [8, 9]])]
    shares = trainer_shares(parts, 2, PAD)
    # each part whole, at its own width (no padding to the other part's)
    assert [tokens(s) for s in shares] == [[[1, 2, 3], [4, PAD, PAD]], [[5, 6], [8, 9]]]
    assert [s["prompts"] for s in shares] == [["p0", "p1"], ["p2", "p3"]]


def test_more_trainers_than_workers_cut_a_part_at_its_own_width():
    parts = [part(0, [[1, 2, 3], [4]]), part(2, [[5, 6], [8, 9]])]
    shares = trainer_shares(parts, 4, PAD)
    assert [tokens(s) for s in shares] == [[[1, 2, 3]], [[4, PAD, PAD]], [[5, 6]], [[8, 9]]]
    assert [s["prompts"] for s in shares] == [["p0"], ["p1"], ["p2"], ["p3"]]
    assert [s["group"]["values"].tolist() for s in shares] == [[0], [0], [1], [1]]


def test_fewer_trainers_than_workers_merge_the_parts_they_cover():
    parts = [part(0, [[1]]), part(1, [[2, 3]]), part(2, [[4, 5, 6]]), part(3, [[7]])]
    shares = trainer_shares(parts, 2, PAD)
    assert [tokens(s) for s in shares] == [[[1, PAD], [2, 3]], [[4, 5, 6], [7, PAD, PAD]]]


def test_the_weights_travel_in_buckets_of_one_wire_dtype_and_about_the_bucket_size(monkeypatch):
    import ppo_core.run.rollout_worker as rollout_worker

    monkeypatch.setattr(rollout_worker, "BUCKET_BYTES", 64)
    f32, bf16 = torch.float32, torch.bfloat16
    tensors = [torch.zeros(8), torch.zeros(8), torch.zeros(4), torch.zeros(20), torch.zeros(20), torch.zeros(40)]
    dtypes = [f32, f32, f32, bf16, bf16, bf16]
    # 32 + 32 bytes fill a bucket; 16 more would pass 64; a new dtype starts a bucket (20 bf16 = 40 bytes: two do
    # not fit one); one tensor over the size alone
    assert [[t.numel() for t, _ in b] for b in weight_buckets(tensors, dtypes)] == [[8, 8], [4], [20], [20], [40]]


def test_under_autocast_the_block_linears_travel_in_bf16_and_the_rest_as_it_is():
    from ppo_core.models.model import load_model
    from ppo_core.train import DEMO_CHECKPOINT

    policy = load_model(DEMO_CHECKPOINT)
    names = list(policy.state_dict())
    wire = wire_dtypes(policy, torch.bfloat16)
    assert list(wire) == names
    bf16 = sorted(n for n, d in wire.items() if d == torch.bfloat16)
    assert bf16 and all(n.startswith("model.layers.") and n.endswith("_proj.weight") for n in bf16)
    assert all(wire[n] == torch.float32 for n in names if "norm" in n or "embed" in n or "lm_head" in n)
    assert len(bf16) == 7 * policy.args.num_hidden_layers  # q, k, v, o, gate, up, down in every block
    assert wire_dtypes(policy, None) == {n: t.dtype for n, t in policy.state_dict().items()}


def test_a_message_packs_its_tensors_apart_from_its_header_and_unpacks_equal():
    state = part(0, [[1, 2, 3], [4]])
    message = {"rollout": state, "stream": {"position": 3}, "worker_idle_s": 0.5, "empty": torch.zeros(0, 2)}
    header, tensors = pack_message(message)
    assert b"p0" in header and len(tensors) == 9  # 6 tensors of the rollout, its reward metric, group, the empty one
    back = unpack_message(header, lambda i, flat: flat.copy_(tensors[i]))
    assert back["stream"] == {"position": 3} and back["worker_idle_s"] == 0.5 and back["empty"].shape == (0, 2)
    for name, t in state["tensors"].items():
        if t is None:
            assert back["rollout"]["tensors"][name] is None
        else:  # dtype and values exactly
            assert back["rollout"]["tensors"][name]["values"].dtype == t["values"].dtype
            assert torch.equal(back["rollout"]["tensors"][name]["values"], t["values"])
    assert back["rollout"]["rows"] == state["rows"] and back["rollout"]["reward_texts"] == state["reward_texts"]


def test_a_checkpoint_s_pending_rollout_as_lists_merges_as_the_tensors_do():
    parts = [part(0, [[1, 2, 3], [4]]), part(2, [[5, 6], [8, 9]])]
    from_lists = trainer_shares([json.loads(json.dumps(state_lists(p))) for p in parts], 1, PAD)
    [whole] = trainer_shares(parts, 1, PAD)
    assert tokens(from_lists[0]) == tokens(whole)
    assert from_lists[0]["tensors"]["ended"]["values"].dtype == torch.bool


def test_with_lora_only_the_adapters_travel_after_each_update():
    from ppo_core.models.lora import add_lora
    from ppo_core.models.model import load_model
    from ppo_core.train import DEMO_CHECKPOINT

    policy = load_model(DEMO_CHECKPOINT)
    assert updated_names(policy) == [n for n, _ in policy.named_parameters()]  # everything trains
    add_lora(policy, 4)
    updated = updated_names(policy)
    assert updated and all(n.endswith(("lora_A", "lora_B")) for n in updated)
    assert len(updated) == 2 * 7 * policy.args.num_hidden_layers  # A and B on the 7 linears of every block
