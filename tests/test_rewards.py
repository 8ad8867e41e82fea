"""The reward interface: what a reward function may return (and the one-line error for anything else), the prompt
columns it receives by its signature, and several reward functions added up with weights."""
import math

import numpy as np
import pytest
import torch

from ppo_core.config import build_config, load_toml
from ppo_core.rewards.functions import WeightedReward, metric_names
from ppo_core.rewards.source import make_reward_source
from ppo_core.rewards.interface import CallableReward, RewardError

PROMPTS = ["kitten=", "dog=", "mouse=", "ox="]
RESPONSES = ["nettik", "god", "esuom", "xo"]
DICT_FORM = '{"rewards": [one number per response], "<metric>": [one number per response], ...}'
MUST = ("reward function my_rewards.py:score must return a list of numbers, one for each of the 4 responses, "
        f"or a dict {DICT_FORM}; got ")


def returning(value):
    """A reward function that returns `value` whatever it is asked."""
    def score(prompts, responses):
        return value
    return CallableReward(score, "my_rewards.py:score")


# ---------------------------------------------------------------------------------------------------- bad answers

@pytest.mark.parametrize("value, message", [
    # the review's bug #1: a dict {i: score} trained on its keys 0, 1, 2, 3
    ({0: 0.5, 1: 1.0, 2: 0.0, 3: 1.0}, "reward function my_rewards.py:score returned a dict with keys [0, 1, 2, 3]: "
                                       f"a dict must be {DICT_FORM}"),
    ({"score": [1.0] * 4}, f"reward function my_rewards.py:score returned a dict with keys ['score']: a dict must be {DICT_FORM}"),
    # numeric strings were accepted
    (["0.5", "1", "0", "1"], "reward function my_rewards.py:score returned str '0.5' for sample 0 "
                             "(prompt 'kitten=', response 'nettik'): expected an int or float"),
    ([0.5, "good", 0.0, 1.0], "reward function my_rewards.py:score returned str 'good' for sample 1 "
                              "(prompt 'dog=', response 'god'): expected an int or float"),
    ([[0.5], [1.0], [0.0], [1.0]], "reward function my_rewards.py:score returned list [0.5] for sample 0 "
                                   "(prompt 'kitten=', response 'nettik'): expected an int or float"),
    ([1.0, 0.0, None, 1.0], "reward function my_rewards.py:score returned None for sample 2 "
                            "(prompt 'mouse=', response 'esuom'): expected an int or float"),
    ([1.0, 0.0, 1.0, True], "reward function my_rewards.py:score returned bool True for sample 3 "
                            "(prompt 'ox=', response 'xo'): expected an int or float"),
    ([np.bool_(True)] * 4, f"reward function my_rewards.py:score returned bool {np.bool_(True)!r} for sample 0 "
                           "(prompt 'kitten=', response 'nettik'): expected an int or float"),
    ([{"r": 1.0}] * 4, "reward function my_rewards.py:score returned dict {'r': 1.0} for sample 0 "
                       "(prompt 'kitten=', response 'nettik'): expected an int or float"),
    ([0.5, 1.0, 0.0], "reward function my_rewards.py:score returned 3 scores for 4 responses: none for sample 3 "
                      "(prompt 'ox=', response 'xo')"),
    ([0.5] * 5, "reward function my_rewards.py:score returned 5 scores for 4 responses"),
    ([0.5, float("nan"), 0.0, 1.0], "reward function my_rewards.py:score returned nan for sample 1 "
                                    "(prompt 'dog=', response 'god'): expected a finite number"),
    ([0.5, 1.0, -math.inf, 1.0], "reward function my_rewards.py:score returned -inf for sample 2 "
                                 "(prompt 'mouse=', response 'esuom'): expected a finite number"),
    (np.array([0.5, 1.0, 0.0, np.inf]), "reward function my_rewards.py:score returned inf for sample 3 "
                                        "(prompt 'ox=', response 'xo'): expected a finite number"),
    (0.5, MUST + "float 0.5"),
    (None, MUST + "None"),
    ("0.5", MUST + "str '0.5'"),
    (np.zeros((4, 1)), MUST + "ndarray of shape (4, 1) and dtype float64"),
    (torch.tensor(0.5), MUST + "Tensor of shape () and dtype torch.float32"),
    ({"rewards": [1.0] * 4, "acc": [1, 0, "1", 0]}, "reward function my_rewards.py:score returned str '1' in \"acc\" "
                                                    "for sample 2 (prompt 'mouse=', response 'esuom'): expected an int or float"),
    ({"rewards": [1.0] * 4, "acc": [1, 0]}, "reward function my_rewards.py:score returned 2 values in \"acc\" for 4 "
                                            "responses: none for sample 2 (prompt 'mouse=', response 'esuom')"),
    ({"rewards": 1.0}, "reward function my_rewards.py:score returned float 1.0 in \"rewards\": expected a list of "
                       "numbers, one for each of the 4 responses"),
])
def test_bad_answer_is_one_line_naming_function_sample_and_value(value, message):
    with pytest.raises(RewardError) as error:
        returning(value)(PROMPTS, RESPONSES)
    assert str(error.value) == message
    assert "\n" not in str(error.value)


