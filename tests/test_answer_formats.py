"""Reference answers as datasets write them, checked by the default math check (math-verify underneath).

MATH stores bare LaTeX (no `$`, no `\\boxed`), GSM8K a worked solution ending in `#### 72`, multiple-choice
sets a letter; references also come as tuples, intervals, and numbers with units or thousands separators.
Each format gets right answers (reward 1) and wrong ones (reward 0), through the environment too.
"""

import asyncio

import pytest

import rlsys.impl.env  # noqa: F401  (registers the environments)
from rlsys.api import EnvServiceAbstraction, make_env
from rlsys.impl.env.math_answers import check_answer, plain_number_verdict, reference_answer
from rlsys.impl.env.math_verifier import close_shared_pool

GSM8K = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
         "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")

FORMATS = {  # format: (reference, right answers, wrong answers)
    "MATH fraction": ("\\frac{1}{2}", ["\\boxed{\\frac12}", "The answer is $0.5$"], ["\\boxed{\\frac13}", "0.6"]),
    "MATH root": ("2\\sqrt{3}", ["\\boxed{2\\sqrt3}", "$\\sqrt{12}$"], ["\\boxed{2}", "\\boxed{3\\sqrt2}"]),
    "MATH expression": ("x^2+1", ["\\boxed{1+x^2}"], ["\\boxed{x^2}", "\\boxed{1}"]),
    "MATH product kept": ("2x", ["\\boxed{2x}", "$x+x$"], ["\\boxed{2}", "\\boxed{x}"]),
    "tuple": ("(3, -1)", ["\\boxed{(3,-1)}", "$(3, -1)$"], ["\\boxed{(3,1)}", "\\boxed{-1}"]),
    "interval": ("[2, 5)", ["\\boxed{[2,5)}"], ["\\boxed{[2,5]}", "\\boxed{5}"]),
    "infinite interval": ("(-\\infty, 3]", ["\\boxed{(-\\infty,3]}"], ["\\boxed{(-\\infty,3)}"]),
    "GSM8K solution": (GSM8K, ["72", "#### 72", "The answer is 72."], ["24", "#### 48"]),
    "GSM8K with separators": ("1,000 + 234 = 1,234 dollars\n#### 1,234", ["1234", "1,234"], ["234", "1"]),
    "choice letter": ("C", ["C", "The answer is C", "\\boxed{C}", "(C)", "Answer: C",
                            "A car goes 3 miles, so B is out: \\boxed{C}",  # not a letter of the prose
                            "In case B the sum is 5, so the answer is (C)."],
                      ["B", "The answer is (D)", "\\boxed{A}", "no idea", "Point C is the midpoint: \\boxed{D}",
                       "In case C the sum is 5, so the answer is (D)."]),
    "MATH choice": ("\\text{(C)}", ["\\boxed{\\text{(C)}}", "C"], ["\\boxed{\\text{(B)}}"]),
    "thousands separator": ("1,000", ["1000", "\\boxed{1,000}"], ["100", "1"]),
    "unit in words": ("5 cm", ["5", "5 cm"], ["6 cm", "50"]),
    "unit in LaTeX": ("12\\text{ square units}", ["12", "\\boxed{12}"], ["13"]),
    "currency": ("18.90 dollars", ["$18.90", "18.9"], ["19"]),
    "degrees": ("90^\\circ", ["\\boxed{90^\\circ}", "90"], ["45"]),
    "math word, not a unit": ("2 pi", ["\\boxed{2\\pi}", "$2\\pi$"], ["\\boxed{2}", "2"]),
    "function without backslash": ("3 sin x", ["\\boxed{3\\sin x}"], ["\\boxed{3}"]),
    "seconds": ("5 sec", ["\\boxed{5}"], ["\\boxed{6}"]),
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_reference_format_scores_right_answers_right_and_wrong_ones_wrong(name):
    reference, right, wrong = FORMATS[name]
    assert [check_answer(a, reference).correct for a in right] == [True] * len(right)
    verdicts = [check_answer(a, reference) for a in wrong]
    assert [v.correct for v in verdicts] == [False] * len(wrong)


@pytest.mark.parametrize("reference,final", [(GSM8K, "72"), ("#### 1,234", "1234"), ("5 cm", "5"),
                                             ("first #### 3, then\n#### 42", "42"),
                                             ("3.5\\mbox{ inches}", "3.5"), ("2x", "2x"),
                                             ("\\frac{1}{2}", "\\frac{1}{2}")])
def test_reference_answer_is_the_final_answer_without_separators_or_units(reference, final):
    assert reference_answer(reference) == final


def test_the_fast_path_reads_gsm8k_references():
    assert plain_number_verdict("72", GSM8K).correct and not plain_number_verdict("24", GSM8K).correct


def test_the_math_env_rewards_a_bare_latex_reference():
    """Before: the env called `\\frac{1}{2}` unparsable and gave the right answer 0."""
    async def episode():
        env = make_env(EnvServiceAbstraction("math-code-single-step"))
        await env.reset(options={"answer": "\\frac{1}{2}"})
        return await env.step(("q", ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{2}"]))

    try:
        _, rewards, done, _, info = asyncio.run(episode())
    finally:
        close_shared_pool()
    assert rewards == [1.0, 1.0, 0.0] and done
    assert info["statuses"] == ["ok"] * 3
