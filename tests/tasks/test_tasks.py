"""Tests of the synthetic arithmetic tasks and the reward functions."""

import pytest

from evollm.tasks import (
    ARITHMETIC_TEMPLATE,
    arithmetic_dataset,
    clean_completion,
    combine_rewards,
    extra_split,
    exact_match_reward,
    format_reward,
    numeric_closeness_reward,
    solve,
)


def _evaluate(question: str) -> str:
    """Reference answer computed by Python itself."""
    return str(eval(question.rstrip("=")))  # noqa: S307 - digits and one operator only


def test_dataset_shape_and_columns():
    train, test = arithmetic_dataset()
    assert len(train) == 2000 and len(test) == 200
    assert train.column_names == ["question", "answer", "a", "op", "b"]
    assert all(q.endswith("=") for q in test["question"])
    assert all(f"{r['a']}{r['op']}{r['b']}=" == r["question"] for r in test)


def test_dataset_is_deterministic_in_seed():
    a_train, a_test = arithmetic_dataset(n_train=300, n_test=50, ops=("+", "-", "*"), seed=3)
    b_train, b_test = arithmetic_dataset(n_train=300, n_test=50, ops=("+", "-", "*"), seed=3)
    c_train, _ = arithmetic_dataset(n_train=300, n_test=50, ops=("+", "-", "*"), seed=4)
    assert a_train["question"] == b_train["question"] and a_test["question"] == b_test["question"]
    assert a_train["answer"] == b_train["answer"]
    assert a_train["question"] != c_train["question"]


@pytest.mark.parametrize("n_train,n_test,digits", [(2000, 200, (1, 2)), (80, 20, (1, 1)), (300, 100, (2, 3))])
def test_no_train_test_overlap_and_distinct(n_train, n_test, digits):
    train, test = arithmetic_dataset(n_train=n_train, n_test=n_test, digits=digits, seed=1)
    qs_train, qs_test = set(train["question"]), set(test["question"])
    assert not qs_train & qs_test
    assert len(qs_train) == n_train and len(qs_test) == n_test


@pytest.mark.parametrize("ops", [("+",), ("-",), ("*",), ("+", "-", "*")])
def test_answers_are_correct(ops):
    train, test = arithmetic_dataset(n_train=200, n_test=50, ops=ops, digits=(1, 3), seed=0)
    for row in list(train) + list(test):
        assert row["answer"] == _evaluate(row["question"])
        assert solve(row["question"]) == row["answer"]
        assert any(op in row["question"] for op in ops)


def test_operand_digit_range():
    train, _ = arithmetic_dataset(n_train=200, n_test=10, ops=("+",), digits=(2, 3), seed=0)
    for q in train["question"]:
        a, b = q.rstrip("=").split("+")
        assert 2 <= len(a) <= 3 and 2 <= len(b) <= 3


def test_all_ops_are_used():
    train, _ = arithmetic_dataset(n_train=300, n_test=10, ops=("+", "-", "*"), seed=0)
    joined = "".join(train["question"])
    assert all(op in joined for op in "+-*")


def test_too_small_space_raises():
    # One-digit addition has exactly 10 * 10 = 100 distinct questions.
    train, test = arithmetic_dataset(n_train=90, n_test=10, digits=(1, 1))
    assert len(set(train["question"]) | set(test["question"])) == 100
    with pytest.raises(ValueError, match="distinct"):
        arithmetic_dataset(n_train=95, n_test=10, digits=(1, 1))


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        arithmetic_dataset(ops=("/",))
    with pytest.raises(ValueError):
        arithmetic_dataset(digits=(2, 1))
    with pytest.raises(ValueError):
        arithmetic_dataset(ops=())


def test_extra_split_is_disjoint():
    train, test = arithmetic_dataset(n_train=60, n_test=20, digits=(1, 1), seed=0)
    used = set(train["question"]) | set(test["question"])
    extra = extra_split(used, 20, digits=(1, 1), seed=0)
    assert len(set(extra["question"])) == 20 and not set(extra["question"]) & used
    assert all(a == _evaluate(q) for q, a in zip(extra["question"], extra["answer"]))
    assert extra["question"] == extra_split(used, 20, digits=(1, 1), seed=0)["question"]
    with pytest.raises(ValueError):
        extra_split(used, 21, digits=(1, 1))


def test_template_formats():
    messages = [{**m, "content": m["content"].format(question="12+34=")} for m in ARITHMETIC_TEMPLATE]
    assert messages == [{"role": "user", "content": "12+34="}]


def test_exact_match_reward():
    assert exact_match_reward("46", "46", "12+34=") == 1.0
    assert exact_match_reward("46<eos>", "46", "12+34=") == 1.0
    assert exact_match_reward(" 46 \n<eos><pad><pad>", "46", "12+34=") == 1.0
    assert exact_match_reward("46<eos>7", "46", "12+34=") == 1.0
    assert exact_match_reward("46<|user|>1", "46", "12+34=") == 1.0
    assert exact_match_reward("47<eos>", "46", "12+34=") == 0.0
    assert exact_match_reward("467<eos>", "46", "12+34=") == 0.0
    assert exact_match_reward("abc", "46", "12+34=") == 0.0
    assert exact_match_reward("", "46", "12+34=") == 0.0
    assert exact_match_reward("<eos>46", "46", "12+34=") == 0.0
    assert exact_match_reward("-3<eos>", "-3", "4-7=") == 1.0


def test_format_reward():
    assert 0.0 < format_reward("46<eos>", "46", "12+34=") <= 0.2
    assert format_reward("99", "46", "12+34=") == format_reward("46", "46", "12+34=")
    assert format_reward("-5<eos>", "-5", "") > 0
    assert format_reward("4 6", "46", "") == 0.0
    assert format_reward("abc<eos>", "46", "") == 0.0
    assert format_reward("<eos>", "46", "") == 0.0


def test_numeric_closeness_reward():
    assert numeric_closeness_reward("46", "46") == 1.0
    assert numeric_closeness_reward("47", "46") == 0.5
    assert numeric_closeness_reward("x", "46") == 0.0


def test_clean_completion():
    assert clean_completion("  12\n<eos><pad>") == "12"
    assert clean_completion("12<|assistant|>3") == "12"


def test_combine_rewards():
    both = combine_rewards(exact_match_reward, format_reward)
    assert both("46<eos>", "46", "12+34=") == pytest.approx(1.0 + format_reward("46"))
    assert both("47<eos>", "46", "12+34=") == pytest.approx(format_reward("47"))
    weighted = combine_rewards(exact_match_reward, format_reward, weights=[2.0, 0.5])
    assert weighted("46", "46", "") == pytest.approx(2.0 + 0.5 * format_reward("46"))
    assert weighted("nope", "46", "") == 0.0
    with pytest.raises(ValueError):
        combine_rewards(exact_match_reward, weights=[1.0, 2.0])
    with pytest.raises(ValueError):
        combine_rewards()