def test_long_prompt_and_value_are_cut_in_the_message():
    prompts, responses = ["p" * 500] + PROMPTS[1:], ["r\n" * 300] + RESPONSES[1:]
    with pytest.raises(RewardError) as error:
        returning(["x" * 1000] * 4)(prompts, responses)
    # the value by reprlib (40 characters), prompt and response: their first 80 characters, newlines escaped
    assert str(error.value) == (f"reward function my_rewards.py:score returned str '{'x' * 17}...{'x' * 18}' for "
                                f"sample 0 (prompt '{'p' * 80}...', response '{('r' + chr(92) + 'n') * 40}...'): "
                                "expected an int or float")


def test_function_that_raises_names_the_first_sample_it_fails_on():
    def score(prompts, responses, answer):
        return [1.0 / len(a) for a in answer]  # ZeroDivisionError on the empty answer

    with pytest.raises(RewardError) as error:
        CallableReward(score, "f.py:score")(PROMPTS, RESPONSES, {"answer": ["a", "bb", "", "c"]})
    assert str(error.value) == ("reward function f.py:score raised ZeroDivisionError: float division by zero on sample 2 "
                                "(prompt 'mouse=', response 'esuom')")


# ---------------------------------------------------------------------------------------------------- good answers

@pytest.mark.parametrize("value", [
    [1, 0.5, 0, -2.25],                                              # ints and floats
    (1, 0.5, 0, -2.25),
    np.array([1, 0.5, 0, -2.25]),
    np.array([1, 0.5, 0, -2.25], dtype=np.float32),
    torch.tensor([1, 0.5, 0, -2.25], dtype=torch.float64),
    torch.tensor([1, 0.5, 0, -2.25], requires_grad=True),
    [np.float64(1), np.float64(0.5), np.float32(0), np.float16(-2.25)],
    [np.int64(1), 0.5, np.int8(0), -2.25],
    [torch.tensor(1), torch.tensor(0.5), torch.tensor(0.0, dtype=torch.bfloat16), np.array(-2.25)],
])
def test_good_answers(value):
    scores, metrics = returning(value)(PROMPTS, RESPONSES)
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.5, 0.0, -2.25] and metrics == {}


