"""Calculator tool: allowed arithmetic evaluates; everything else gives None without raising."""

from __future__ import annotations

import pytest

from raychat.calculator import calculate, eval_expression


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("12*(3+4)", "84"),
        ("1,000+1", "1001"),
        ("1,234,567 - 1", "1234566"),
        ("1,000.5*2", "2001"),
        ("4000000000000000*2.0", "8000000000000000"),  # a whole float below 2**53: every digit exact
        ("1000000000000000000/3", "3.33333333333e+17"),  # was "333333333333333312": made-up digits
        ("12345678901234567*1.0", "1.23456789012e+16"),  # was "12345678901234568"
        ("7/2", "3.5"),
        ("84/2", "42"),
        ("1/3", "0.333333333333"),
        ("10//3", "3"),
        ("-7//2", "-4"),
        ("17 % 5", "2"),
        ("-(2+3)*4", "-20"),
        ("+5", "5"),
        ("0.1*3", "0.3"),
        ("(((1)))", "1"),
        ("'apple'.count('p')", "2"),  # the spelling task's call
        ("'strawberry'.count('r')", "3"),
        ("'banana'.count('an')", "2"),
        (" 'kiwi'.count('z') ", "0"),
        ("''.count('a')", "0"),
    ],
)
def test_allowed(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "2**99999",
        "2**3",
        "__import__('os')",
        "signal.raise_signal(9)",
        "1+" * 4999 + "11",  # 10,000 characters
        "x+1",
        "(1).real",
        "[1,2][0]",
        "1,2",  # a tuple, not a thousands separator
        "1.234,567",  # a comma after the decimal point: was read as 1.234567
        "3.14,159",
        "(1.5,100)",  # a tuple: was 1.51
        "1,000.5,000",
        "1<2",
        "'a'*3",
        "'apple'.count(p)",
        "'apple'.count('')",
        "'apple'.count('p', 2)",
        '"apple".count("p")',
        "'apple'.upper()",
        "'ap\\'ple'.count('p')",
        "'apple'.count('p')+1",
        "1/0",
        "5%0",
        "",
        "   ",
        "1e400",
        "9" * 19,  # above MAX_MAGNITUDE 10**18
        "999999999*999999999*999999999",
        "1 +",
        "1\n+1",
    ],
)
def test_rejected_gives_none(expression):
    assert eval_expression(expression) is None
    assert calculate(expression) is None


def test_non_string_gives_none():
    assert eval_expression(None) is None
    assert eval_expression(12) is None
