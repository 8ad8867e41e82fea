"""ppo_core/models/lora.py on real (tiny, random-weight) models of this library: fresh adapters change nothing, only the
adapters train, the adapted projection is W x + b + s B A x, disabled adapters give the base exactly, merging
matches the adapted model and loads in `transformers`, counts agree with ppo_core.run.plan, adapter checkpoints
round-trip.

    python -m pytest -q tests/test_lora.py

Models are built from a config.json-style dict (Qwen3 with head_dim != hidden/heads; Llama with biases and tied
embeddings), weights redrawn at unit scale as in tests/test_model_parity.py, float32. `transformers` is imported
by the one test that loads a merged checkpoint with it.
"""
import copy
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ppo_core.run import plan
from ppo_core.models.lora import (
    LoRALinear, adapters_disabled, add_lora, count_lora_parameters, has_lora, load_lora_state_dict,
    lora_state_dict, merge_lora, merged_state_dict, save_merged,
)
from ppo_core.models.model import CausalLM, Linear, ModelArgs, ScoreModel, can_pack_for_cpu, load_model, load_score_model
from random_weights import randomize

BASE = dict(vocab_size=131, hidden_size=60, intermediate_size=86, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
            hidden_act="silu", pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=14, tie_word_embeddings=False),
    "llama_bias": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True,
                       mlp_bias=True, tie_word_embeddings=True),
}
REAL_CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
RANK, ALPHA = 4, 8.0  # scale s = alpha / rank = 2, so a missing or doubled scale shows


def tiny(name, cls=CausalLM, seed=0):
    return randomize(cls(ModelArgs.from_hf_config(dict(CONFIGS[name]))), seed).eval()


def perturb_adapters(model, seed=1):
    """Adapters as after some training: A and B both nonzero, at a size that moves the logits by O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) / m.in_features ** 0.5)
                m.lora_B.copy_(0.3 * torch.randn(m.lora_B.shape, generator=g) / m.rank ** 0.5)
    return model


def ids_and_mask(B=3, T=11, seed=0):
    """Random ids in [3, 131) and a left-padding mask: row 1 has 4 pads, row 2 one."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 131, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, mask)


# ------------------------------------------------------------------------------------------- adding adapters


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fresh_adapters_give_the_base_logits_exactly(name):
    """B = 0 at init, so B (A x) = 0 exactly and every logit is the base's, bit for bit."""
    model = tiny(name)
    ids, mask = ids_and_mask()
    base = logits(model, ids, mask)
    add_lora(model, RANK, ALPHA)
    assert torch.equal(logits(model, ids, mask), base)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoRALinear) and q.lora_B.abs().max() == 0
    bound = 1 / q.in_features ** 0.5  # Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
    assert q.lora_A.abs().max() <= bound and q.lora_A.abs().max() > 0.9 * bound


def test_names_are_the_base_names_plus_lora_a_and_b():
    model = tiny("llama_bias")
    base_names = set(model.state_dict())
    add_lora(model, RANK)
    names = set(model.state_dict())
    assert base_names <= names  # the base still loads and saves by its HF names
    added = names - base_names
    assert "model.layers.1.mlp.down_proj.lora_A" in added and "model.layers.0.self_attn.q_proj.lora_B" in added
    assert len(added) == 2 * len(plan.LORA_TARGETS) * model.args.num_hidden_layers
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in added)
    assert model.model.layers[0].self_attn.q_proj.weight is not None and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("cls", [CausalLM, ScoreModel])
def test_only_the_adapters_and_documented_extras_train(cls):
    """requires_grad on the adapters only (plus a ScoreModel's score head), and a backward reaches exactly them."""
    model = perturb_adapters(add_lora(tiny("qwen3", cls), RANK, ALPHA)).train()
    extra = {"score_head.weight"} if cls is ScoreModel else set()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in dict(model.named_parameters()) if n.endswith(("lora_A", "lora_B"))} | extra
    ids, mask = ids_and_mask()
    model(ids, mask).float().pow(2).mean().backward()
    for n, p in model.named_parameters():
        if n in trainable:
            assert p.grad is not None and p.grad.abs().max() > 0, n
        else:
            assert p.grad is None, n


def test_add_lora_refuses_what_it_cannot_do():
    model = tiny("llama_bias")
    with pytest.raises(ValueError, match="qkv_proj"):
        add_lora(model, RANK, targets=("q_proj", "qkv_proj"))
    with pytest.raises(ValueError, match="tied"):  # lm_head is embed_tokens here: merging would change both
        add_lora(model, RANK, targets=("lm_head",))
    with pytest.raises(ValueError, match="rank"):
        add_lora(model, 0)
    add_lora(model, RANK)
    with pytest.raises(ValueError, match="already"):
        add_lora(model, RANK)


# ------------------------------------------------------------------------------------- the adapted forward


