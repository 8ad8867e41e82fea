"""ppo_core/rewards/judges.py: the verdict parsers on hand-written judge outputs, the both-orders pairwise reward on
hand-worked cases, judge prompts through a chat template, and the shipped tiny judge (ppo_core/demo/judge-demo)
scoring reverse-task answers whose true rewards are known (tasks.reverse_reward)."""
import os
import shutil

import pytest
import torch

from ppo_core.rewards.judges import (RATIONALE_HEADERS, JudgeError, JudgeReward, pairwise_reward, parse_pairwise,
                             parse_pointwise, render_judge_prompt, resolve_template)
from ppo_core.rewards.interface import RewardError
from ppo_core.data.tasks import reverse_reward

JUDGE = os.path.join(os.path.dirname(__file__), "..", "ppo_core", "demo", "judge-demo")


# ---------------------------------------------------------------------------------------------------- parsers

@pytest.mark.parametrize("text, expected", [
    ("Score: 7", 7.0),
    ("The response is fine.\n\nScore: 8", 8.0),
    ("nn1 ee2 tt3 tt4 ia4 kk5 Score: 5/6", 5 / 6),  # the tiny judge's form: a fraction is its value
    ("**Overall Score**: 8/10", 0.8),
    ("the final score is 6.5.", 6.5),
    ("I would give it a score of 7 out of 10", 0.7),
    ("Rating: [[6]]", 6.0),  # MT-Bench's single-answer format
    ("so the grade is \\boxed{9}", 9.0),
    ("\\boxed{\\frac{3}{4}}", 0.75),  # nested braces inside \boxed
    ("<score>4</score>", 4.0),
    ("Accuracy score: 3. Clarity score: 9. Overall score: 6", 6.0),  # the last one is the verdict
    ("Score: 2 ... on reflection \\boxed{5}", 5.0),  # \boxed wins over the words
    ("<think>Score: 3 seems harsh</think>\nScore: 8", 8.0),  # the reasoning is skipped
    ("<think>Score: 3 seems harsh, but", None),  # cut off while thinking: no verdict
    ("Score: [[A]]", None),
    ("\\boxed{A}", None),
    ("This response is good.", None),
    ("", None),
])
def test_parse_pointwise(text, expected):
    value = parse_pointwise(text)
    if expected is None:
        assert value is None
    else:
        assert value == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text, expected", [
    ("[[A]]", "A"),
    ("Both are short, but B misspells two letters. [[A]]", "A"),
    ("nnk10 eei20 ttt31 ttt42 iae42 kkn52 A=5/6 B=2/6 [[A]]", "A"),  # the tiny judge's form
    ("<rubric>...</rubric><eval>...</eval><answer>[[B]]</answer>", "B"),  # RM-R1
    ("<think>\nFeedback: ...\n</think>\n<answer>\nA\n</answer>", "A"),  # GRAM-R^2
    ("B", "B"),  # GRAM: the letter alone
    ("#Preferred: B", "B"),
    ("Final verdict: **A**", "A"),
    ("The better response is Response B.", "B"),
    ("I first leaned to [[A]], but on reflection [[B]]", "B"),  # the last verdict wins
    ("[[C]]", "tie"),  # MT-Bench's tie
    ("<think>[[A]] looks right</think>The better response is B", "B"),
    ("<think>[[A]] looks right, though", None),  # cut off while thinking
    ("Response A is better.", None),  # no verdict form: not guessed
    ("a", None),  # the letter must be a capital
    ("[[D]]", None),
    ("", None),
])
def test_parse_pairwise(text, expected):
    assert parse_pairwise(text) == expected


@pytest.mark.parametrize("ab, ba, unparsed, expected", [
    ("A", "B", 0.0, 1.0),  # the policy's response wins in both orders
    ("B", "A", 0.0, 0.0),  # the reference wins in both orders
    ("A", "A", 0.0, 0.5),  # always the first position: position bias cancels to 0.5
    ("B", "B", 0.0, 0.5),
    (None, "B", 0.0, 0.5),  # (0 + 1) / 2
    (None, "B", -1.0, 0.0),  # (-1 + 1) / 2
    (None, None, 0.25, 0.25),
    ("tie", "B", 0.0, 0.75),  # (0.5 + 1) / 2
    ("tie", "tie", 0.0, 0.5),
])
def test_pairwise_reward_both_orders(ab, ba, unparsed, expected):
    assert pairwise_reward(ab, ba, unparsed) == expected


def test_pairwise_reward_tie_score():
    assert pairwise_reward("tie", "A", 0.0, tie_score=0.0) == 0.0
    assert pairwise_reward("tie", "B", 0.0, tie_score=1.0) == 1.0


# ---------------------------------------------------------------------------------------------------- templates

