"""Parity of ppo_core/models/model.py and ppo_core/engine/generate.py with `transformers` (the reference, test-only) for every
supported family, on tiny random-weight checkpoints written by `transformers` itself.

    python -m pytest -q tests/test_model_parity.py

Sizes are odd on purpose (hidden 60, 6 query / 3 kv heads of size 10, Qwen3 head_dim 14 != hidden/heads,
vocab 131), weights are redrawn at unit scale (transformers' 0.02-std init makes logits nearly constant, which
would hide bugs), float32 throughout; logits must agree to 1e-4 (they agree to ~1e-6 or exactly).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification  # noqa: E402

import ppo_core  # noqa: E402
from random_weights import randomize  # noqa: E402
from ppo_core.models.model import (  # noqa: E402
    FAMILY_DEFAULTS, CheckpointError, KVCache, ModelArgs, count_parameters, load_model, load_reward_model,
    load_score_model, read_safetensors_header,
)

TOL = 1e-4
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
BASE = dict(vocab_size=131, hidden_size=60, intermediate_size=86, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    # Llama-3.1 rope scaling (the Skywork Llama-3.1 reward model), tied embeddings as in SmolLM2
    "llama": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=16)),
    "llama_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True, num_key_value_heads=6,
                       rope_scaling=dict(rope_type="linear", factor=2.0)),
    # Qwen2: bias on q/k/v, none on o; untied, then tied with sliding windows in layers 3-4 (max_window_layers=2)
    "qwen2": dict(model_type="qwen2"),
    "qwen2_sliding": dict(model_type="qwen2", tie_word_embeddings=True, use_sliding_window=True, sliding_window=5,
                          max_window_layers=2),
    "qwen3": dict(model_type="qwen3", head_dim=14),
    "qwen3_sliding": dict(model_type="qwen3", use_sliding_window=True, sliding_window=5, max_window_layers=2),
    "smollm3": dict(model_type="smollm3"),  # NoPE in layer 4 (no_rope_layers = [1, 1, 1, 0])
    "smollm3_sliding": dict(model_type="smollm3", no_rope_layers=[0, 1, 0, 1], use_sliding_window=True, sliding_window=5),
    "olmo": dict(model_type="olmo", clip_qkv=0.9, num_key_value_heads=6),
    "olmo2": dict(model_type="olmo2"),
    "olmo3": dict(model_type="olmo3", sliding_window=5),  # layers 1-3 sliding, 4 full
    "olmo3_yarn": dict(model_type="olmo3", sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 2,
                       rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
}
SEQ = 13  # longer than every sliding window above


def hf_config(family, **overrides):
    kwargs = {**BASE, **FAMILIES[family], **overrides}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def write_hf(path, family, cls=AutoModelForCausalLM, seed=0, **overrides):
    torch.manual_seed(seed)
    model = randomize(cls.from_config(hf_config(family, **overrides)).eval(), seed)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, checkpoint directory), built once for the module."""
    out = {}
    for family in FAMILIES:
        path = str(tmp_path_factory.mktemp(family))
        out[family] = (write_hf(path, family), path)
    return out


