"""ppo-plan (ppo_core/run/plan.py): the seed figures from the real architecture configs, the JSON schema, fits,
FSDP, offload, LoRA, and the activation and KV-cache estimates against what a CPU run actually holds.

The activation checks train one micro-batch with the loop's own functions (heads.response_logprobs +
algo.policy_loss, then heads.response_values + algo.value_loss) and compare the planner's formulas, evaluated
for float32 and the CPU log-prob path, with (1) the bytes autograd saves, summed over distinct storages through
torch.autograd.graph.saved_tensors_hooks, and (2) the peak resident memory of a fresh process over the
forward + backward (VmHWM reset through /proc/self/clear_refs; glibc's mmap threshold pinned so freed tensors
leave RSS). Run this file as a script to print the measurement for one shape.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from ppo_core import algo, train
from ppo_core.run import plan
from ppo_core.models.model import KVCache, ModelArgs, count_parameters, load_model, load_score_model
from ppo_core.data.packing import pack_rows
from ppo_core.heads import response_logprobs, response_values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs", "models")
needs_configs = pytest.mark.skipif(not os.path.isdir(CONFIGS), reason=f"no architecture configs at {CONFIGS}")


def config(name):
    return os.path.join(CONFIGS, name, "config.json")


def run_json(capsys, *argv) -> dict:
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------------- the seed figures

@needs_configs
@pytest.mark.parametrize("name, published_params, published_state_gb", [
    ("Qwen3-0.6B", 0.596e9, 10.7),
    ("Qwen3-1.7B", 1.72e9, 31.0),
    ("Qwen3-4B", 4.02e9, 72.4),
])
def test_seed_figures_full_finetuning_model_state(capsys, name, published_params, published_state_gb):
    result = run_json(capsys, "--policy", config(name))
    policy = result["roles"]["policy"]
    assert abs(policy["params"] - published_params) / published_params < 0.001
    assert policy["train_state_gb"] == pytest.approx(18 * policy["params"] / 1e9, rel=1e-12)
    assert abs(policy["train_state_gb"] - published_state_gb) / published_state_gb < 0.01
    # the split that makes 18 B/param: 4 + 2 weights, 4 gradients, 8 AdamW
    assert policy["weight_gb"] * 1e9 == pytest.approx(6 * policy["params"])
    assert policy["grad_gb"] * 1e9 == pytest.approx(4 * policy["params"])
    assert policy["optimizer_gb"] * 1e9 == pytest.approx(8 * policy["params"])
    # the frozen reference: bf16 weights only
    reference = result["roles"]["reference"]
    assert reference["train_state_gb"] * 1e9 == pytest.approx(2 * reference["params"])
    assert reference["grad_gb"] == reference["optimizer_gb"] == 0


# the parameter table of configs/models/README.md
PUBLISHED_PARAMS = {"Qwen3-0.6B": 0.596e9, "Qwen3-1.7B": 1.721e9, "Qwen3-4B": 4.023e9, "Qwen3-8B": 8.191e9,
                    "OLMo-1B-0724-hf": 1.280e9, "SmolLM2-135M": 0.135e9, "SmolLM2-360M": 0.362e9}


@needs_configs
@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_every_seed_config_plans_with_its_published_parameter_count(name):
    path = os.path.dirname(config(name))  # a checkpoint directory works as well as its config.json
    try:
        ModelArgs.from_hf_config(json.load(open(config(name))))
    except ValueError as e:
        pytest.skip(f"{name} is not supported by ppo_core.models.model yet: {e}")
    result = plan.plan(path)
    assert result["roles"]["policy"]["params"] == count_parameters(path)
    # the table gives three decimals of billions: within one unit of the last digit
    assert abs(result["roles"]["policy"]["params"] - PUBLISHED_PARAMS[name]) <= 0.001e9


# ---------------------------------------------------------------------------- schema and decisions

@needs_configs
def test_json_schema_and_the_total_is_the_sum_of_its_parts(capsys):
    result = run_json(capsys, "--policy", config("Qwen3-0.6B"), "--reward-model", config("Qwen3-0.6B"))
    assert set(result["roles"]) == {"policy", "reference", "critic", "reward_model"}
    for role, entry in result["roles"].items():
        assert isinstance(entry["params"], int) and entry["params"] > 0
        for key in ("weight_gb", "grad_gb", "optimizer_gb", "train_state_gb"):
            assert isinstance(entry[key], float), (role, key)
        assert entry["trainable"] is (role in ("policy", "critic"))
        assert entry["train_state_gb"] == pytest.approx(entry["weight_gb"] + entry["grad_gb"] + entry["optimizer_gb"])
    assert result["roles"]["critic"]["model"] == result["roles"]["reward_model"]["model"] == "ScoreModel"
    # a ScoreModel is the backbone and a 1-output head: the tied LM head is gone, H parameters are added
    assert result["roles"]["critic"]["params"] == result["roles"]["policy"]["params"] + 1024
    for role in ("policy", "critic"):
        assert result["roles"][role]["activation_gb"] > 0
    assert isinstance(result["per_gpu_gb"], float) and isinstance(result["fits"], bool)
    assert result["micro_batch_tokens"] == 0 and result["micro_batch"] == 4  # padded unless a token budget is given
    parts = (result["model_state_gb"] + result["fsdp_gather_gb"] + max(result["rollout_phase_gb"], result["training_phase_gb"])
             + result["rollout_buffers_gb"] + result["cuda_overhead_gb"])
    assert result["per_gpu_gb"] == pytest.approx(parts)
    assert result["model_state_gb"] == pytest.approx(sum(r["train_state_gb"] for r in result["roles"].values()))
    assert result["fits"] is (result["per_gpu_gb"] <= result["gpu_memory_gb"])


@needs_configs
def test_a_teacher_is_one_more_frozen_causal_lm(capsys, tmp_path):
    """--teacher (on-policy distillation): a frozen CausalLM role whose weights add FROZEN bytes a parameter (bf16) to
    the model state, and whose forward counts in the scoring working set; ppo-train's config brings it too."""
    without = run_json(capsys, "--policy", config("Qwen3-0.6B"), "--no-critic")
    with_teacher = run_json(capsys, "--policy", config("Qwen3-0.6B"), "--no-critic", "--teacher", config("Qwen3-1.7B"))
    teacher = with_teacher["roles"]["teacher"]
    assert teacher["model"] == "CausalLM" and teacher["trainable"] is False and teacher["trainable_params"] == 0
    assert teacher["params"] == run_json(capsys, "--policy", config("Qwen3-1.7B"))["roles"]["policy"]["params"]
    assert teacher["weight_gb"] == pytest.approx(2 * teacher["params"] / 1e9) and teacher["grad_gb"] == 0.0
    assert with_teacher["model_state_gb"] == pytest.approx(without["model_state_gb"] + teacher["weight_gb"])
    assert with_teacher["scoring_working_set_gb"] > without["scoring_working_set_gb"]  # the larger model's forward
    toml = tmp_path / "distill.toml"
    toml.write_text(f'policy = "{config("Qwen3-0.6B")}"\nteacher = "{config("Qwen3-1.7B")}"\n')
    assert run_json(capsys, "--config", str(toml))["roles"]["teacher"]["params"] == teacher["params"]