@pytest.mark.parametrize("name", list(CONFIGS))
def test_adapted_projection_is_w_x_plus_b_plus_s_b_a_x(name):
    """One projection (with a bias in llama_bias) against float64: y = W x + b + (alpha / r) B A x. Float32 sums
    over in = 60 (or 84) terms of unit-scale products are ~1e-6 off; 1e-5 leaves margin and is far below the
    s B A x term itself (~3 here), which the second check shows is there."""
    model = perturb_adapters(add_lora(tiny(name), RANK, ALPHA))
    for proj in (model.model.layers[1].self_attn.v_proj, model.model.layers[0].mlp.down_proj):
        x = torch.randn(2, 5, proj.in_features, generator=torch.Generator().manual_seed(3))
        W, A, B = proj.weight.double(), proj.lora_A.double(), proj.lora_B.double()
        b = 0 if proj.bias is None else proj.bias.double()
        truth = x.double() @ W.T + b + (ALPHA / RANK) * (x.double() @ A.T) @ B.T  # [2, 5, out]
        with torch.no_grad():
            ours = proj(x)
        assert (ours.double() - truth).abs().max() <= 1e-5
        assert ((x.double() @ W.T + b) - truth).abs().max() > 1e-1  # the adapter term is really there


@pytest.mark.parametrize("name", list(CONFIGS))
def test_disabled_adapters_give_the_base_logits_exactly(name):
    """The PPO reference is the policy with adapters off: bit-identical to the base, no second copy; on exit the
    adapters are back on."""
    base_model = tiny(name)
    model = perturb_adapters(add_lora(copy.deepcopy(base_model), RANK, ALPHA))
    ids, mask = ids_and_mask()
    base, adapted = logits(base_model, ids, mask), logits(model, ids, mask)
    assert (adapted - base).abs().max() > 0.1
    with adapters_disabled(model):
        assert torch.equal(logits(model, ids, mask), base)
    assert torch.equal(logits(model, ids, mask), adapted)


def test_dropout_is_on_the_adapter_input_in_train_mode_only():
    model = perturb_adapters(add_lora(tiny("qwen3"), RANK, ALPHA))
    noisy = perturb_adapters(add_lora(tiny("qwen3"), RANK, ALPHA, dropout=0.5))  # the same A and B
    ids, mask = ids_and_mask()
    assert torch.equal(logits(noisy.eval(), ids, mask), logits(model, ids, mask))
    assert not torch.equal(logits(noisy.train(), ids, mask), logits(model, ids, mask))
    with adapters_disabled(noisy):  # the reference stays deterministic
        assert torch.equal(logits(noisy, ids, mask), logits(tiny("qwen3"), ids, mask))


# ----------------------------------------------------------------------------------------------- merging


def max_error(a, b, mask):
    return ((a.double() - b.double()).abs() * mask[..., None]).max().item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_merged_logits_match_the_adapted_model_to_float32_rounding(name):
    """merge_lora computes (W + s B A) x in place of W x + s B (A x): the same math, rounded differently. Both are
    measured against the adapted model in float64: the merged model's error must be no worse than 4x the
    adapted model's own float32 error (both are ~3e-6 on logits of size ~4; a missing scale or a merge that
    drops an adapter is off by O(1)), and within the parity tests' 1e-4 of it."""
    model = perturb_adapters(add_lora(tiny(name), RANK, ALPHA))
    ids, mask = ids_and_mask()
    adapted = logits(model, ids, mask)
    truth = logits(copy.deepcopy(model).double(), ids, mask)
    merged_model = merge_lora(copy.deepcopy(model))
    merged = logits(merged_model, ids, mask)
    err_adapted, err_merged = max_error(adapted, truth, mask), max_error(merged, truth, mask)
    assert err_merged <= 4 * err_adapted + 1e-6 and max_error(merged, adapted, mask) <= 1e-4, (err_merged, err_adapted)
    assert not has_lora(merged_model) and type(merged_model.model.layers[0].mlp.up_proj) is Linear
    assert set(merged_model.state_dict()) == {n for n in model.state_dict() if "lora_" not in n}
    # merged_state_dict, the non-destructive export, holds exactly the tensors merge_lora leaves
    export = merged_state_dict(model)
    assert export.keys() == merged_model.state_dict().keys()
    assert all(torch.equal(export[n], t) for n, t in merged_model.state_dict().items())
    assert has_lora(model) and torch.equal(logits(model, ids, mask), adapted)  # the model itself is untouched