def ids_and_mask(B=3, T=SEQ, vocab=131, seed=0):
    """Random ids in [3, vocab) (never pad/bos/eos) and a left-padding mask: row 1 has 4 pads, row 2 one."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def left_and_right_padding(ids, mask):
    """The rows of ids_and_mask() with right padding added as a PPO batch has it ([pads, prompt, response, pads]):
    row 0 loses its last 3 tokens, row 1 (4 left pads) its last 2; row 2 keeps its one left pad."""
    mask = mask.clone()
    mask[0, -3:] = 0
    mask[1, -2:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_logits(hf, ids, mask):
    # transformers' generate passes these position ids for left-padded rows; its forward alone would not
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def max_diff_real(a, b, mask):
    return ((a - b).abs() * mask[..., None]).max().item()


# ----------------------------------------------------------------------------------------------- logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, family):
    hf, path = checkpoints[family]
    model = load_model(path).eval()
    ids, mask = ids_and_mask()
    both_ids, both_mask = left_and_right_padding(ids, mask)
    with torch.no_grad():
        ours_padded, ours_plain, ours_both = model(ids, mask), model(ids), model(both_ids, both_mask)
        ref_plain = hf(input_ids=ids).logits
    assert max_diff_real(ours_padded, hf_logits(hf, ids, mask), mask) <= TOL  # left padding
    assert max_diff_real(ours_both, hf_logits(hf, both_ids, both_mask), both_mask) <= TOL  # left and right
    assert torch.isfinite(ours_both).all()  # pad slots too
    assert (ours_plain - ref_plain).abs().max().item() <= TOL  # no mask: the plain causal path
    assert ref_plain.abs().max() > 1.0  # logits that actually vary


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "olmo", "olmo2", "olmo3"])
def test_bfloat16_logits_match_transformers(checkpoints, family):
    """In bfloat16 the order of casts matters (OLMo applies RoPE and the norm weight in float32, the others cast
    first): the logits equal transformers' (exactly, on the CPU); the other cast order is off by ~0.1.

    Each left-padded row is compared with transformers on that row alone, unpadded: the truth for a padded row, and
    the same attention on both sides (causal, no mask: our forward moves the pads after the real tokens). Against
    transformers' own padded batch the logits differ by 0.02-0.05 on CPUs whose ATen kernels are AVX2
    (`ATEN_CPU_CAPABILITY=avx2` reproduces it on any x86 CPU; exact with AVX-512): its masked attention over the
    left pads sums the fp32 softmax in another order, and a bf16 rounding of the attention output flips by one ulp."""
    _, path = checkpoints[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = load_model(path, dtype=torch.bfloat16).eval()
    ids, mask = ids_and_mask()
    with torch.no_grad():
        plain = (model(ids).float() - hf(input_ids=ids).logits.float()).abs().max().item()
        assert plain <= 1e-3  # the batch taken as unpadded rows (measured: 0 with AVX2 and AVX-512 kernels)
        ours = model(ids, mask).float()
        for row, real in enumerate(mask.bool()):
            alone = hf(input_ids=ids[row : row + 1, real]).logits[0].float()
            assert (ours[row, real] - alone).abs().max().item() <= 1e-3, row


def test_parity_is_sensitive_to_each_family_feature(checkpoints):
    """The checks above can fail: switching off a family's feature moves the logits far past TOL."""
    ids, mask = ids_and_mask()
    for family, breaks in [("olmo3", lambda a: setattr(a, "sliding_windows", [None] * 4)),
                           ("smollm3", lambda a: setattr(a, "use_rope", [True] * 4)),
                           ("olmo", lambda a: setattr(a, "clip_qkv", None)),
                           ("qwen2_sliding", lambda a: setattr(a, "sliding_windows", [None] * 4)),
                           ("llama", lambda a: a.rope_parameters["full_attention"].update(rope_type="default"))]:
        hf, path = checkpoints[family]
        model = load_model(path).eval()
        breaks(model.args)
        for layer in model.model.layers:
            layer.self_attn.clip_qkv = model.args.clip_qkv
        model.model._rope_tables.clear()
        with torch.no_grad():
            assert max_diff_real(model(ids, mask), hf_logits(hf, ids, mask), mask) > 100 * TOL, family