@needs_configs
def test_fits_depends_on_gpu_memory_and_count(capsys):
    small = run_json(capsys, "--policy", config("Qwen3-0.6B"))
    assert small["fits"] and 30 < small["per_gpu_gb"] < 80
    assert not run_json(capsys, "--policy", config("Qwen3-0.6B"), "--gpu-memory-gb", "24")["fits"]
    one = run_json(capsys, "--policy", config("Qwen3-4B"))
    assert not one["fits"] and one["per_gpu_gb"] > 150  # 2 x 72.4 GB of model state before anything else
    eight = run_json(capsys, "--policy", config("Qwen3-4B"), "--gpus", "8", "--sharding", "fsdp")
    assert eight["fits"]


@needs_configs
def test_fsdp_divides_the_sharded_state_by_the_gpu_count(capsys):
    base = ["--policy", config("Qwen3-1.7B"), "--sharding", "fsdp"]
    one, two = run_json(capsys, *base, "--gpus", "1"), run_json(capsys, *base, "--gpus", "2")
    n = one["roles"]["policy"]["params"]
    # FSDP keeps no persistent bf16 copy: 16 B/param (fp32 master, grads, AdamW) sharded, then gathered per block
    assert one["roles"]["policy"]["train_state_gb"] * 1e9 == pytest.approx(16 * n)
    for role in ("policy", "reference", "critic"):
        for key in ("weight_gb", "grad_gb", "optimizer_gb", "train_state_gb"):
            assert two["roles"][role][key] == pytest.approx(one["roles"][role][key] / 2), (role, key)
    assert two["model_state_gb"] == pytest.approx(one["model_state_gb"] / 2)
    assert two["fsdp_gather_gb"] == one["fsdp_gather_gb"] > 0
    # without sharding every GPU holds a replica; only the rollouts per GPU halve
    ddp = run_json(capsys, "--policy", config("Qwen3-1.7B"), "--gpus", "2", "--rollout-engine", "padded")
    solo = run_json(capsys, "--policy", config("Qwen3-1.7B"), "--rollout-engine", "padded")
    assert ddp["model_state_gb"] == pytest.approx(solo["model_state_gb"])
    assert ddp["kv_cache_gb"] < 0.51 * solo["kv_cache_gb"]


@needs_configs
def test_offload_moves_the_sharded_state_to_cpu(capsys):
    base = ["--policy", config("Qwen3-1.7B"), "--gpus", "2", "--sharding", "fsdp"]
    on_gpu, offloaded = run_json(capsys, *base), run_json(capsys, *base, "--offload")
    assert offloaded["model_state_gb"] == 0
    assert offloaded["cpu_offload_gb"] == pytest.approx(on_gpu["model_state_gb"])
    assert offloaded["per_gpu_gb"] == pytest.approx(on_gpu["per_gpu_gb"] - on_gpu["model_state_gb"])
    assert plan.main(["--policy", config("Qwen3-1.7B"), "--offload"]) == 2  # offload needs fsdp
    assert "needs --sharding fsdp" in capsys.readouterr().err


@needs_configs
def test_lora_freezes_the_base_and_trains_only_the_adapters(capsys):
    r = 16
    full = run_json(capsys, "--policy", config("Qwen3-0.6B"))
    lora = run_json(capsys, "--policy", config("Qwen3-0.6B"), "--lora-rank", str(r))
    cfg = json.load(open(config("Qwen3-0.6B")))
    H, I, L, hs = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    Dq, Dkv = cfg["num_attention_heads"] * hs, cfg["num_key_value_heads"] * hs
    # r (d_in + d_out) on q, k, v, o, gate, up, down of every block
    adapters = r * L * ((H + Dq) + 2 * (H + Dkv) + (Dq + H) + 2 * (H + I) + (I + H))
    policy, n = lora["roles"]["policy"], lora["roles"]["policy"]["params"]
    assert policy["trainable_params"] == adapters
    assert policy["train_state_gb"] * 1e9 == pytest.approx(2 * n + 18 * adapters)  # bf16 base + trained adapters
    assert lora["roles"]["critic"]["trainable_params"] == adapters + H  # + the score head
    assert lora["roles"]["reference"]["train_state_gb"] == 0  # the base with adapters off, no second copy
    assert lora["model_state_gb"] < 0.25 * full["model_state_gb"]
    assert lora["training_phase_gb"] < full["training_phase_gb"]  # no LM-head gradient, frozen norm weights
    # a separate reference checkpoint is a separate frozen copy again
    separate = run_json(capsys, "--policy", config("Qwen3-0.6B"), "--lora-rank", str(r), "--reference", config("Qwen3-1.7B"))
    assert separate["roles"]["reference"]["train_state_gb"] * 1e9 == pytest.approx(2 * separate["roles"]["reference"]["params"])