def test_shipped_templates_render():
    pointwise, path = resolve_template("pointwise", "pointwise")
    assert path.endswith(os.path.join("judge_templates", "pointwise.jinja"))
    text = render_judge_prompt(pointwise, prompt="What is 2+2?", response="5")
    assert "[Request]\nWhat is 2+2?\n\n[Response]\n5" in text and "Score: N" in text
    pairwise, _ = resolve_template(None, "pairwise")  # no judge directory: the shipped one
    text = render_judge_prompt(pairwise, prompt="Q", response_a="first", response_b="second")
    assert text.endswith("[Request]\nQ\n\n[Response A]\nfirst\n\n[Response B]\nsecond")
    assert "[[A]]" in text and "[[B]]" in text


def test_judge_checkpoint_template_wins_and_templates_fail_clearly(tmp_path):
    own, path = resolve_template(None, "pointwise", JUDGE)
    assert path == os.path.join(JUDGE, "pointwise.jinja")
    assert render_judge_prompt(own, prompt="kitten=", response="nettak") == "rate kitten=nettak|"
    with pytest.raises(JudgeError, match="does not render: UndefinedError: 'response' is undefined"):
        render_judge_prompt(own, prompt="kitten=")
    with pytest.raises(JudgeError, match="does not parse"):
        render_judge_prompt("{{ prompt ", prompt="x")
    with pytest.raises(JudgeError, match="does not render: SecurityError"):  # the sandbox, as for chat templates
        render_judge_prompt("{{ prompt.__class__.__mro__ }}", prompt="x")
    with pytest.raises(JudgeError, match="no such file, and not a shipped template"):
        resolve_template(str(tmp_path / "missing.jinja"), "pointwise")


# ---------------------------------------------------------------------------------------------------- the tiny judge

@pytest.fixture(scope="module")
def pointwise_judge():
    return JudgeReward(JUDGE, "pointwise", max_new_tokens=64)


@pytest.fixture(scope="module")
def pairwise_judge():
    return JudgeReward(JUDGE, "pairwise", max_new_tokens=96)


# held-out prompts (tasks.eval_prompts(256, seed=0)), which the demo judge never saw in training, with answers whose
# rewards are worked by hand: correct, one letter misspelt, copied, cut short, run on
ANSWERS = [("pfkphr=", "rhpkfp"), ("pfkphr=", "rhpkap"), ("pfkphr=", "pfkphr"), ("cwnv=", "vnwc"), ("cwnv=", "vnw"),
           ("rgkuf=", "fukgr"), ("rgkuf=", "rgkuf"), ("zcvftlt=", "tltfvczab")]
TRUE_REWARDS = [1.0, 5 / 6, 0.0, 1.0, 3 / 4, 1.0, 1 / 5, 7 / 9]


def test_pointwise_judge_scores_reverse_answers(pointwise_judge):
    prompts, responses = zip(*ANSWERS)
    scores, metrics = pointwise_judge(prompts, responses)
    assert [reverse_reward(p, r) for p, r in ANSWERS] == TRUE_REWARDS  # the hand-worked rewards are the task's
    assert scores.dtype == torch.float32 and scores.shape == (len(ANSWERS),)
    assert torch.equal(scores, torch.tensor(TRUE_REWARDS, dtype=torch.float32))
    assert metrics["judge/unparsed"].tolist() == [0.0] * len(ANSWERS)
    assert metrics["judge/truncated"].tolist() == [0.0] * len(ANSWERS)
    assert metrics["judge/rationale"][1] == "rr1 hh2 pp3 kk4 fa4 pp5 Score: 5/6"
    assert scores[0] > scores[1] > scores[2]  # correct beats misspelt beats copied


def test_pairwise_judge_prefers_the_better_answer_in_both_orders(pairwise_judge):
    prompts = ["pfkphr=", "pfkphr=", "pfkphr=", "cwnv=", "rgkuf="]
    policy = ["rhpkfp", "pfkphr", "rhpkap", "vnwc", "fukgr"]
    reference = ["pfkphr", "rhpkfp", "rhpkap", "cwnv", "rgkuf"]  # row 2: the same answer twice, a tie
    rewards, metrics = pairwise_judge(prompts, policy, columns={"reference": reference})
    assert rewards.tolist() == [1.0, 0.0, 0.5, 1.0, 1.0]
    assert metrics["judge/unparsed"].tolist() == [0.0] * 5
    assert metrics["judge/consistent"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]  # the tie names one position twice
    for order in ("judge/pref_policy_as_a", "judge/pref_policy_as_b"):
        assert [metrics[order][i].item() for i in (0, 1, 3, 4)] == [1.0, 0.0, 1.0, 1.0]
    first = metrics["judge/rationale"][0]
    assert first.startswith(RATIONALE_HEADERS[0]) and RATIONALE_HEADERS[1] in first
    as_a, as_b = first[len(RATIONALE_HEADERS[0]):].split(RATIONALE_HEADERS[1])
    assert as_a == "rrp10 hhf20 ppk30 kkp40 ffh50 ppr60 A=6/6 B=0/6 [[A]]"
    assert as_b == "rpr01 hfh02 pkp03 kpk04 fhf05 prp06 A=0/6 B=6/6 [[B]]"