def test_qwen2_has_bias_on_q_k_v_only_as_transformers_builds_it(checkpoints):
    """Qwen2 builds q/k/v with bias and o without whatever the config says (Qwen2Config has no attention_bias):
    the same tensor names as transformers' model, also for a config.json that carries attention_bias=true;
    and the biases matter: zeroing them moves the logits far past TOL."""
    hf, path = checkpoints["qwen2"]
    model = load_model(path).eval()
    assert set(model.state_dict()) == set(hf.state_dict())
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    cfg = {**hf_config("qwen2", attention_bias=True).to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    with torch.device("meta"):
        ours = ppo_core.CausalLM(ModelArgs.from_hf_config(cfg))
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert set(ours.state_dict()) == set(ref.state_dict())
    ids, mask = ids_and_mask()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
        assert max_diff_real(model(ids, mask), hf_logits(hf, ids, mask), mask) > 100 * TOL


def test_sliding_window_layers_read_from_config(checkpoints):
    args = load_model(checkpoints["olmo3"][1]).args
    assert args.sliding_windows == [5, 5, 5, None]
    assert load_model(checkpoints["qwen3_sliding"][1]).args.sliding_windows == [None, None, 5, 5]
    assert load_model(checkpoints["qwen3"][1]).args.sliding_windows == [None] * 4
    assert load_model(checkpoints["qwen2_sliding"][1]).args.sliding_windows == [None, None, 5, 5]
    assert load_model(checkpoints["qwen2"][1]).args.sliding_windows == [None] * 4
    smol = load_model(checkpoints["smollm3"][1]).args
    assert smol.use_rope == [True, True, True, False] and smol.sliding_windows == [None] * 4
    smol = load_model(checkpoints["smollm3_sliding"][1]).args
    assert smol.use_rope == [False, True, False, True] and smol.sliding_windows == [5, None, 5, None]


def test_family_defaults_match_transformers_config_classes():
    """Fields a config.json may omit default as in transformers."""
    for family, model_type in [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("smollm3", "smollm3"),
                               ("olmo2", "olmo2"),
                               ("olmo3", "olmo3")]:
        cfg = AutoConfig.for_model(model_type)
        rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
        assert rope["rope_theta"] == FAMILY_DEFAULTS[family]["rope_theta"], family
        assert cfg.rms_norm_eps == FAMILY_DEFAULTS[family]["rms_norm_eps"], family
        assert cfg.tie_word_embeddings == FAMILY_DEFAULTS[family]["tie_word_embeddings"], family
    assert AutoConfig.for_model("olmo").tie_word_embeddings == FAMILY_DEFAULTS["olmo"]["tie_word_embeddings"]


def test_legacy_rope_config_format_reads_like_the_new_one():
    """Hub configs written by transformers 4 carry `rope_theta` + `rope_scaling` (with "type" or "rope_type")."""
    new = hf_config("llama").to_dict()
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy.update(architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                  rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=16))
    new["architectures"] = ["LlamaForCausalLM"]
    a, b = ModelArgs.from_hf_config(new), ModelArgs.from_hf_config(legacy)
    assert a.rope_parameters["full_attention"]["rope_theta"] == b.rope_parameters["full_attention"]["rope_theta"] == 500000.0
    assert b.rope_parameters["full_attention"]["rope_type"] == "llama3"


# ------------------------------------------------------------------------------------- decoding's short forms


def test_rope_and_norm_short_forms_give_the_plain_formulas_bits():
    """apply_rope's roll against a sign-folded sin table, and RMSNorm's single F.rms_norm call (CPU, float32, no
    autograd), give exactly the bits of the formulas they replace: x cos + cat(-x2, x1) sin, and weight * (x /
    sqrt(mean(x^2) + eps)) as the autograd path computes it; both within rounding of float64."""
    from ppo_core.models.model import RMSNorm, apply_rope

    g = torch.Generator().manual_seed(0)
    for shape, table in (((2, 3, 5, 8), (2, 1, 5, 8)), ((1, 7, 3, 8), (1, 7, 1, 8))):  # head- and token-major
        x, cos, sin = (torch.randn(s, generator=g) for s in (shape, table, table))
        x1, x2 = x.chunk(2, -1)
        plain = x * cos + torch.cat((-x2, x1), -1) * sin
        signed = torch.cat((-sin[..., :4], sin[..., 4:]), -1)
        assert torch.equal(apply_rope(x, cos, signed), plain)
        xd = x.double()
        reference = xd * cos.double() + torch.cat((-xd[..., 4:], xd[..., :4]), -1) * sin.double()
        torch.testing.assert_close(apply_rope(x, cos, signed).double(), reference, rtol=0, atol=1e-6)
    norm = RMSNorm(12, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    x = 3 * torch.randn(2, 5, 12, generator=g)
    with torch.no_grad():
        short = norm(x)
    plain = norm(x)  # autograd on: the op-by-op path
    assert plain.requires_grad and torch.equal(short, plain.detach())
    xd = x.double()
    reference = norm.weight.double() * xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(short.double(), reference, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- cache and generate


@pytest.mark.parametrize("family", ["llama", "qwen2_sliding", "qwen3", "smollm3", "olmo", "olmo2", "olmo3",
                                    "olmo3_yarn"])
def test_kv_cache_decoding_matches_full_forward(checkpoints, family):
    """Prefill 5 tokens (left-padded batch), then decode the rest one at a time: the logits of every step equal
    a full forward over the whole sequence, also after the sliding window has filled."""
    model = load_model(checkpoints[family][1]).eval()
    ids, mask = ids_and_mask()
    P = 5
    with torch.no_grad():
        full = model(ids, mask)
        cache = KVCache(model.args, ids.shape[0], SEQ, ids.device, torch.float32)
        steps = [model(ids[:, :P], mask[:, :P], cache=cache)]
        for t in range(P, SEQ):
            steps.append(model(ids[:, t : t + 1], mask[:, t : t + 1], cache=cache))
    assert max_diff_real(torch.cat(steps, 1), full, mask) <= TOL


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_sliding", "qwen3", "smollm3_sliding", "olmo", "olmo2",
                                    "olmo3"])
