"""The Qwen2 family beyond parity (tests/test_model_parity.py checks it against transformers with the other
families): the memory planner on the real Qwen2.5-1.5B-Instruct config, and LoRA on a model whose q/k/v
projections carry a bias.

    python -m pytest -q tests/test_qwen2.py
"""
import json
import os

import pytest
import torch

from ppo_core.run import plan
from ppo_core.models.lora import LoRALinear, add_lora, count_lora_parameters, save_merged
from ppo_core.models.model import CausalLM, ModelArgs, load_model
from random_weights import randomize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN25_15B = os.path.join(ROOT, "configs", "models", "Qwen2.5-1.5B-Instruct")
TINY = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=131, hidden_size=60,
            intermediate_size=86, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
            tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768, max_window_layers=21,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


def test_plan_reads_the_qwen25_config(capsys):
    """ppo-plan --policy configs/models/Qwen2.5-1.5B-Instruct --lora-rank 64: the published 1.54 B parameters
    (tied embeddings, q/k/v biases) and the adapters counted by hand."""
    assert plan.main(["--policy", QWEN25_15B, "--lora-rank", "64", "--json"]) == 0
    roles = json.loads(capsys.readouterr().out)["roles"]
    H, I, V, L, kv, r = 1536, 8960, 151936, 28, 2 * 128, 64
    # embeddings (tied) + per layer: q, k, v with bias, o without, SwiGLU, two norms + the final norm
    params = V * H + L * ((H * H + H) + 2 * (H * kv + kv) + H * H + 3 * H * I + 2 * H) + H
    assert roles["policy"]["params"] == params == 1543714304
    # adapters r (in + out) on q, k, v, o, gate, up, down of every layer
    assert roles["policy"]["trainable_params"] == L * r * (2 * (H + H) + 2 * (H + kv) + 3 * (H + I)) == 73859072
    assert roles["critic"]["params"] == params + H  # the backbone's parameters, the LM head tied: + a [1, H] head
    assert plan.main(["--policy", QWEN25_15B]) == 0  # the table, as a user reads it
    assert "1.54B" in capsys.readouterr().out


def test_lora_on_biased_projections_merges_into_a_checkpoint_that_loads(tmp_path):
    """Adapters on q/k/v (which keep their bias) and o: the adapted projection is W x + b + s B A x, the count
    is the planner's, and the merged checkpoint loads back to the adapted model's logits."""
    model = randomize(CausalLM(ModelArgs.from_hf_config(dict(TINY))), seed=0).eval()
    add_lora(model, rank=4, alpha=8.0)
    assert count_lora_parameters(model) == plan.model_shape(dict(TINY), score=False, lora_rank=4)["lora"]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters as after some training
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) / m.in_features ** 0.5)
                m.lora_B.copy_(0.3 * torch.randn(m.lora_B.shape, generator=g))
    q_proj = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 60, generator=g, dtype=torch.float64)
    with torch.no_grad():  # float64 reference of the adapted projection
        W, b, A, B = (t.detach().double() for t in (q_proj.weight, q_proj.bias, q_proj.lora_A, q_proj.lora_B))
        expected = x @ W.T + b + 2.0 * (x @ A.T) @ B.T
        assert (q_proj(x.float()).double() - expected).abs().max() < 1e-5
    ids = torch.randint(3, 131, (2, 9), generator=g)
    with torch.no_grad():
        adapted = model(ids)
    save_merged(model, tmp_path)
    with torch.no_grad():
        assert (load_model(tmp_path)(ids) - adapted).abs().max() <= 1e-4
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - adapted).abs().max() <= 1e-4
        assert adapted.abs().max() > 1.0  # logits that actually vary
