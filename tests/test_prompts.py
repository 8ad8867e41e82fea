"""Prompt files read into rows (text, JSON lines, JSON arrays, Parquet), every bad row's one-line message,
extra columns, the raw prompt of a chat row, the held-out split, and the resumable row stream."""
import json
import random
import sys

import pytest

from ppo_core.data.prompts import PromptsError, RowStream, columns_of, load_rows, prompt_text, split_held_out

CHAT = [{"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+5?"}]


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def write_parquet(path, items):
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(items), path)
    return path


# ------------------------------------------------------------------ formats

def test_text_file_one_prompt_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"abc=\n\n   \n  two words \r\nlast")  # blank lines skipped, spaces kept, \r\n is a newline
    rows = load_rows(path)
    assert rows == [{"prompt": "abc="}, {"prompt": "  two words "}, {"prompt": "last"}]


def test_any_other_extension_is_text(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text('{"prompt": "not parsed"}\nb,c\n')
    assert load_rows(path) == [{"prompt": '{"prompt": "not parsed"}'}, {"prompt": "b,c"}]


def test_jsonl_rows_keep_their_extra_columns(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n\n'
                    '{"prompt": "x\u2028y", "answer": "3", "meta": {"level": [1, null]}}\n'
                    + json.dumps({"messages": CHAT, "answer": 8}) + "\n")
    assert load_rows(path) == [{"prompt": "1+1=", "answer": 2},
                               {"prompt": "x\u2028y", "answer": "3", "meta": {"level": [1, None]}},
                               {"messages": CHAT, "answer": 8}]


def test_jsonl_prompts_are_kept_as_written(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a="}, {"prompt": " b ", "id": 1}])
    assert [row["prompt"] for row in load_rows(path)] == ["a=", " b "]


def test_json_file_holding_json_lines(tmp_path):
    path = write_jsonl(tmp_path / "p.json", [{"prompt": "a=", "answer": 1}, {"prompt": "b=", "answer": 2}])
    assert load_rows(path) == [{"prompt": "a=", "answer": 1}, {"prompt": "b=", "answer": 2}]


def test_json_array_of_objects_and_of_strings(tmp_path):
    objects = tmp_path / "objects.json"
    objects.write_text(json.dumps([{"prompt": "a=", "answer": 1.5}, {"messages": CHAT[1:2], "answer": None}],
                                  indent=2))
    assert load_rows(objects) == [{"prompt": "a=", "answer": 1.5}, {"messages": CHAT[1:2], "answer": None}]
    strings = tmp_path / "strings.json"
    strings.write_text('\n ["a=", "b="]')
    assert load_rows(strings) == [{"prompt": "a="}, {"prompt": "b="}]


def test_parquet_rows_with_chat_and_null_columns(tmp_path):
    # one table, both prompt columns: each row has one of them null; 'answer' is null in the last row
    path = write_parquet(tmp_path / "p.parquet", [
        {"prompt": "1+1=", "messages": None, "answer": 2, "tags": ["easy"]},
        {"prompt": None, "messages": CHAT, "answer": 8, "tags": []},
        {"prompt": "2+2=", "messages": None, "answer": None, "tags": ["easy", "sum"]},
    ])
    assert load_rows(path) == [
        {"prompt": "1+1=", "answer": 2, "tags": ["easy"]},
        {"messages": CHAT, "answer": 8, "tags": []},
        {"prompt": "2+2=", "answer": None, "tags": ["easy", "sum"]},
    ]


def test_verl_parquet_layout_chat_under_prompt(tmp_path):
    # verl's examples/data_preprocess writes the chat as a list under "prompt" and the answer inside a struct
    path = write_parquet(tmp_path / "gsm8k.parquet", [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2+2?"}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "4"}},
    ])
    rows = load_rows(path)
    assert rows == [{"data_source": "openai/gsm8k", "messages": [{"role": "user", "content": "2+2?"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "4"}}]
    assert prompt_text(rows[0]) == "2+2?"
    assert columns_of(rows) == {"data_source": ["openai/gsm8k"], "ability": ["math"],
                                "reward_model": [{"style": "rule", "ground_truth": "4"}]}


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "a="}])
    # a None entry in sys.modules makes `import pyarrow` raise ImportError, as on an install without it
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PromptsError) as e:
        load_rows(path)
    assert str(e.value) == f"reading {path} needs pyarrow: pip install -e '.[parquet]'"