@pytest.mark.parametrize("name", list(CONFIGS))
def test_merged_checkpoint_loads_in_transformers(name, tmp_path):
    """save_merged (mid-run, model unchanged) and merge_lora + save_pretrained write the same plain HF checkpoint;
    transformers and load_model read it to the adapted model's logits (1e-4, the parity tests' tolerance)."""
    transformers = pytest.importorskip("transformers")
    model = perturb_adapters(add_lora(tiny(name), RANK, ALPHA))
    ids, mask = ids_and_mask()
    adapted = logits(model, ids, mask)
    save_merged(model, tmp_path / "mid-run")
    assert has_lora(model) and torch.equal(logits(model, ids, mask), adapted)
    merge_lora(model).save_pretrained(tmp_path / "final")
    a, b = load_file(tmp_path / "mid-run" / "model.safetensors"), load_file(tmp_path / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any("lora" in k for k in a)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mid-run").eval()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as transformers' generate passes them for left padding
    with torch.no_grad():
        hf_logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert max_error(hf_logits, adapted, mask) <= 1e-4
    assert max_error(logits(load_model(tmp_path / "mid-run"), ids, mask), adapted, mask) <= 1e-4


def test_merged_critic_keeps_its_trained_score_head(tmp_path):
    model = tiny("qwen3")
    model.save_pretrained(tmp_path / "policy")
    critic = load_score_model(tmp_path / "policy", init_head="normal")
    perturb_adapters(add_lora(critic, RANK, ALPHA))
    ids, mask = ids_and_mask()
    with torch.no_grad():
        critic.score_head.weight.mul_(1.5)  # as if the head had trained too
        values = critic(ids, mask)
    save_merged(critic, tmp_path / "critic")
    again = load_score_model(tmp_path / "critic")
    with torch.no_grad():
        assert max_error(again(ids, mask)[..., None], values[..., None], mask) <= 1e-4


# ------------------------------------------------------------------------------------ counts and checkpoints


@pytest.mark.parametrize("cls", [CausalLM, ScoreModel])
@pytest.mark.parametrize("name", list(CONFIGS) + ["Qwen3-0.6B"])
def test_adapter_count_equals_the_planners(name, cls):
    """count_lora_parameters = ppo_core.run.plan's `lora` for the same config and rank; a real config on the meta
    device (no memory)."""
    if name in CONFIGS:
        cfg = dict(CONFIGS[name])
    else:
        path = os.path.join(REAL_CONFIGS, name)
        if not os.path.isdir(path):
            pytest.skip(f"{path} not present")
        cfg = plan.load_config(path)
    with torch.device("meta"):
        model = add_lora(cls(ModelArgs.from_hf_config(cfg)), rank=16)
    expected = plan.model_shape(cfg, score=cls is ScoreModel, lora_rank=16)["lora"]
    assert count_lora_parameters(model) == expected
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == expected + (model.args.hidden_size if cls is ScoreModel else 0)  # the planner's n_train


def test_lora_state_dict_round_trips_through_safetensors(tmp_path):
    """Only adapter tensors are saved; loading them into a fresh adapted base (other random A) restores the
    logits exactly; a wrong rank or a missing tensor is refused by name."""
    model = perturb_adapters(add_lora(tiny("llama_bias"), RANK, ALPHA))
    ids, mask = ids_and_mask()
    adapted = logits(model, ids, mask)
    state = lora_state_dict(model)
    assert len(state) == 2 * len(plan.LORA_TARGETS) * model.args.num_hidden_layers
    assert sum(t.numel() for t in state.values()) == count_lora_parameters(model)
    save_file(state, tmp_path / "adapters.safetensors")

    fresh = add_lora(tiny("llama_bias"), RANK, ALPHA, generator=torch.Generator().manual_seed(7))
    assert not torch.equal(logits(fresh, ids, mask), adapted)
    a_before = fresh.model.layers[0].self_attn.q_proj.lora_A
    load_lora_state_dict(fresh, load_file(tmp_path / "adapters.safetensors"))
    assert torch.equal(logits(fresh, ids, mask), adapted)
    assert fresh.model.layers[0].self_attn.q_proj.lora_A is a_before  # copied in place: an optimizer keeps it

    other_rank = add_lora(tiny("llama_bias"), RANK + 1, ALPHA)
    with pytest.raises(ValueError, match="shape"):
        load_lora_state_dict(other_rank, state)
    partial = dict(state)
    partial.pop("model.layers.1.mlp.up_proj.lora_B")
    with pytest.raises(ValueError, match="up_proj.lora_B"):
        load_lora_state_dict(fresh, partial)


# ----------------------------------------------------------------------------------- the CPU packed path


def test_an_adapted_model_is_never_packed():
    """cpu_packed_linears fuses q/k/v and gate/up into matmuls that never call the adapters: not with LoRA."""
    base, model = tiny("qwen3"), add_lora(tiny("qwen3"), RANK)
    assert has_lora(model) and not has_lora(base)
    assert not can_pack_for_cpu(model)
    assert can_pack_for_cpu(base) == (torch.backends.mkldnn.is_available()
                                      and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