def test_dict_answer_gives_rewards_and_metrics():
    scores, metrics = returning({"rewards": [1, 0.5, 0, 1], "acc": (1, 0, 0, 1), "len": np.arange(4)})(PROMPTS, RESPONSES)
    assert scores.tolist() == [1.0, 0.5, 0.0, 1.0]
    assert set(metrics) == {"acc", "len"} and all(m.dtype == torch.float32 for m in metrics.values())
    assert metrics["acc"].tolist() == [1.0, 0.0, 0.0, 1.0] and metrics["len"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------------------------------- columns

COLUMNS = {"answer": ["nettik", "dog", "esuom", "xo"], "level": [1, 2, 3, 4]}


def test_columns_reach_the_parameters_that_name_them():
    seen = {}

    def exact(prompts, responses, answer):
        seen["exact"] = answer
        return [float(r == a) for r, a in zip(responses, answer)]

    def with_default(prompts, responses, answer, *, level=None, bonus=7):
        seen["with_default"] = (level, bonus)
        return [0.0] * len(responses)

    def everything(prompts, responses, **columns):
        seen["everything"] = columns
        return [0.0] * len(responses)

    assert CallableReward(exact, "exact")(PROMPTS, RESPONSES, COLUMNS)[0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert seen["exact"] == COLUMNS["answer"]
    CallableReward(with_default, "with_default")(PROMPTS, RESPONSES, COLUMNS)
    assert seen["with_default"] == ([1, 2, 3, 4], 7)  # a column by keyword-only name; no column 'bonus': its default
    CallableReward(everything, "everything")(PROMPTS, RESPONSES, COLUMNS)
    assert seen["everything"] == COLUMNS
    # a plain (prompts, responses) function ignores the columns
    assert returning([0, 0, 0, 0])(PROMPTS, RESPONSES, COLUMNS)[0].tolist() == [0.0] * 4


def test_missing_column_is_an_error_naming_it():
    def score(prompts, responses, answer):
        return [0.0] * len(responses)

    reward = CallableReward(score, "my_rewards.py:score")
    with pytest.raises(RewardError) as error:
        reward.check_columns(["level"])  # checked before the run starts, from the prompts file's column names
    assert str(error.value) == ("reward function my_rewards.py:score needs column 'answer', which the prompts file "
                                "does not have (its columns: level)")
    with pytest.raises(RewardError) as error:
        reward(PROMPTS, RESPONSES)  # and on the call itself
    assert str(error.value) == ("reward function my_rewards.py:score needs column 'answer', which the prompts file "
                                "does not have (it has no extra columns)")


def test_function_without_prompts_and_responses_is_refused_at_construction():
    def score(responses):
        return [0.0] * len(responses)

    with pytest.raises(RewardError) as error:
        CallableReward(score, "my_rewards.py:score")
    assert str(error.value) == ("reward function my_rewards.py:score must take (prompts, responses) as its first two "
                                "parameters, its signature is (responses)")


# ---------------------------------------------------------------------------------------------------- several, weighted

REWARDS_PY = '''
def exact(prompts, responses, answer):
    return {"rewards": [float(r == a) for r, a in zip(responses, answer)], "long": [float(len(r) > 3) for r in responses]}

def brevity(prompts, responses):
    return [-0.1 * len(r) for r in responses]
'''


def test_weighted_functions_from_a_toml_list_add_up_like_a_plain_loop(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    path = tmp_path / "c.toml"
    path.write_text(f'reward_fn = ["{tmp_path}/my_rewards.py:exact", "{tmp_path}/my_rewards.py:brevity"]\n'
                    'reward_weights = [1.5, 0.3]\n')
    cfg = build_config(load_toml(path), toml_path=str(path))
    assert cfg.reward_fn == [f"{tmp_path}/my_rewards.py:exact", f"{tmp_path}/my_rewards.py:brevity"]
    source = make_reward_source(cfg)
    assert isinstance(source, WeightedReward)
    scores, metrics = source(PROMPTS, RESPONSES, COLUMNS)

    exact = [float(r == a) for r, a in zip(RESPONSES, COLUMNS["answer"])]
    brevity = [-0.1 * len(r) for r in RESPONSES]
    want = [1.5 * e + 0.3 * b for e, b in zip(exact, brevity)]  # Python floats (float64), rounded once
    assert scores.dtype == torch.float32 and torch.equal(scores, torch.tensor(want, dtype=torch.float32))
    assert set(metrics) == {"reward/exact", "reward/exact/long", "reward/brevity"}
    assert torch.equal(metrics["reward/exact"], torch.tensor(exact, dtype=torch.float32))  # unweighted
    assert torch.equal(metrics["reward/brevity"], torch.tensor(brevity, dtype=torch.float32))
    assert metrics["reward/exact/long"].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_one_function_and_the_task_reward_are_wrapped_the_same_way(tmp_path):
    from ppo_core.data.tasks import reverse_rewards

    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    cfg = build_config(overrides={"reward_fn": f"{tmp_path}/my_rewards.py:brevity"})  # weights default to 1.0
    scores, metrics = make_reward_source(cfg)(PROMPTS, RESPONSES)
    brevity = torch.tensor([-0.1 * len(r) for r in RESPONSES], dtype=torch.float32)
    assert torch.equal(scores, brevity) and list(metrics) == ["reward/brevity"]

    scores, metrics = make_reward_source(build_config())(PROMPTS, RESPONSES)  # the 'reverse' task
    want = torch.tensor(reverse_rewards(PROMPTS, RESPONSES), dtype=torch.float32)
    assert torch.equal(scores, want) and list(metrics) == ["reward/reverse"] and torch.equal(metrics["reward/reverse"], want)


def test_a_weighted_sum_names_the_function_that_failed(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    cfg = build_config(overrides={"reward_fn": f"{tmp_path}/my_rewards.py:brevity,{tmp_path}/my_rewards.py:exact"})
    source = make_reward_source(cfg)
    with pytest.raises(RewardError, match=f"^reward function {tmp_path}/my_rewards.py:exact needs column 'answer'"):
        source.check_columns(["level"])


def test_metric_names():
    assert metric_names(["my_rewards.py:score", "pkg.checks:fmt"]) == ["score", "fmt"]
    assert metric_names(["a/x.py:score", "pkg.y:score", "z.py:mean"]) == ["x.score", "pkg.y.score", "z.mean"]
    assert metric_names(["a/x.py:score", "b/x.py:score"]) == ["a/x.py:score", "b/x.py:score"]
