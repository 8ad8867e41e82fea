"""Loading files that are not what they claim (issue 38, item 4): a crafted or damaged safetensors file, config.json,
tokenizer or chat template is refused with one line naming the file, quickly and before anything is allocated; an
intact checkpoint loads to exactly the tensors the `safetensors` library reads.

    python -m pytest -q tests/test_hostile_load.py

A tiny Llama (random weights, saved with the library's own save_pretrained, the demo's tokenizer beside it) is the
intact checkpoint; each test damages a copy as an attacker or a bad disk would.
"""
import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

import ppo_core.train as train
from ppo_core.models.model import CausalLM, CheckpointError, ModelArgs, load_model, load_score_model, read_safetensors
from ppo_core.models.tokenizer import load_tokenizer
from ppo_core.train import DEMO_CHECKPOINT
from random_weights import randomize

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=29, hidden_size=32,
              intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
              tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)


@pytest.fixture
def ckpt(tmp_path):
    """A tiny checkpoint directory: config.json, model.safetensors, the demo's tokenizer files."""
    path = tmp_path / "ckpt"
    randomize(CausalLM(ModelArgs.from_hf_config(dict(CONFIG)))).save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO_CHECKPOINT, name), path / name)
    return path


def split(file):
    """-> (header dict, data bytes) of a safetensors file, read without any checking."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(file, header, data):
    raw = json.dumps(header).encode()
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def refused(load, file, *words):
    """load() raises a one-line CheckpointError naming `file` (and each of `words`) in under a second."""
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as error:
        load()
    elapsed = time.perf_counter() - start
    message = str(error.value)
    assert "\n" not in message and str(file) in message, message
    for word in words:
        assert word in message, message
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    return message


# ---------------------------------------------------------------------------------------------- the intact file

def test_intact_checkpoint_loads_the_tensors_the_safetensors_library_reads(ckpt):
    reference = load_file(ckpt / "model.safetensors")
    model = load_model(ckpt)
    params = dict(model.named_parameters())
    assert set(reference) == set(params)
    for name, tensor in reference.items():
        assert torch.equal(params[name].data, tensor), name
    ours = read_safetensors(ckpt / "model.safetensors")  # the reader checkpoint.py can call
    assert list(ours) == list(reference) or set(ours) == set(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


def test_intact_checkpoint_cast_on_load(ckpt):
    reference = load_file(ckpt / "model.safetensors")
    model = load_model(ckpt, dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param.data, reference[name].to(torch.bfloat16)), name


def test_intact_sharded_checkpoint(ckpt, tmp_path):
    sharded = tmp_path / "sharded"
    load_model(ckpt).save_pretrained(str(sharded), max_shard_size=20_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    reference = {k: v for shard in shards for k, v in load_file(shard).items()}
    params = dict(load_model(sharded).named_parameters())
    for name, tensor in reference.items():
        assert torch.equal(params[name].data, tensor), name


# ---------------------------------------------------------------------------------------------- crafted headers

def test_every_tensor_at_offset_zero(ckpt):
    file = ckpt / "model.safetensors"
    header, data = split(file)
    for name, info in header.items():
        if name != "__metadata__":
            begin, end = info["data_offsets"]
            info["data_offsets"] = [0, end - begin]
    join(file, header, data)
    refused(lambda: load_model(ckpt), file, "overlap")


def test_begin_four_bytes_before_the_end(ckpt):
    file = ckpt / "model.safetensors"
    header, data = split(file)
    header["model.norm.weight"]["data_offsets"] = [len(data) - 4, len(data)]
    join(file, header, data)
    refused(lambda: load_model(ckpt), file, "model.norm.weight")


def test_overlapping_tensors(ckpt):
    file = ckpt / "model.safetensors"
    header, data = split(file)
    info = header["model.norm.weight"]
    info["data_offsets"] = [info["data_offsets"][0] - 4, info["data_offsets"][1] - 4]  # right size, 4 bytes early
    join(file, header, data)
    refused(lambda: load_model(ckpt), file, "model.norm.weight")


def test_header_length_of_two_to_the_sixty(ckpt):
    file = ckpt / "model.safetensors"
    raw = file.read_bytes()
    file.write_bytes((2 ** 60).to_bytes(8, "little") + raw[8:])
    refused(lambda: load_model(ckpt), file, "header")


@pytest.mark.parametrize("header", [b"[1, 2, 3]", b'{"a": [1]}', b"{" * 100_000, b"\xff\xfe not utf-8"],
                         ids=["list", "entry-not-object", "nested", "not-utf8"])
def test_header_not_an_object_of_objects(ckpt, header):
    file = ckpt / "model.safetensors"
    file.write_bytes(len(header).to_bytes(8, "little") + header)
    refused(lambda: load_model(ckpt), file)


@pytest.mark.parametrize("change", [
    lambda info: info.pop("data_offsets"),
    lambda info: info.update(data_offsets=[0]),
    lambda info: info.update(data_offsets=["0", "128"]),
    lambda info: info.update(shape=[-1, 32]),
    lambda info: info.update(shape="32"),
    lambda info: info.update(dtype="F33"),
])
def test_malformed_entry(ckpt, change):
    file = ckpt / "model.safetensors"
    header, data = split(file)
    change(header["model.embed_tokens.weight"])
    join(file, header, data)
    refused(lambda: load_model(ckpt), file, "model.embed_tokens.weight")


def test_truncated_file(ckpt):
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    refused(lambda: load_model(ckpt), file)
    refused(lambda: read_safetensors(file), file)


def test_trailing_bytes(ckpt):
    """Data past the last tensor: the file is not what its header describes (the safetensors library refuses it)."""
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes() + b"\0" * 8)
    refused(lambda: load_model(ckpt), file)


def test_the_critic_path_reads_through_the_same_checks(ckpt):
    file = ckpt / "model.safetensors"
    header, data = split(file)
    header["model.norm.weight"]["data_offsets"] = [len(data) - 4, len(data)]
    join(file, header, data)
    refused(lambda: load_score_model(ckpt), file, "model.norm.weight")


def test_sharded_index_that_points_outside_the_checkpoint(ckpt, tmp_path):
    sharded = tmp_path / "sharded"
    load_model(ckpt).save_pretrained(str(sharded), max_shard_size=20_000)
    index = sharded / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    name = next(iter(content["weight_map"]))
    content["weight_map"][name] = "../ckpt/model.safetensors"
    index.write_text(json.dumps(content))
    refused(lambda: load_model(sharded), index, "../ckpt/model.safetensors")
    index.write_text("{not json")
    refused(lambda: load_model(sharded), index)


def test_damaged_shard_is_named(ckpt, tmp_path):
    sharded = tmp_path / "sharded"
    load_model(ckpt).save_pretrained(str(sharded), max_shard_size=20_000)
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    header, data = split(shard)
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 4]
    join(shard, header, data)
    refused(lambda: load_model(sharded), shard, name)


# ---------------------------------------------------------------------------------------------- config.json

@pytest.mark.parametrize("change, key", [
    (dict(num_hidden_layers=10 ** 9), "num_hidden_layers"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(num_hidden_layers="4"), "num_hidden_layers"),
    (dict(hidden_size=33), "hidden_size"),  # not a multiple of num_attention_heads (and no head_dim)
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps"),
    (dict(layer_types="full_attention"), "layer_types"),
    (dict(rope_scaling="linear"), "rope_scaling"),
    (dict(tie_word_embeddings="no"), "tie_word_embeddings"),
    (dict(architectures=[{"LlamaForCausalLM": 1}]), "architectures"),
])
def test_config_out_of_range_or_of_the_wrong_type(ckpt, change, key):
    file = ckpt / "config.json"
    file.write_text(json.dumps(dict(CONFIG, **change)))
    refused(lambda: load_model(ckpt), file, f"'{key}'")


def test_config_missing_a_key(ckpt):
    file = ckpt / "config.json"
    file.write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "intermediate_size"}))
    refused(lambda: load_model(ckpt), file, "'intermediate_size'")


@pytest.mark.parametrize("text", ["[1, 2]", '"config"', "{not json", "\"\\ud800\"", "[" * 100_000],
                         ids=["list", "string", "not-json", "surrogate", "nested"])
def test_config_that_is_not_a_json_object(ckpt, text):
    file = ckpt / "config.json"
    file.write_text(text)
    refused(lambda: load_model(ckpt), file)


def test_config_describing_a_bigger_model_than_the_file_allocates_nothing(ckpt):
    """Every key in range, but the model it describes (32 layers of 16384) is ~0.5 TB in float32: the header check
    refuses it before a byte is allocated, since the file holds none of those tensors."""
    file = ckpt / "config.json"
    file.write_text(json.dumps(dict(CONFIG, num_hidden_layers=32, hidden_size=16384, intermediate_size=53248)))
    refused(lambda: load_model(ckpt), ckpt, "shape")


# ---------------------------------------------------------------------------------------------- tokenizer files

@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", b"{not json"),
    ("tokenizer.json", b"[]"),
    ("tokenizer_config.json", b"{not json"),
    ("tokenizer_config.json", b"[1, 2]"),
    ("tokenizer_config.json", b'{"eos_token": 7}'),
    ("tokenizer_config.json", b'{"chat_template": [1, 2]}'),
    ("special_tokens_map.json", b"\xff\xfe"),
    ("chat_template.jinja", b"\xff\xfe{{ not utf-8 }}"),
    ("chat_template.jinja", b"{% for %}"),
    ("generation_config.json", b"{not json"),
])
def test_tokenizer_file_that_is_not_what_it_claims(ckpt, name, content):
    file = ckpt / name
    file.write_bytes(content)
    refused(lambda: load_tokenizer(ckpt), file)


def test_intact_tokenizer_still_loads(ckpt):
    tok = load_tokenizer(ckpt)
    assert tok.decode(tok.encode("abc")) == "abc"


# ---------------------------------------------------------------------------------------------- end to end

SMALL = ["--iterations=1", "--eval_size=8", "--rollout_batch_size=16", "--minibatch_size=16",
         "--micro_batch_size=16", "--ppo_epochs=1", "--progress=false"]


@pytest.mark.parametrize("damage", ["offsets", "config"])
def test_ppo_train_with_a_crafted_policy_exits_2_with_one_line(ckpt, tmp_path, capsys, damage):
    if damage == "offsets":
        file = ckpt / "model.safetensors"
        header, data = split(file)
        header["model.norm.weight"]["data_offsets"] = [len(data) - 4, len(data)]
        join(file, header, data)
    else:
        file = ckpt / "config.json"
        file.write_text(json.dumps(dict(CONFIG, num_hidden_layers=10 ** 9)))
    assert train.main([f"--policy={ckpt}", f"--out={tmp_path / 'run'}", *SMALL]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppo-train: error: ") and str(file) in lines[0], err
    assert not (tmp_path / "run").exists()