# ------------------------------------------------------------------ bad files and rows, one line each

def error_of(path) -> str:
    with pytest.raises(PromptsError) as e:
        load_rows(path)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_file_directory_and_empty_files(tmp_path):
    assert error_of(tmp_path / "nope.jsonl") == f"{tmp_path / 'nope.jsonl'}: no such file"
    assert error_of(tmp_path) == f"{tmp_path}: is a directory, not a prompts file"
    for name, text in [("blank.txt", "\n  \n"), ("blank.jsonl", "\n\n"), ("empty.json", "[]")]:
        (tmp_path / name).write_text(text)
        assert error_of(tmp_path / name) == f"{tmp_path / name}: holds no prompts"


def test_unreadable_files(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9\n")
    assert error_of(path) == f"{path}: not UTF-8 text (byte 3: invalid continuation byte)"
    path = tmp_path / "broken.json"
    path.write_text('[{"prompt": "a"},\n {"prompt": }]')
    assert error_of(path) == f"{path}: not valid JSON (Expecting value at line 2 column 13)"
    path = tmp_path / "one_object.json"
    path.write_text('{\n  "prompt": "a="\n}\n')
    assert error_of(path) == f"{path}: holds one JSON object; expected one object per line or a JSON array of objects"
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not a parquet file")
    assert error_of(path) == (f"{path}: cannot read as Parquet: Could not open Parquet input source '{path}': "
                              f"Parquet magic bytes not found in footer. Either the file is corrupted or this is "
                              f"not a parquet file.")


BAD_ROWS = [  # (row, what is wrong)
    ({"answer": 1}, 'needs a "prompt" string or a "messages" list (its keys: answer)'),
    ({}, 'needs a "prompt" string or a "messages" list (its keys: none)'),
    ({"prompt": "a", "messages": CHAT}, 'has both "prompt" and "messages"; give one'),
    ({"prompt": 5}, '"prompt" must be a string, got a number'),
    ({"prompt": ["a"]}, '"prompt" must be a string, got a list'),
    ({"prompt": " \t"}, '"prompt" is empty'),
    ({"messages": "hi"}, '"messages" must be a list of {"role", "content"} turns, got a string'),
    ({"messages": []}, '"messages" is empty'),
    ({"messages": ["hi"]}, 'messages[0] must be an object with "role" and "content", got a string'),
    ({"messages": [{"content": "hi"}]}, 'messages[0] has no "role"'),
    ({"messages": [{"role": "user"}]}, 'messages[0] has no "content"'),
    ({"messages": [CHAT[0], {"role": "user", "content": None}]}, 'messages[1] "content" must be a string, got null'),
    ({"messages": [{"role": "tool", "content": "x"}, CHAT[1]]}, "messages[0] has role 'tool'; expected system, user or assistant"),
    ({"messages": CHAT[:3]}, 'the last turn of "messages" must be a user turn, got assistant'),
    ({"messages": [CHAT[0], {"role": "user", "content": ""}]}, 'the last user turn of "messages" is empty'),
]


@pytest.mark.parametrize("row, wrong", BAD_ROWS)
def test_bad_row_in_json_lines_names_the_line(tmp_path, row, wrong):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + json.dumps(row) + "\n")  # line 2 is blank: the bad row is line 3
    assert error_of(path) == f"{path}:3: {wrong}"


@pytest.mark.parametrize("row, wrong", BAD_ROWS)
def test_bad_row_in_a_json_array_names_the_row(tmp_path, row, wrong):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "fine"}, row], indent=1))
    assert error_of(path) == f"{path}: row 2: {wrong}"