def test_generate_greedy_matches_transformers_and_one_by_one(checkpoints, family):
    """Greedy decoding of a left-padded batch gives the tokens of each prompt decoded alone, and those of
    transformers' generate (which also derives positions from the attention mask)."""
    hf, path = checkpoints[family]
    model = load_model(path).eval()
    ids, mask = ids_and_mask(T=6)
    new = 10  # prompt + new > the sliding window
    batch = ppo_core.generate(model, ids, new, attention_mask=mask, greedy=True, stop_at_eos=False)
    for b in range(ids.shape[0]):
        alone = ids[b : b + 1, mask[b].bool()]
        one = ppo_core.generate(model, alone, new, greedy=True, stop_at_eos=False)
        assert torch.equal(one[0], batch[b]), f"row {b}"
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
    assert torch.equal(ref, batch)


# ---------------------------------------------------------------------------------------- save and load


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_sliding", "qwen3", "smollm3", "olmo", "olmo2",
                                    "olmo3_yarn"])
def test_save_load_round_trip_and_transformers_loads_it(checkpoints, tmp_path, family):
    """ppo_core -> save_pretrained -> ppo_core is exact; transformers loads the same files to the same logits;
    config.json is written back as it came."""
    hf, path = checkpoints[family]
    model = load_model(path)
    with torch.no_grad():  # a trained policy differs from its checkpoint
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = str(tmp_path / "saved")
    model.save_pretrained(out)
    again = load_model(out)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)
    ref = AutoModelForCausalLM.from_pretrained(out).eval()
    ids, mask = ids_and_mask()
    with torch.no_grad():
        assert max_diff_real(model.eval()(ids, mask), hf_logits(ref, ids, mask), mask) <= TOL


