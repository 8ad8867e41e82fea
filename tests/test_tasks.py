"""The built-in tasks' prompts and rewards (ppo_core/data/tasks.py): hand-worked arith cases, held-out sets, resume."""
import re

import pytest

from ppo_core.data.tasks import (
    PromptStream,
    arith_answer,
    arith_answer_reward,
    arith_reward,
    arith_rewards,
    eval_prompts,
    random_prompt,
    reverse_rewards,
)

ARITH_FORMAT = re.compile(r"([1-9]\d{1,2})([+-])([1-9]\d{1,2})=")


@pytest.mark.parametrize("prompt, answer", [
    ("347+85=", 432), ("904-388=", 516), ("99+1=", 100), ("999+999=", 1998), ("10-10=", 0), ("100-99=", 1),
    ("1204-388=", 816),  # any number of digits parses
])
def test_arith_answer(prompt, answer):
    assert arith_answer(prompt) == answer


@pytest.mark.parametrize("prompt", ["kitten=", "3*4=", "347+85", "-3+4=", "1+2+3=", ""])
def test_arith_answer_rejects_other_text(prompt):
    with pytest.raises(ValueError, match="not an arith prompt"):
        arith_answer(prompt)


@pytest.mark.parametrize("response, reward", [
    ("#### 432", 1.0),
    ("####432", 1.0),
    ("#### 432 ", 1.0),
    ("#### 0432", 1.0),         # the same number
    ("#### 432.0", 1.0),
    ("#### 433", 0.0),
    ("432", 0.0),               # no "####": the format is part of the task
    ("#### 432 apples", 0.0),   # only the number may follow
    ("#### 4 32", 0.0),
    ("#### ", 0.0),
    ("", 0.0),
    ("#### 1 #### 432", 1.0),   # the last "####"
])
def test_arith_reward(response, reward):
    assert arith_reward(response, 432) == reward
    assert arith_reward(response, "432") == reward


def test_arith_rewards_from_prompt_and_from_answer_column():
    prompts = ["347+85=", "904-388=", "55+15=", "605-50="]
    responses = ["#### 432", "#### 684", "#### 70", "555"]
    assert arith_rewards(prompts, responses) == [1.0, 0.0, 1.0, 0.0]
    # the "answer" column of a dataset, as ints or as strings (JSON gives either)
    assert arith_answer_reward(prompts, responses, answer=[432, 816, 70, 555]) == [1.0, 0.0, 1.0, 0.0]
    assert arith_answer_reward(prompts, responses, answer=["432", "684", "71", "555"]) == [1.0, 1.0, 0.0, 0.0]


def test_arith_eval_prompts_are_distinct_well_formed_and_cover_both_operations():
    held_out = eval_prompts(256, seed=0, task="arith")
    assert len(held_out) == 256 == len(set(held_out))
    assert held_out == eval_prompts(256, seed=0, task="arith")  # fixed by the seed
    assert held_out != eval_prompts(256, seed=1, task="arith")
    ops, digits = set(), set()
    for p in held_out:
        m = ARITH_FORMAT.fullmatch(p)
        assert m, p
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert a >= b, p  # the larger operand first: a subtraction never goes negative
        assert arith_answer(p) >= 0
        ops.add(op)
        digits |= {len(m.group(1)), len(m.group(3))}
    assert ops == {"+", "-"} and digits == {2, 3}


@pytest.mark.parametrize("task", ["reverse", "arith"])
def test_prompt_stream_skips_held_out_and_resumes(task):
    held_out = eval_prompts(256, seed=0, task=task)
    stream = PromptStream(0, held_out, task)
    first = stream.next_batch(300)
    assert not set(first) & set(held_out)
    state = stream.state_dict()
    expected_next = stream.next_batch(50)
    resumed = PromptStream(0, held_out, task)
    resumed.load_state_dict(state)
    assert resumed.next_batch(50) == expected_next


def test_arith_stream_never_yields_a_held_out_prompt():
    """A held-out set made of the stream's own first prompts: the stream must skip every one of them."""
    held_out = PromptStream(0, [], "arith").next_batch(40)
    assert not set(PromptStream(0, held_out, "arith").next_batch(200)) & set(held_out)


def test_reverse_task_unchanged():
    """The default job's prompts, as they were before the arith task existed (seed 0)."""
    assert eval_prompts(4, seed=0) == ["pfkphr=", "cwnv=", "fthw=", "wng="]
    assert PromptStream(0, eval_prompts(256, seed=0)).next_batch(3) == ["htyvjj=", "wxnttcaf=", "ydbds="]
    assert reverse_rewards(["kitten=", "kitten=", "kitten="], ["nettik", "kitten", "nettak"]) == [1.0, 2 / 6, 5 / 6]


def test_unknown_task():
    import random

    with pytest.raises(ValueError, match="unknown task"):
        random_prompt(random.Random(0), "sort")


# ---------------------------------------------------------------------------------------- toolmul

def test_toolmul_rows_are_products_held_out_and_streamed_apart():
    from ppo_core.data.tasks import ToolmulStream, toolmul_row, toolmul_rows

    assert toolmul_row("123*456") == {"prompt": "123*456", "answer": "56088"}  # 123 * 456 = 56088, by hand
    with pytest.raises(ValueError):
        toolmul_row("123+456")
    held_out = toolmul_rows(64, seed=0)
    assert held_out == toolmul_rows(64, seed=0) and held_out[:8] == toolmul_rows(8, seed=0)
    assert len({r["prompt"] for r in held_out}) == 64
    for row in held_out:
        a, b = map(int, row["prompt"].split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["answer"] == str(a * b)
    stream = ToolmulStream(0, [r["prompt"] for r in held_out])
    first = stream.next_batch(200)
    assert not {r["prompt"] for r in first} & {r["prompt"] for r in held_out}
    state = stream.state_dict()
    more = stream.next_batch(5)
    resumed = ToolmulStream(0, [r["prompt"] for r in held_out])
    resumed.load_state_dict(state)
    assert resumed.next_batch(5) == more