def test_judge_batches_do_not_change_verdicts(pointwise_judge):
    """Left padding: a judge prompt decodes the same in a batch of 8 as alone (batch_size=1)."""
    prompts, responses = zip(*ANSWERS)
    alone = JudgeReward(JUDGE, "pointwise", max_new_tokens=64, batch_size=1)
    assert alone(prompts, responses)[1]["judge/rationale"] == pointwise_judge(prompts, responses)[1]["judge/rationale"]


def test_unparsed_verdicts_get_the_configured_score():
    """A judgement cut short (max_new_tokens too small for the score) has no verdict: unparsed_score, counted."""
    short = JudgeReward(JUDGE, "pointwise", max_new_tokens=6, unparsed_score=0.25)
    scores, metrics = short(["pfkphr=", "cwnv="], ["rhpkfp", "cwnv"])
    assert scores.tolist() == [0.25, 0.25]
    assert metrics["judge/unparsed"].tolist() == [1.0, 1.0] and metrics["judge/truncated"].tolist() == [1.0, 1.0]
    assert metrics["judge/rationale"] == ["rr1 hh", "vc0 nw"]
    pairwise = JudgeReward(JUDGE, "pairwise", max_new_tokens=8, unparsed_score=-1.0)
    rewards, metrics = pairwise(["pfkphr="], ["rhpkfp"], columns={"reference": ["pfkphr"]})
    assert rewards.tolist() == [-1.0] and metrics["judge/unparsed"].tolist() == [1.0]


def test_pairwise_needs_its_reference_column(pairwise_judge):
    pairwise_judge.check_columns(["reference", "answer"])
    with pytest.raises(RewardError, match=r"column .reference. holds the reference .*\(it has no extra columns\)"):
        pairwise_judge.check_columns([])
    with pytest.raises(RewardError, match="column 'reference'"):
        pairwise_judge(["kitten="], ["nettik"], columns={"answer": ["nettik"]})
    with pytest.raises(RewardError, match="column 'reference' holds 2 values for 1 prompts"):
        pairwise_judge(["kitten="], ["nettik"], columns={"reference": ["a", "b"]})


def test_template_columns_and_bad_judges(tmp_path):
    template = tmp_path / "with_rubric.jinja"
    template.write_text("rate {{ prompt }}{{ response }}{{ rubric }}|")
    judge = JudgeReward(JUDGE, "pointwise", template=str(template), max_new_tokens=64)
    assert judge.needed_columns() == ["rubric"]
    with pytest.raises(RewardError, match="column 'rubric' is read by the judge template"):
        judge.check_columns(["reference"])
    # the rubric column lands in the prompt: an empty rubric renders the tiny judge's own prompt
    scores, _ = judge(["kitten="], ["nettak"], columns={"rubric": [""]})
    assert scores.tolist() == [pytest.approx(5 / 6)]
    with pytest.raises(JudgeError, match="never reads 'response_a'"):
        JudgeReward(JUDGE, "pairwise", template="pointwise")
    with pytest.raises(JudgeError, match="judge mode 'listwise'"):
        JudgeReward(JUDGE, "listwise")
    with pytest.raises(JudgeError, match="no such directory"):
        JudgeReward(str(tmp_path / "nowhere"), "pointwise")
    with pytest.raises(JudgeError, match="has no chat template"):
        JudgeReward(JUDGE, "pointwise", chat_template=True)


CHAT_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and not enable_thinking %}"
                 "[nothink]{% endif %}{% endif %}")


def test_judge_prompt_is_the_user_turn_of_the_judge_chat_template(tmp_path):
    judge_dir = tmp_path / "judge-with-chat"
    shutil.copytree(JUDGE, judge_dir)
    (judge_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok_path = str(judge_dir)
    chat = JudgeReward(tok_path, "pointwise", max_new_tokens=4)  # chat_template=None: the judge's own, found
    assert chat.use_chat_template
    # the characters outside the judge's alphabet are its <unk>: compare ids with the tokenizer's own encoding
    expected = "[user]rate kitten=nettak|[assistant][nothink]"
    assert chat.encode("rate kitten=nettak|") == chat.tokenizer.encode(expected)
    thinking = JudgeReward(tok_path, "pointwise", max_new_tokens=4, enable_thinking=True)
    assert thinking.encode("rate kitten=nettak|") == chat.tokenizer.encode("[user]rate kitten=nettak|[assistant]")
    raw = JudgeReward(tok_path, "pointwise", max_new_tokens=4, chat_template=False)
    assert raw.encode("rate kitten=nettak|") == chat.tokenizer.encode("rate kitten=nettak|")
    # the rendered judge prompt (not the policy's raw prompt) is what reaches the chat template
    assert chat.encode(render_judge_prompt(chat.template, prompt="kitten=", response="nettak")) == \
        chat.tokenizer.encode(expected)