def test_sharded_checkpoints_load_both_ways(checkpoints, tmp_path):
    hf, _ = checkpoints["qwen3"]
    sharded = str(tmp_path / "hf-sharded")
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    model = load_model(sharded).eval()
    ids, mask = ids_and_mask()
    with torch.no_grad():
        assert max_diff_real(model(ids, mask), hf_logits(hf, ids, mask), mask) <= TOL
    ours = str(tmp_path / "ours-sharded")
    model.save_pretrained(ours, max_shard_size=40_000)
    shards = sorted(f for f in os.listdir(ours) if f.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors" not in shards
    ref = AutoModelForCausalLM.from_pretrained(ours).eval()
    with torch.no_grad():
        assert max_diff_real(model(ids, mask), hf_logits(ref, ids, mask), mask) <= TOL
    model.save_pretrained(ours)  # back to one file: the shards and index of the earlier save are gone
    assert sorted(f for f in os.listdir(ours) if "safetensors" in f) == ["model.safetensors"]


def test_load_to_bfloat16_casts_on_the_way(checkpoints):
    model = load_model(checkpoints["olmo2"][1], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref = load_model(checkpoints["olmo2"][1])
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b.to(torch.bfloat16)), name


def test_errors_name_the_problem(checkpoints, tmp_path):
    _, path = checkpoints["llama_bias"]
    broken = tmp_path / "broken"
    broken.mkdir()
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    (broken / "config.json").write_text(json.dumps({**cfg, "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture 'MixtralForCausalLM'"):
        load_model(str(broken))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        count_parameters({**cfg, "architectures": ["GPT2LMHeadModel"]})
    # a checkpoint without one layer's k_proj bias
    model = load_model(path)
    state = {k: v for k, v in model.state_dict().items() if k != "model.layers.2.self_attn.k_proj.bias"}
    (broken / "config.json").write_text(json.dumps(cfg))
    from ppo_core.models.model import write_safetensors
    write_safetensors(str(broken / "model.safetensors"), state)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model.layers.2.self_attn.k_proj.bias"):
        load_model(str(broken))
    with pytest.raises(CheckpointError, match="not a causal LM"):
        load_model(checkpoints_reward_path(tmp_path))
    with pytest.raises(CheckpointError, match="a reward model is one of"):
        load_reward_model(path)
    with pytest.raises(CheckpointError, match="rope_type 'dynamic' is not supported"):
        ModelArgs.from_hf_config({**cfg, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    (broken / "model.safetensors").write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(str(broken))


def checkpoints_reward_path(tmp_path):
    path = str(tmp_path / "rm")
    write_hf(path, "qwen3", cls=AutoModelForSequenceClassification, num_labels=1)
    return path


# ------------------------------------------------------------------------------------------ reward models


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_reward_model_scores_match_transformers(tmp_path, family):
    """score(ids, mask) on right-padded input equals transformers' pooled logits; on left-padded input it equals
    transformers on the unpadded rows; last_token="pad_token_id" reproduces transformers' rule exactly."""
    path = str(tmp_path / "rm")
    hf = write_hf(path, family, cls=AutoModelForSequenceClassification, num_labels=1)
    rm = load_reward_model(path).eval()
    assert rm.args.hf_config["architectures"] == [f"{family.title()}ForSequenceClassification"]
    ids, left_mask = ids_and_mask()
    lengths = left_mask.sum(-1)
    right = torch.zeros_like(ids)  # pad id 0
    right_mask = torch.zeros_like(left_mask)
    for b, n in enumerate(lengths.tolist()):
        right[b, :n] = ids[b, SEQ - n :]
        right_mask[b, :n] = 1
    with torch.no_grad():
        ref = hf(input_ids=right, attention_mask=right_mask).logits.squeeze(-1)  # [B]
        assert (rm.score(right, right_mask) - ref).abs().max() <= TOL
        assert (rm.score(ids, left_mask) - ref).abs().max() <= TOL  # left padding, same rows
        assert (rm.score(right, right_mask, last_token="pad_token_id") - ref).abs().max() <= TOL
        # A real token equal to the pad id (pad == eos, a final EOS): transformers scores the token before it.
        with_eos = right.clone()
        with_eos[0, lengths[0] - 1] = 0
        ref_eos = hf(input_ids=with_eos, attention_mask=right_mask).logits.squeeze(-1)
        assert (rm.score(with_eos, right_mask, last_token="pad_token_id") - ref_eos).abs().max() <= TOL
        assert (rm.score(with_eos, right_mask)[0] - ref_eos[0]).abs() > 100 * TOL  # the mask rule reads the EOS
        values = rm(right, right_mask)  # [B, T] float32: the critic reading
        assert values.shape == right.shape and values.dtype == torch.float32
    out = str(tmp_path / "saved")
    rm.save_pretrained(out)
    assert "score.weight" in read_safetensors_header(open(os.path.join(out, "model.safetensors"), "rb"))[0]
    with torch.no_grad():
        ref2 = AutoModelForSequenceClassification.from_pretrained(out).eval()(input_ids=right, attention_mask=right_mask)
        assert (ref2.logits.squeeze(-1) - ref).abs().max() <= TOL


def test_critic_initialised_from_causal_lm(checkpoints, tmp_path):
    _, path = checkpoints["olmo2"]
    lm = load_model(path).eval()
    critic = load_score_model(path).eval()
    ids, mask = ids_and_mask()
    with torch.no_grad():
        assert torch.equal(critic.model(ids, mask), lm(ids, mask, return_hidden=True))
        assert torch.equal(critic(ids, mask), torch.zeros(ids.shape))
    assert critic.score_head.weight.requires_grad
    out = str(tmp_path / "critic")
    critic.save_pretrained(out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["Olmo2ForSequenceClassification"] and cfg["num_labels"] == 1
    with torch.no_grad():  # a trained critic, reloaded by both libraries
        critic.score_head.weight.normal_()
    critic.save_pretrained(out)
    ref = AutoModelForSequenceClassification.from_pretrained(out).eval()
    right, right_mask = torch.flip(ids, [1]), torch.flip(mask, [1])  # right padding, pad id 0
    with torch.no_grad():
        expected = ref(input_ids=right, attention_mask=right_mask).logits.squeeze(-1)
        assert (load_score_model(out).score(right, right_mask) - expected).abs().max() <= TOL


# ------------------------------------------------------------------------- training switches and sizes


@pytest.mark.parametrize("family", ["qwen3", "smollm3", "olmo", "olmo3"])
def test_gradient_checkpointing_gives_the_same_gradients(checkpoints, family):
    model = load_model(checkpoints[family][1]).train()
    ids, mask = ids_and_mask()
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.model.gradient_checkpointing = checkpointing
        (model(ids, mask).float().pow(2) * mask[..., None]).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


PUBLISHED = {"Qwen2.5-1.5B-Instruct": 1.54e9,
             "Qwen3-0.6B": 0.596e9, "Qwen3-1.7B": 1.721e9, "Qwen3-4B": 4.023e9, "Qwen3-8B": 8.191e9,
             "OLMo-1B-0724-hf": 1.280e9, "SmolLM2-135M": 0.135e9, "SmolLM2-360M": 0.362e9}


@pytest.mark.skipif(not os.path.isdir(CONFIGS), reason="no configs/models")
def test_parameter_counts_of_real_configs():
    for name, published in PUBLISHED.items():
        n = count_parameters(os.path.join(CONFIGS, name))
        assert abs(n - published) / published < 0.005, (name, n)
    for name in ("Qwen2.5-1.5B-Instruct", "Qwen3-0.6B", "OLMo-1B-0724-hf"):  # exact: transformers on the meta device
        with torch.device("meta"):
            ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.path.join(CONFIGS, name)))
        assert count_parameters(os.path.join(CONFIGS, name)) == sum(p.numel() for p in ref.parameters()), name


RSS_SCRIPT = textwrap.dedent("""
    import sys, torch, ppo_core
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    with torch.device("meta"):  # a one-time ~150 MB of torch's meta-device machinery, whatever the model size
        torch.nn.Embedding(2, 2)
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    model = ppo_core.load_model(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
    print(status("VmHWM") - before)
""")


def test_peak_memory_while_loading_stays_near_the_checkpoint_size(tmp_path):
    """A ~100 MB float32 checkpoint loads with peak RSS growth < 1.3x its size (in a fresh process)."""
    args = ModelArgs(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                     hf_config={"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192,
                                "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
                                "num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": True})
    ppo_core.CausalLM(args).save_pretrained(str(tmp_path))
    size = os.path.getsize(tmp_path / "model.safetensors")
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path), "float32"], capture_output=True, text=True)
    if run.returncode and "clear_refs" in run.stderr:
        pytest.skip("cannot reset the peak RSS in this environment")
    assert run.returncode == 0, run.stderr
    growth = int(run.stdout.split()[-1])
    assert growth < 1.3 * size, f"peak RSS grew by {growth / 1e6:.0f} MB for a {size / 1e6:.0f} MB checkpoint"
