"""Hostile input (issue 38, items 7, 11, 12): prompt files read a row at a time with a size cap per row, every JSON
failure a PromptsError naming the file and line, an over-long prompt named by its file and line or dropped and
counted, and every config problem listed in one error, an unknown key answered with the nearest known ones."""
import json
import time
import tracemalloc

import pytest

import ppo_core.data.prompts as prompts
import ppo_core.train as train
from ppo_core.config import ConfigError, build_config, parse_cli
from ppo_core.data.prompts import MAX_ROW_BYTES, PromptsError, load_rows

SMALL = ["--iterations=1", "--eval_size=2", "--rollout_batch_size=4", "--minibatch_size=4", "--micro_batch_size=4",
         "--ppo_epochs=1", "--progress=false"]


def error_of(path) -> str:
    with pytest.raises(PromptsError) as e:
        load_rows(path)
    return str(e.value)


# ---------------------------------------------------------------------------- item 7: rows streamed, capped

@pytest.mark.parametrize("name, head, tail", [
    ("big.jsonl", b'{"prompt": "ok"}\n{"prompt": "', b'"}\n'),
    ("big.txt", b"ok\n", b"\n"),
    ("big.json", b'[{"prompt": "ok"},\n {"prompt": "', b'"}]\n'),
], ids=["jsonl", "txt", "json-array"])
def test_a_50_mb_row_is_refused_fast_with_bounded_memory(tmp_path, name, head, tail):
    path = tmp_path / name
    with open(path, "wb") as f:
        f.write(head)
        for _ in range(50):  # 50 MB, a MiB at a time
            f.write(b"x" * (1 << 20))
        f.write(tail)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        message = error_of(path)
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    where = f"{path}: row 2" if name.endswith(".json") else f"{path}:2"
    assert message.startswith(where) and "4 MiB" in message, message
    assert seconds < 2, seconds
    # the file is 50 MB; memory held one row's cap of it (a JSON array's window, and the copy that extends it)
    assert peak < 3 * MAX_ROW_BYTES, peak


def test_a_row_at_the_cap_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "MAX_ROW_BYTES", 8)
    path = tmp_path / "p.txt"
    path.write_bytes(b"12345678\r\n123456789\n")
    assert error_of(path) == f"{path}:2: the line is longer than 0 MiB, the most a prompts file's row may hold; " \
                             f"nothing after its first MiBs was read"
    path.write_bytes(b"12345678\r\nabc")
    assert load_rows(path) == [{"prompt": "12345678"}, {"prompt": "abc"}]


@pytest.mark.parametrize("row, reason", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # RecursionError inside json
    ('{"prompt": "a", "n": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits)"),  # ValueError: int digits
], ids=["nesting-bomb", "5000-digits"])
def test_json_that_python_cannot_decode_names_file_and_line(tmp_path, row, reason):
    lines = tmp_path / "bomb.jsonl"
    lines.write_text('{"prompt": "ok"}\n' + row + "\n")
    message = error_of(lines)
    assert message.startswith(f"{lines}:2: not valid JSON (") and reason in message, message
    array = tmp_path / "bomb.json"
    array.write_text('[{"prompt": "ok"},\n' + row + "]\n")
    message = error_of(array)
    assert message.startswith(f"{array}: row 2: not valid JSON (") and reason in message, message


def test_json_array_read_in_windows_equals_json_loads(tmp_path, monkeypatch):
    """A window far smaller than the file: the items, and a syntax error's line and column, are json.loads' own."""
    monkeypatch.setattr(prompts, "MAX_ROW_BYTES", 64)
    items = [{"prompt": f"p{i} é", "answer": [i, {"x": "y" * (i % 7)}]} if i % 3 else f"s{i}" for i in range(200)]
    path = tmp_path / "a.json"
    text = "[\n" + ",\n   ".join(json.dumps(item, ensure_ascii=False) for item in items) + "  \n]\n\n"
    path.write_text(text)
    assert load_rows(path) == [item if isinstance(item, dict) else {"prompt": item} for item in items]
    for broken in (text.replace('"p151 é"', '"p151 é" 1'), text.replace(", \"answer\": [190", " \"answer\": [190"),
                   text + "x"):
        path.write_text(broken)
        with pytest.raises(json.JSONDecodeError) as reference:
            json.loads(broken)
        e = reference.value
        assert error_of(path) == f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"


# ---------------------------------------------------------------------------- item 11: prompts longer than the context

def overlong_file(tmp_path):
    path = tmp_path / "prompts.txt"  # the demo policy's context is 64 tokens; line 4 is 70 characters long
    path.write_text("abc=\nde=\nfgh=\n" + "x" * 70 + "=\nij=\nklm=\nno=\n")
    return path