@needs_configs
def test_activation_checkpointing_shrinks_the_training_phase(capsys):
    base = ["--policy", config("Qwen3-4B"), "--micro-batch", "8"]
    plain, ckpt = run_json(capsys, *base), run_json(capsys, *base, "--activation-checkpointing")
    assert ckpt["training_phase_gb"] < 0.2 * plain["training_phase_gb"]
    assert ckpt["model_state_gb"] == plain["model_state_gb"]


@needs_configs
@pytest.mark.parametrize("shape", [
    [],  # the policy's activations are the larger: the total drops by exactly the critic's state
    ["--prompt-len", "4096", "--response-len", "16", "--micro-batch", "16", "--rollout-batch", "8"],  # the critic's are
    ["--lora-rank", "16"],
], ids=["policy_peak", "critic_peak", "lora"])
def test_no_critic_counts_no_critic(capsys, shape):
    """--no-critic (grpo, rloo, ...): no critic role; the training phase is the policy's activations; the total is
    smaller by the critic's train state, plus the training phase's drop where the critic's activations were the peak."""
    base = ["--policy", config("Qwen3-0.6B"), *shape]
    with_critic, critic_free = run_json(capsys, *base), run_json(capsys, *base, "--no-critic")
    assert set(with_critic["roles"]) == {"policy", "reference", "critic"}
    assert set(critic_free["roles"]) == {"policy", "reference"} and critic_free["critic_free"] is True
    for role in ("policy", "reference"):
        assert critic_free["roles"][role] == with_critic["roles"][role]
    policy_act = with_critic["roles"]["policy"]["activation_gb"]
    critic_act = with_critic["roles"]["critic"]["activation_gb"]
    assert with_critic["training_phase_gb"] == max(policy_act, critic_act)
    assert critic_free["training_phase_gb"] == policy_act
    critic_state = with_critic["roles"]["critic"]["train_state_gb"]
    assert critic_free["model_state_gb"] == pytest.approx(with_critic["model_state_gb"] - critic_state, rel=1e-12)
    rollout = with_critic["rollout_phase_gb"]
    assert critic_free["rollout_phase_gb"] == rollout  # the critic's scoring forward is the policy's shape here
    drop = critic_state + max(rollout, policy_act, critic_act) - max(rollout, policy_act)
    assert with_critic["per_gpu_gb"] - critic_free["per_gpu_gb"] == pytest.approx(drop, rel=1e-12)
    if shape == []:
        assert drop == critic_state  # not vacuous: the first case is the plain one ...
    elif shape[0] == "--prompt-len":
        assert critic_act > policy_act > rollout  # ... and the second really had the critic at the peak