def test_bad_row_in_parquet_names_the_row(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "a=", "answer": 1}, {"prompt": None, "answer": 2}])
    assert error_of(path) == f"{path}: row 2: needs a \"prompt\" string or a \"messages\" list (its keys: answer)"
    path = write_parquet(tmp_path / "q.parquet", [{"prompt": "a=", "messages": CHAT}])
    assert error_of(path) == f"{path}: row 1: has both \"prompt\" and \"messages\"; give one"


def test_json_values_that_are_not_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    assert error_of(path) == f"{path}:2: not valid JSON (Expecting ',' delimiter at column 15)"
    # load_prompts rejected a line that is not an object with "prompt" too (as a RewardError)
    path.write_text('{"prompt": "a"}\n"b"\n')
    assert error_of(path) == f'{path}:2: expected a JSON object with a "prompt" or "messages" field, got a string'
    path = tmp_path / "p.json"
    path.write_text('["a", 3]')
    assert error_of(path) == f"{path}: row 2: expected a JSON object or a string, got a number"
    path.write_text('["a", ""]')
    assert error_of(path) == f'{path}: row 2: "prompt" is empty'


# ------------------------------------------------------------------ what the loop takes from rows

def test_prompt_text_is_the_raw_prompt_or_the_last_user_turn():
    assert prompt_text({"prompt": "1+1=", "answer": 2}) == "1+1="
    assert prompt_text({"messages": CHAT}) == "and 3+5?"
    assert prompt_text({"messages": CHAT[:2]}) == "2+2?"


def test_columns_of_fills_missing_columns_with_none(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n'
                    '{"messages": [{"role": "user", "content": "b"}], "level": "hard"}\n'
                    '{"prompt": "c", "level": "easy", "answer": [3]}\n')
    assert columns_of(load_rows(path)) == {"answer": [1, None, [3]], "level": [None, "hard", "easy"]}
    assert columns_of([{"prompt": "a"}, {"prompt": "b"}]) == {}
    assert columns_of([]) == {}


def test_columns_of_a_parquet_file(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "a=", "answer": "1"}, {"prompt": "b=", "answer": None}])
    assert columns_of(load_rows(path)) == {"answer": ["1", None]}


def test_split_held_out_keeps_at_least_half_for_training():
    rows = [{"prompt": str(i)} for i in range(10)]
    assert split_held_out(rows, 3) == (rows[:7], rows[7:])
    assert split_held_out(rows, 256) == (rows[:5], rows[5:])  # at most half held out
    assert split_held_out(rows[:3], 8) == (rows[:2], rows[2:3])
    assert split_held_out(rows[:2], 1) == (rows[:1], rows[1:2])
    for few in (rows[:1], []):
        with pytest.raises(PromptsError) as e:
            split_held_out(few, 8)
        assert str(e.value) == (f"holding prompts out for evaluation needs at least 2 prompts, got {len(few)}; "
                                f"add prompts or give eval_prompts_file")


def test_row_stream_draws_each_pass_in_its_seeded_permutation():
    rows = [{"prompt": f"p{i}", "index": i} for i in range(7)]
    expected = []  # pass e is range(7) shuffled by random.Random(f"{seed}-{e}"), passes back to back
    for epoch in range(4):
        order = list(range(7))
        random.Random(f"3-{epoch}").shuffle(order)
        expected += order
    stream, drawn = RowStream(rows, seed=3), []
    for n in (3, 5, 1, 9, 4):  # 22 draws: batches that span the end of a pass, a batch longer than a pass
        batch = stream.next_batch(n)
        assert all(row is rows[row["index"]] for row in batch)  # the rows themselves, not copies
        drawn += [row["index"] for row in batch]
    assert drawn == expected[:22]
    assert stream.state_dict() == {"seed": 3, "drawn": 22}
    assert drawn[:7] != drawn[7:14]  # a fresh shuffle each pass


def test_row_stream_resumes_bit_for_bit():
    rows = [{"prompt": f"p{i}"} for i in range(5)]
    uninterrupted = RowStream(rows, seed=11)
    expected = [uninterrupted.next_batch(3) for _ in range(6)]
    first = RowStream(rows, seed=11)
    before = [first.next_batch(3) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = RowStream(rows, seed=0)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert before + [resumed.next_batch(3) for _ in range(2)] == expected