def test_a_prompt_longer_than_the_context_names_file_and_line(tmp_path, capsys):
    path = overlong_file(tmp_path)
    assert train.main([f"--prompts_file={path}", f"--out={tmp_path / 'r'}", *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ppo-train: error: config key 'prompts_file': {path}:4: the prompt has ")
    assert "exceeds the model's context of 64 tokens (drop_overlong_prompts=true drops such rows)" in err[-1]
    assert not (tmp_path / "r").exists()


def test_drop_overlong_prompts_drops_and_counts(tmp_path, capsys):
    path = overlong_file(tmp_path)
    out = tmp_path / "r"
    assert train.main([f"--prompts_file={path}", f"--out={out}", "--drop_overlong_prompts", *SMALL]) == 0
    first_lines = capsys.readouterr().err.splitlines()[:6]  # the run's log lines go to stderr
    assert any("prompts: 1 rows dropped (drop_overlong_prompts)" in line for line in first_lines), first_lines
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["prompts/dropped_overlong"] for m in metrics] == [1]


# ---------------------------------------------------------------------------- item 12: config problems, all at once

def config_error(argv) -> str:
    with pytest.raises(ConfigError) as e:
        own, overrides = parse_cli(argv)
        build_config({}, overrides)
    return str(e.value)


def test_every_conflict_in_one_error():
    message = config_error(["--minibatch_size=128", "--micro_batch_size=256"])
    assert message == ("2 config problems: config key 'minibatch_size' must be <= rollout_batch_size * "
                       "n_samples_per_prompt (64), got 128; config key 'micro_batch_size' must be <= minibatch_size "
                       "(128), got 256")
    message = config_error(["--learning_rate=1e-3", "--minibatch_size=128", "--micro_batch_size=256"])
    assert message == ("3 config problems: unknown config key 'learning_rate' (did you mean 'lr'?); config key "
                       "'minibatch_size' must be <= rollout_batch_size * n_samples_per_prompt (64), got 128; config key "
                       "'micro_batch_size' must be <= minibatch_size (128), got 256")
    # a value of the wrong type stops before the checks of values (they would check the default in its place)
    message = config_error(["--lr=fast", "--clip_low=high", "--gama=1"])
    assert message.startswith("3 config problems: ") and "'lr'" in message and "'clip_low'" in message
    assert "unknown config key 'gama' (did you mean 'gamma'?)" in message


@pytest.mark.parametrize("argv, hint", [
    (["--learning_rate=1e-3"], "unknown config key 'learning_rate' (did you mean 'lr'?)"),
    (["--minibatch_szie", "8"], "unknown config key 'minibatch_szie' (did you mean 'minibatch_size'"),
    (["--num_generations=8"], "unknown config key 'num_generations' (did you mean 'n_samples_per_prompt'"),
    (["--beta=0.04"], "unknown config key 'beta' (did you mean 'kl_coef'"),
])
def test_unknown_key_suggests_the_known_one(argv, hint):
    assert config_error(argv).startswith(hint)


@pytest.mark.parametrize("key, meant", [  # issue 47: by meaning, other libraries' names (and a typo of one) included
    ("clip_ratio", "'clip_low' or 'clip_high'"),  # TRL's, verl's
    ("clip_ration", "'clip_low' or 'clip_high'"),  # was: 'iterations' or 'clip_low' or 'min_lr_ratio'
    ("cliprange", "'clip_low' or 'clip_high'"),
    ("epsilon_high", "'clip_high'"),
    ("init_kl_coef", "'kl_coef'"), ("kl_coeff", "'kl_coef'"), ("kl_loss_coef", "'kl_coef'"), ("beta", "'kl_coef'"),
    ("num_generations", "'n_samples_per_prompt'"),
    ("per_device_train_batch_size", "'micro_batch_size' or 'minibatch_size'"),
    ("ppo_micro_batch_size_per_gpu", "'micro_batch_size'"),
    ("learning_rate", "'lr'"), ("critic_learning_rate", "'critic_lr'"),
    ("gae_lambda", "'lam'"), ("entropy_coeff", "'entropy_coef'"), ("output_dir", "'out'"),
])
def test_unknown_key_names_the_field_it_means_and_nothing_else(key, meant):
    assert config_error([f"--{key}=1"]) == f"unknown config key '{key}' (did you mean {meant}?)"


def test_unknown_keys_in_a_toml_file_are_listed_together(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_config({"learning_rate": 1e-3, "max_completion_length": 64}, toml_path="c.toml")
    assert str(e.value) == ("2 config problems: unknown config key 'learning_rate' in c.toml (did you mean 'lr'?); "
                            "unknown config key 'max_completion_length' in c.toml (did you mean 'max_new_tokens'?)")


def test_unknown_key_through_ppo_train_is_one_line_exit_2(tmp_path, capsys):
    assert train.main(["--learning_rate", "1e-3", f"--out={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert err == "ppo-train: error: unknown config key 'learning_rate' (did you mean 'lr'?)\n"
    assert not (tmp_path / "r").exists()