@needs_configs
def test_no_critic_text_report_and_contradictions(capsys):
    assert plan.main(["--policy", config("Qwen3-0.6B"), "--no-critic"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert "policy" in rows and "reference" in rows and "critic" not in rows
    assert "no critic" in out and "(the policy's)" in out and "larger of policy and critic" not in out
    assert plan.main(["--policy", config("Qwen3-0.6B")]) == 0
    assert "critic" in [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert plan.main(["--policy", config("Qwen3-0.6B"), "--critic", config("Qwen3-1.7B"), "--no-critic"]) == 2
    assert "a critic-free run has no critic" in capsys.readouterr().err
    # FSDP: the parts still add up; the gather working set is the policy's alone
    fsdp = run_json(capsys, "--policy", config("Qwen3-0.6B"), "--gpus", "2", "--sharding", "fsdp", "--no-critic")
    parts = (fsdp["model_state_gb"] + fsdp["fsdp_gather_gb"] + max(fsdp["rollout_phase_gb"], fsdp["training_phase_gb"])
             + fsdp["rollout_buffers_gb"] + fsdp["cuda_overhead_gb"])
    assert "critic" not in fsdp["roles"] and fsdp["per_gpu_gb"] == pytest.approx(parts, rel=1e-12)
    shape = plan.model_shape(json.load(open(config("Qwen3-0.6B"))), score=False)
    assert fsdp["fsdp_gather_gb"] * 1e9 == 2 * (shape["root"] + 3 * shape["block"])  # root, 2 blocks, 1 of grads


def test_run_config_with_a_critic_free_estimator(capsys, tmp_path):
    """A TOML with adv_estimator = "grpo" plans no critic (even one named there), and its rollout batch is
    rollout_batch_size x n_samples_per_prompt sequences."""
    toml = tmp_path / "run.toml"
    toml.write_text("rollout_batch_size = 16\nn_samples_per_prompt = 4\nminibatch_size = 16\nmicro_batch_size = 8\n"
                    'max_new_tokens = 20\nadv_estimator = "grpo"\n')
    result = run_json(capsys, "--config", str(toml), "--prompt-len", "10")
    assert result["critic_free"] is True and set(result["roles"]) == {"policy", "reference"}
    assert result["rollout_batch"] == 64
    gae = tmp_path / "gae.toml"
    gae.write_text("rollout_batch_size = 16\nminibatch_size = 16\nmicro_batch_size = 8\nmax_new_tokens = 20\n")
    assert "critic" in run_json(capsys, "--config", str(gae), "--prompt-len", "10")["roles"]
    assert "critic" not in run_json(capsys, "--config", str(gae), "--prompt-len", "10", "--no-critic")["roles"]


def test_run_config_toml_supplies_the_shapes(capsys, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("rollout_batch_size = 16\nminibatch_size = 8\nmicro_batch_size = 8\nmax_new_tokens = 20\n"
                    "gradient_checkpointing = true\n")
    result = run_json(capsys, "--config", str(toml), "--prompt-len", "10")
    assert (result["rollout_batch"], result["micro_batch"], result["response_len"]) == (16, 8, 20)
    assert result["activation_checkpointing"] is True
    assert result["roles"]["policy"]["params"] == count_parameters(plan.DEMO_CHECKPOINT)
    assert run_json(capsys, "--config", str(toml), "--micro-batch", "2")["micro_batch"] == 2  # flags win


def test_help_states_the_formulas(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for phrase in ("18 B/param", "4 n (fp32 master)", "min(window, P + R) for a sliding-window layer", "4 a N I"):
        assert phrase in text


@needs_configs
def test_text_report(capsys):
    assert plan.main(["--policy", config("Qwen3-0.6B"), "--gpus", "2", "--sharding", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "critic" in out and "FSDP gather" in out and "fits" in out


def test_bad_inputs_are_one_line_errors_with_status_2(tmp_path):
    # as a user runs it: `python -m ppo_core.run.plan` (installed as `ppo-plan`)
    proc = subprocess.run([sys.executable, "-m", "ppo_core.run.plan", "--policy", str(tmp_path / "nope"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ppo-plan: error: no such checkpoint")


def test_bad_checkpoints_in_process(capsys, tmp_path):
    assert plan.main(["--policy", str(tmp_path)]) == 2  # a directory without config.json
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert plan.main(["--policy", str(tmp_path / "config.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert plan.main(["--policy", str(tmp_path)]) == 2
    assert "unsupported architecture" in capsys.readouterr().err
    assert plan.main([]) == 2
    assert "--policy is required" in capsys.readouterr().err


def test_the_log_prob_tiles_are_the_kernels_own():
    from ppo_kernels import linear_logprobs

    assert (plan.TRITON_TILE_ELEMENTS, plan.TORCH_TILE_ELEMENTS) == (
        linear_logprobs.TRITON_TILE_ELEMENTS, linear_logprobs.TORCH_TILE_ELEMENTS)
    for n_rows, vocab in ((1, 29), (512, 2048), (6144, 151936), (10**6, 32000)):
        for tile in (plan.TRITON_TILE_ELEMENTS, plan.TORCH_TILE_ELEMENTS):
            assert plan._tile_shape(n_rows, vocab, tile) == linear_logprobs._tile_shape(n_rows, vocab, tile)



# ---------------------------------------------------------------------------- packed micro-batches (micro_batch_tokens)

@needs_configs
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_activations_by_hand(checkpointing):
    """Qwen3-0.6B (H 1024, I 3072, L 28, 16 query and 8 kv heads of 128, qk-norm, bf16 activations a = 2, fp32 norm
    copies f = 4, trained norm weights a_w = 2), a packed micro-batch of N = 16384 tokens holding M = 10 sequences
    with R = 1024 response slots each."""
    args = ModelArgs.from_hf_config(json.load(open(config("Qwen3-0.6B"))))
    assert (args.hidden_size, args.intermediate_size, args.num_hidden_layers) == (1024, 3072, 28)
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.qk_norm) == (16, 8, 128, "head")
    N, M, P, R, H, I, L = 16384, 10, 512, 1024, 1024, 3072, 28
    # per token of one block: norms 2 H (f + a_w) + 2 a H = 16384; q/k norms (f + a_w)(Dq + Dkv) = 6 x 3072 = 18432;
    # q, k, v, out 2 (2 x 2048 + 2 x 1024) = 12288 and the log-sum-exp 4 x 16 = 64; MLP 4 a I = 24576
    block = (16384 + 18432 + 12288 + 64 + 24576) * N
    assert block == 71744 * N
    # once: the packed ids 8 N, the [M, R] unpack index 8 M R, RoPE cos and sin 2 a N hs = 512 N, final norm 6 H N
    once = (8 + 512 + 6144) * N + 8 * M * R
    heads = {"policy": 2 * M * R * H,  # the [M, R, H] hidden states the fused log-prob kernel reads
             "critic": 2 * N * H}  # the score head's packed [N, H] input
    transients = {"policy": plan.logprob_backward_bytes(M * R, args.vocab_size, H), "critic": 0}
    for role in ("policy", "critic"):
        got = plan.training_activations(args, role, plan.MicroBatch(M, P, R, tokens=N), checkpointing=checkpointing)
        layer_transient = 2 * 2 * N * I  # the gradients of silu(gate) and up
        if checkpointing:
            kept = L * 2 * N * H + once + heads[role]  # each block's input
            saved = kept + block
            peak = max(kept + transients[role], saved + layer_transient)
        else:
            saved = L * block + once + heads[role]
            peak = saved + max(transients[role], layer_transient)
        assert (got["per_block"], got["saved"], got["peak"]) == (block, saved, peak), role


@needs_configs
def test_packing_the_padded_micro_batchs_tokens_plans_the_same_but_the_ids():
    """A budget of exactly 8 sequences of 1536 tokens: the same activations as the padded micro-batch of 8, except
    the token ids (padded: 16 B a token, the ids rolled and rolled back; packed: 8 B a token and 8 B a response
    slot of the unpack index), 8 M P bytes fewer; a sliding window shorter than the sequence costs no mask packed."""
    args = ModelArgs.from_hf_config(json.load(open(config("Qwen3-0.6B"))))
    M, P, R = 8, 512, 1024
    for role in ("policy", "critic"):
        for checkpointing in (False, True):
            padded = plan.training_activations(args, role, plan.MicroBatch(M, P, R), checkpointing=checkpointing)
            packed = plan.training_activations(args, role, plan.MicroBatch(M, P, R, M * (P + R)),
                                               checkpointing=checkpointing)
            assert padded["saved"] - packed["saved"] == 8 * M * P
            assert padded["peak"] - packed["peak"] == 8 * M * P
    cfg = dict(architectures=["Olmo3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=256, max_position_embeddings=128,
               sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    olmo = ModelArgs.from_hf_config(cfg)
    M, P, R = 4, 16, 16
    padded = plan.training_activations(olmo, "critic", plan.MicroBatch(M, P, R))
    packed = plan.training_activations(olmo, "critic", plan.MicroBatch(M, P, R, M * (P + R)))
    masked = 2 * 2 * M * (P + R) * (4 - 1) * 16 + 2 * (P + R) ** 2  # K, V repeated to 4 heads; the [T, T] bias
    assert padded["saved"] - packed["saved"] == masked + 8 * M * P
    assert plan.forward_working_set(olmo, 1, 128, packed=True) < plan.forward_working_set(olmo, 1, 128)


@needs_configs
def test_a_token_budget_plans_the_budget_and_the_sequences_it_holds(capsys):
    base = ["--policy", config("Qwen3-0.6B")]
    result = run_json(capsys, *base, "--micro-batch-tokens", "16384")
    args = ModelArgs.from_hf_config(json.load(open(config("Qwen3-0.6B"))))
    assert result["micro_batch_tokens"] == 16384 and result["micro_batch"] == 16384 // 1536 == 10
    for role in ("policy", "critic"):
        by_formula = plan.training_activations(args, role, plan.MicroBatch(10, 512, 1024, 16384))
        assert result["roles"][role]["activation_gb"] * 1e9 == pytest.approx(by_formula["peak"], rel=1e-12)
    assert result["scoring_working_set_gb"] * 1e9 == pytest.approx(plan.forward_working_set(args, 1, 16384), rel=1e-12)
    # a budget below one sequence: each runs alone, a micro-batch of P + R tokens
    short = run_json(capsys, *base, "--micro-batch-tokens", "1000")
    alone = plan.training_activations(args, "policy", plan.MicroBatch(1, 512, 1024, 1536))
    assert short["micro_batch"] == 1 and short["roles"]["policy"]["activation_gb"] * 1e9 == pytest.approx(alone["peak"])
    # the padded plan says 0
    assert run_json(capsys, *base)["micro_batch_tokens"] == 0
    assert plan.main([*base, "--micro-batch-tokens", "16384"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 16384 tokens per GPU, packed" in out.splitlines()[0]
    assert "micro-batch holds                      10 sequences of 1536 tokens (15360 of its 16384 tokens" in out
    assert plan.main([*base, "--micro-batch-tokens", "1000"]) == 0
    assert "1 sequence of 1536 tokens (longer than its 1000 tokens: each runs alone)" in capsys.readouterr().out
    assert plan.main([*base, "--micro-batch-tokens", "-1"]) == 2
    assert "--micro-batch-tokens must be >= 0" in capsys.readouterr().err


def test_token_budget_flags_beat_the_config(capsys, tmp_path):
    """The run's micro_batch_tokens plans packed micro-batches; --micro-batch-tokens replaces the budget (0: padded
    micro-batches of the config's micro_batch_size); --micro-batch alone asks for padded ones; both at once: refused."""
    toml = tmp_path / "run.toml"
    toml.write_text("rollout_batch_size = 16\nminibatch_size = 16\nmax_new_tokens = 20\nmicro_batch_tokens = 120\n")
    P = ["--prompt-len", "10"]  # sequences of 30 tokens: 4 in 120
    from_config = run_json(capsys, "--config", str(toml), *P)
    assert (from_config["micro_batch_tokens"], from_config["micro_batch"]) == (120, 4)
    flag = run_json(capsys, "--config", str(toml), *P, "--micro-batch-tokens", "60")
    assert (flag["micro_batch_tokens"], flag["micro_batch"]) == (60, 2)
    assert flag["training_phase_gb"] < from_config["training_phase_gb"]
    off = run_json(capsys, "--config", str(toml), *P, "--micro_batch_tokens=0")
    assert (off["micro_batch_tokens"], off["micro_batch"]) == (0, 16)  # what the run's micro_batch_size would be: 16
    padded = run_json(capsys, "--config", str(toml), *P, "--micro-batch", "2")
    assert (padded["micro_batch_tokens"], padded["micro_batch"]) == (0, 2)
    assert plan.main(["--config", str(toml), "--micro-batch", "2", "--micro-batch-tokens", "60"]) == 2
    assert "give one" in capsys.readouterr().err


@needs_configs
@pytest.mark.parametrize("name", ["grpo-qwen3-0.6b.toml", "ppo-qwen3-0.6b.toml"])
def test_shipped_configs_fit_one_80_gb_gpu_as_their_comments_say(capsys, name):
    """configs/{grpo,ppo}-qwen3-0.6b.toml with Qwen3-0.6B: packed micro-batches of 65536 tokens, 42 sequences of
    1536; the update's activations stay under the rollout phase, so the total is model state + rollout phase +
    buffers + 1 GB, what the padded micro-batches of 8 planned too; the comment quotes these numbers."""
    path = os.path.join(ROOT, "configs", name)
    result = run_json(capsys, "--config", path, "--policy", config("Qwen3-0.6B"))
    assert result["micro_batch_tokens"] == 65536 and result["micro_batch"] == 65536 // 1536 == 42
    assert result["rollout_batch"] == 512 and result["critic_free"] == name.startswith("grpo")
    assert result["activation_checkpointing"] and result["kv_cache_gb"] * 1e9 == pytest.approx(30 * 2**30)
    # the model state by hand: 18 B per trained parameter, 2 per frozen one (the reference)
    n = result["roles"]["policy"]["params"]
    trained = n + (result["roles"]["critic"]["params"] if "critic" in result["roles"] else 0)
    assert result["model_state_gb"] * 1e9 == pytest.approx(18 * trained + 2 * n)
    assert result["training_phase_gb"] < result["rollout_phase_gb"] / 3
    total = result["model_state_gb"] + result["rollout_phase_gb"] + result["rollout_buffers_gb"] + 1.0
    assert result["per_gpu_gb"] == pytest.approx(total, rel=1e-12) and result["fits"]
    padded = run_json(capsys, "--config", path, "--policy", config("Qwen3-0.6B"), "--micro-batch", "8")
    assert padded["micro_batch_tokens"] == 0 and padded["per_gpu_gb"] == pytest.approx(result["per_gpu_gb"], rel=1e-12)
    # the config's comment quotes this plan
    comment = open(path).read()
    for quoted in (f"model state {result['model_state_gb']:.2f} GB",
                   f"rollout phase {result['rollout_phase_gb']:.2f} GB",
                   f"training phase {result['training_phase_gb']:.2f} GB",
                   f"{result['per_gpu_gb']:.2f} GB per GPU in all", f"({result['headroom_gb']:+.2f} GB)",
                   f"holds {result['sequences_at_once']} of the 512 sequences",
                   f"{result['micro_batch']} sequences of 1536"):
        assert quoted in comment.replace("\n# ", " "), quoted


# ---------------------------------------------------------------------------- KV cache: exact

@needs_configs
@pytest.mark.parametrize("name", ["Qwen3-8B", "SmolLM2-135M"])
def test_kv_cache_is_exactly_the_kvcache_tensors(capsys, name):
    args = ModelArgs.from_hf_config(json.load(open(config(name))))
    B, P, R = 24, 300, 700
    cache = KVCache(args, B, P + R, "meta", torch.bfloat16)  # meta: the real shapes, no memory
    actual = sum(t.numel() * t.element_size() for t in
                 (cache.k, cache.v, cache.k_ring, cache.v_ring, cache.mask, cache.n_real, cache.slot))
    assert plan.kv_cache_bytes(args, B, P + R, kv_bytes=2) == actual
    result = run_json(capsys, "--policy", config(name), "--rollout-batch", "48", "--gpus", "2",
                      "--prompt-len", str(P), "--response-len", str(R), "--rollout-engine", "padded")
    assert round(result["kv_cache_gb"] * 1e9) == actual  # 48 rollouts over 2 GPUs: 24 per GPU


@pytest.mark.parametrize("window", [None, 20])
def test_a_paged_sequence_holds_what_the_engine_holds(window):
    """One sequence of 40 tokens (3 blocks of 16; a window of 20 spans at most 3 blocks too, of 5 at this length
    for a longer one) in the engine's pool, against paged_sequence_bytes, in float32 (4 bytes)."""
    from ppo_core.engine import RolloutEngine
    from ppo_core.models.model import CausalLM

    cfg = {"architectures": ["Olmo3ForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "max_position_embeddings": 256,
           "sliding_window": window or 4096, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    args = ModelArgs.from_hf_config(cfg)
    engine = RolloutEngine(CausalLM(args).eval())
    for new in (36, 76):  # 40 and 80 tokens in all
        engine.generate([[1, 2, 3, 4]], new)
        assert engine.stats["peak_kv_bytes"] == plan.paged_sequence_bytes(args, 4 + new, kv_bytes=4)
    by_hand = 2 * 2 * (32 // 4) * 4 * 16 * (5 + 3 * (5 if window is None else 3))  # 80 tokens: 5 blocks, window 3
    assert plan.paged_sequence_bytes(args, 80, kv_bytes=4) == by_hand


def test_the_paged_pool_is_the_budget_and_says_how_many_sequences_fit(capsys):
    """--kv-cache-gb 2 (GiB) for Qwen3-0.6B at 512 + 1024 tokens (0.176 GB a sequence): 12 at once of 32 per GPU;
    a budget above what all 32 hold is cut to that; the padded cache is every row at full length."""
    args = ModelArgs.from_hf_config(json.load(open(config("Qwen3-0.6B"))))
    per_sequence = plan.paged_sequence_bytes(args, 1536)
    assert per_sequence == 2 * 28 * 8 * 128 * 2 * 1536  # 1536 is 96 whole blocks
    small = run_json(capsys, "--policy", config("Qwen3-0.6B"), "--rollout-batch", "32", "--kv-cache-gb", "2")
    assert small["kv_cache_gb"] * 1e9 == pytest.approx(2 * 2**30)
    assert small["sequences_at_once"] == int(2 * 2**30 // per_sequence) == 12
    large = run_json(capsys, "--policy", config("Qwen3-0.6B"), "--rollout-batch", "32", "--kv-cache-gb", "50")
    assert large["kv_cache_gb"] * 1e9 == pytest.approx(32 * per_sequence) and large["sequences_at_once"] == 32
    assert plan.main(["--policy", config("Qwen3-0.6B"), "--rollout-batch", "32", "--kv-cache-gb", "2"]) == 0
    assert "KV pool holds                          12 of 32 sequences of 1536 tokens at once" in capsys.readouterr().out


def test_kv_cache_of_sliding_window_layers_is_their_ring():
    """OLMo 3 layout: 3 of every 4 layers slide over a window of 256, so they cache 256 slots, not P + R."""
    cfg = {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "max_position_embeddings": 4096, "sliding_window": 256, "rms_norm_eps": 1e-6,
           "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2}
    args = ModelArgs.from_hf_config(cfg)
    B, T = 4, 1000
    cache = KVCache(args, B, T, "meta", torch.bfloat16)
    actual = sum(t.numel() * t.element_size() for t in
                 (cache.k, cache.v, cache.k_ring, cache.v_ring, cache.mask, cache.n_real, cache.slot))
    hs = 256 // 4
    by_hand = 2 * B * 2 * hs * 2 * (6 * 256 + 2 * T) + B * T + 8 * B + 8  # k, v x B x nkv x hs x bf16 x slots
    assert plan.kv_cache_bytes(args, B, T, kv_bytes=2) == actual == by_hand


# ---------------------------------------------------------------------------- activations: measured

def _batch(M, P, R, V, seed=0):
    """A training micro-batch as the rollout leaves it: left-padded prompts, one response cut early."""
    T = P + R
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (M, T), generator=g)
    am = torch.ones(M, T, dtype=torch.bool)
    am[: M // 2, : P // 4] = False
    rm = torch.ones(M, R)
    rm[0, R // 2 :] = 0
    am[0, P + R // 2 :] = False
    return ids, am, rm, -torch.rand(M, R, generator=g), torch.randn(M, R, generator=g), torch.randn(M, R, generator=g)


def _policy_loss(policy, batch, P, packed=None):
    ids, am, rm, old_logprobs, advantages, _ = batch
    logprobs, _ = response_logprobs(policy, ids, am, rm, P, 1.0, True, packed=packed)
    return algo.policy_loss(logprobs, old_logprobs, advantages, rm,
                            agg=algo.Aggregation(num_tokens=rm.sum(), num_seqs=torch.tensor(len(ids))))[0]


def _value_loss(critic, batch, P, packed=None):
    ids, am, rm, old_values, _, returns = batch
    values = response_values(critic, ids, am, P, packed)
    return algo.value_loss(values, old_values, returns, rm,
                           agg=algo.Aggregation(num_tokens=rm.sum(), num_seqs=torch.tensor(len(ids))))[0]


def measure(policy, critic, M, P, R, rss=False, packed=False) -> dict:
    """One training micro-batch: {role: {"saved": bytes autograd saved, "peak": peak RSS increase (rss=True)}};
    packed=True runs it packed (ppo_core.data.packing, as micro_batch_tokens does) and adds "tokens", its real tokens."""
    V = policy.args.vocab_size
    params = {p.untyped_storage().data_ptr() for m in (policy, critic) for p in m.parameters()}
    for model, loss_fn in ((policy, _policy_loss), (critic, _value_loss)):  # warm-up; steady state has .grad
        model.train()
        loss_fn(model, _batch(2, 8, 8, V, seed=1), 8).backward()
    batch = _batch(M, P, R, V)
    packed_batch = pack_rows(batch[0], batch[1], P) if packed else None
    out = {}
    for role, model, loss_fn in (("policy", policy, _policy_loss), ("critic", critic, _value_loss)):
        storages = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        if rss:
            before = _rss_bytes()["VmRSS"]
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            if _rss_bytes()["VmHWM"] > before + (1 << 20):
                raise OSError("this kernel did not reset VmHWM through /proc/self/clear_refs")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model, batch, P, packed_batch)
        loss.backward()
        del loss
        out[role] = {"saved": sum(storages.values())}
        if packed:
            out[role]["tokens"] = packed_batch.input_ids.numel()
        if rss:
            out[role]["peak"] = _rss_bytes()["VmHWM"] - before
    return out


def _rss_bytes():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


# A scaled-down Qwen3 job: qk-norm, GQA, tied embeddings; 2 x 128 tokens x 8 sequences, ~40 MB of activations.
SCALED = dict(architectures=["Qwen3ForCausalLM"], hidden_size=128, intermediate_size=384, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=2048, tie_word_embeddings=True,
              max_position_embeddings=256)
SCALED_SHAPE = dict(M=8, P=64, R=64)
FLOAT32 = plan.ElementBytes(act=4, fp32=4)  # a float32 model's activations on the CPU


def _measure_in_fresh_process():
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _can_measure_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _can_measure_rss(), reason="needs Linux /proc/self/clear_refs to reset the RSS high-water mark")
def test_activation_estimate_within_25_percent_of_measured_peak():
    """The scaled-down job, padded and packed (its 928 real tokens of 8 x 128), without and with activation
    checkpointing, measured in one fresh process."""
    args = ModelArgs.from_hf_config(SCALED)
    report = []
    runs = _measure_in_fresh_process()
    if "skip" in runs:
        pytest.skip(runs["skip"])
    for packed, checkpointing in ((False, False), (False, True), (True, False), (True, True)):
        measured = runs[("packed " if packed else "") + str(checkpointing)]
        for role in ("policy", "critic"):
            tokens = measured[role]["tokens"] if packed else 0
            estimate = plan.training_activations(args, role, plan.MicroBatch(**SCALED_SHAPE, tokens=tokens),
                                                 sizes=FLOAT32, backend="torch", checkpointing=checkpointing)
            ratio = estimate["peak"] / measured[role]["peak"]
            report.append(f"{role} {'packed' if packed else 'padded'} ckpt={checkpointing}: "
                          f"estimated {estimate['peak'] / 1e6:.1f} MB, "
                          f"measured {measured[role]['peak'] / 1e6:.1f} MB ({ratio - 1:+.1%})")
            assert 0.75 <= ratio <= 1.25, report
            if not checkpointing:  # checkpointing hides its tensors from saved_tensors_hooks
                assert estimate["saved"] == pytest.approx(measured[role]["saved"], rel=0.05), report
    print("\n".join(report))


def test_activation_estimate_of_the_default_job():
    """The default job itself (the shipped demo checkpoint, 32 sequences per micro-batch, 12 response tokens):
    too small for RSS, so the saved-tensor accounting only."""
    policy, critic = load_model(train.DEMO_CHECKPOINT), load_score_model(train.DEMO_CHECKPOINT)
    M, P, R = 32, 10, 12
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the default job runs (threads = 1); tiny ops on shared cores crawl with more
    try:
        measured = measure(policy, critic, M, P, R)
    finally:
        torch.set_num_threads(threads)
    for role in ("policy", "critic"):
        estimate = plan.training_activations(policy.args, role, plan.MicroBatch(M, P, R), sizes=FLOAT32,
                                             backend="torch")
        assert estimate["saved"] == pytest.approx(measured[role]["saved"], rel=0.05), (role, estimate, measured)


def test_activation_estimate_with_sliding_windows_shorter_than_the_sequence():
    """OLMo-3-style layers with a window of 8 in a 32-token micro-batch need a mask (model.attention): their K and
    V are repeated to all query heads and the mask kept as a float bias, about 5.5% of what autograd saves here; the
    estimate counts them and matches the saved bytes to 1%."""
    from ppo_core.models.model import CausalLM, ScoreModel

    cfg = dict(architectures=["Olmo3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=256, tie_word_embeddings=True,
               max_position_embeddings=128, sliding_window=8,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    args = ModelArgs.from_hf_config(cfg)
    torch.manual_seed(0)
    M, P, R = 4, 16, 16
    measured = measure(CausalLM(args), ScoreModel(args), M, P, R)
    for role in ("policy", "critic"):
        estimate = plan.training_activations(args, role, plan.MicroBatch(M, P, R), sizes=FLOAT32, backend="torch")
        assert estimate["saved"] == pytest.approx(measured[role]["saved"], rel=0.01), (role, estimate, measured)


if __name__ == "__main__":  # the measuring process of test_activation_estimate_within_25_percent_of_measured_peak
    from ppo_core.models.model import CausalLM, ScoreModel

    torch.set_num_threads(1)
    results = {}
    for packed, checkpointing in ((False, False), (False, True), (True, False), (True, True)):
        torch.manual_seed(0)
        model_args = ModelArgs.from_hf_config(SCALED)
        policy_model, critic_model = CausalLM(model_args), ScoreModel(model_args)
        for m in (policy_model, critic_model):
            m.model.gradient_checkpointing = checkpointing
        try:
            results[("packed " if packed else "") + str(checkpointing)] = measure(
                policy_model, critic_model, **SCALED_SHAPE, rss=True, packed=packed)
        except OSError as e:
            results = {"skip": str(e)}
            break
        del policy_model, critic_model
    print(json.dumps(results))


# ---------------------------------------------------------------------------- option spelling (newcomer review #17)

@pytest.mark.parametrize("dashed", [
    ["--policy", train.DEMO_CHECKPOINT, "--critic", train.DEMO_CHECKPOINT, "--reference", train.DEMO_CHECKPOINT,
     "--reward-model", train.DEMO_CHECKPOINT, "--gpus", "2", "--gpu-memory-gb", "24", "--prompt-len", "16",
     "--response-len", "8", "--rollout-batch", "4", "--micro-batch", "2", "--lora-rank", "4", "--sharding", "fsdp",
     "--offload", "--activation-checkpointing"],
    ["--policy=" + train.DEMO_CHECKPOINT, "--no-critic", "--gpu-memory-gb=0.5", "--rollout-batch=6"],
])
def test_every_option_takes_underscores_as_well_as_dashes(capsys, dashed):
    """ppo-train spells its keys with underscores; the planner takes either spelling of each of its options."""
    def with_underscores(arg):  # "--gpu-memory-gb=0.5" -> "--gpu_memory_gb=0.5"; values as they are
        name, eq, value = arg.partition("=")
        return "--" + name[2:].replace("-", "_") + eq + value if arg.startswith("--") else arg

    underscored = [with_underscores(a) for a in dashed]
    assert "--gpu_memory_gb" in underscored or "--gpu_memory_gb=0.5" in underscored
    by_dashes, by_underscores = run_json(capsys, *dashed), run_json(capsys, *underscored)
    assert by_underscores == by_dashes
    assert by_dashes != run_json(capsys, "--policy", train.DEMO_CHECKPOINT)  # the options did take effect
    assert by_dashes["gpu_memory_gb"] == (24 if "--gpu-memory-gb" in dashed else 0.5)


def test_option_values_keep_their_underscores_and_paths_their_tilde(capsys, tmp_path, monkeypatch):
    """Only option names are respelled: a path holding underscores reaches the planner unchanged; `~` is expanded."""
    model_dir = tmp_path / "my_tiny_model"
    model_dir.mkdir()
    with open(os.path.join(train.DEMO_CHECKPOINT, "config.json")) as f:
        (model_dir / "config.json").write_text(f.read())
    expected = run_json(capsys, "--policy", train.DEMO_CHECKPOINT)
    for argv in (["--policy", str(model_dir)], [f"--policy={model_dir}"]):
        got = run_json(capsys, *argv)
        assert got["roles"]["policy"]["config"] == str(model_dir)
        assert {k: v for k, v in got.items() if k != "roles"} == {k: v for k, v in expected.items() if k != "roles"}
    monkeypatch.setenv("HOME", str(tmp_path))
    assert run_json(capsys, "--policy", "~/my_tiny_model")["roles"]["policy"]["params"] == \
        expected["roles"]["policy"]["params"]
