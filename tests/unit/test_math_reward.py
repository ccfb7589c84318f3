"""The math reward scores only an answer the completion states, never an expression it copied
from the question: math-verify alone finds "86 + 40" in "To add 86 + 40, we need" equal to 126."""

import pytest

from asyncrl.rewards import MathReward, exact_match, numeric_match
from asyncrl.rewards.extract import stated_answer

STATES_NO_ANSWER = [
    # replies a model learned in 12 GRPO steps under math-verify on the whole completion
    ("To calculate 94 + 99, you simply", "193"),
    ("To add 86 + 40, we need", "126"),
    ("63 * 2 =", "126"),
    ("What is 63 * 2?", "126"),
    # replies Gemma 3 270M learned in 20 GRPO steps when math-verify read "73 10" as 73 + 10
    ("\n\nA 73 10 = 73 10\n\n", "83"),
    ("\n\nA 69 89 = 69 89\n\n", "158"),
    # restatements and partial expressions
    ("86 + 40", "126"),
    ("2+2", "4"),
    ("86-40", "46"),
    ("86 -40", "46"),
    ("$86 + 40$", "126"),
    ("What is $63 \\times 2$?", "126"),
    ("\\boxed{86+40}", "126"),
    ("The answer is 86 + 40.", "126"),
    ("126 = 86 + 40", "126"),
    ("73 10", "83"),
    ("\\boxed{73 10}", "83"),
    ("The answer is 73 10.", "83"),
    ("x = 73\\,10", "83"),
    ("$73~10$", "83"),
    ("86/2", "43"),
    ("126\n\nTo add 86 + 40", "126"),
    # trailing operators
    ("86 +", "86"),
    ("86 + 40 =", "126"),
    ("63 \\times", "63"),
    # nothing stated, or the statement cut off
    ("", "19"),
    ("The answer is", "19"),
    ("\\boxed{12", "12"),
    ("x^2", "2"),
    # a stated answer that is wrong
    ("18", "19"),
    ("126. Actually 127", "126"),
    ("86 + 40 = 126. Check: 126 - 40 = 85", "126"),
]

STATES_THE_ANSWER = [
    ("126", "126"),
    ("86 + 40 = 126", "126"),
    ("The answer is 126.", "126"),
    ("the answer: 126", "126"),
    ("**Answer:** 126", "126"),
    ("The answer is 126, because 86 + 40 = 126", "126"),
    ("86 + 40 = 126. To check, we", "126"),
    ("The answer is 126. Let me verify: 126 - 40 =", "126"),
    ("So $63 \\times 2 = 126$.", "126"),
    ("$19$", "19"),
    ("-5", "-5"),
    ("The result is -5.", "-5"),
    ("19.0", "19"),
    ("1,000 apples", "1000"),
    ("The answer is 42 apples.", "42"),
    ("x = 1/2", "0.5"),
    ("1/2", "0.5"),
    ("0.5", "1/2"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("The answer is \\boxed{\\frac{1}{2}}, so 1 + 1 = 2", "0.5"),
    ("The result is $\\frac{1}{2}$.", "0.5"),
    ("\\boxed{1 + 2\\sqrt{3}}", "$1 + 2\\sqrt{3}$"),
    ("\\boxed{2\\,\\sqrt{3}}", "$2\\sqrt{3}$"),
    ("\\(x = \\sqrt{2}\\)", "$\\sqrt{2}$"),
]


@pytest.fixture(scope="module")
def math_reward():
    return MathReward()


@pytest.mark.parametrize("completion, answer", STATES_NO_ANSWER)
def test_a_completion_that_states_no_right_answer_scores_0(math_reward, completion, answer):
    assert math_reward(completion, answer) == 0.0


@pytest.mark.parametrize("completion, answer", STATES_THE_ANSWER)
def test_a_stated_right_answer_scores_1_in_any_form(math_reward, completion, answer):
    assert math_reward(completion, answer) == 1.0


@pytest.mark.parametrize(
    "completion, stated",
    [
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{x = 5} and the answer is 6", "x = 5"),
        ("The answer is 6. Also 7 = 7", "6"),
        ("86 + 40 = 126. Then 5", "5"),
        ("x = \\frac{1}{2}$.", "\\frac{1}{2}"),
        ("(-5", "-5"),
        ("To add 86 + 40, we need", None),
        ("\\boxed{}", None),
    ],
)
def test_the_stated_answer_is_taken_in_order_of_precedence(completion, stated):
    assert stated_answer(completion) == stated


@pytest.mark.parametrize("reward", [exact_match, numeric_match])
def test_exact_and_numeric_match_score_no_restatement(reward):
    assert [reward(c, "126") for c in ("86 + 40", "86+40=", "To add 86 + 40, we need 126")] == [0.0] * 3
