"""What counts as a right answer to a math problem: math-verify's reading of the answer against the reference, with
the reference's final answer found as datasets write it, multiple-choice letters compared as letters, and plain
numbers decided without sympy. The checks run in the verifier's worker processes (math_verifier.py), which import
this module by the path of its `check_answer`.
"""

import re
from decimal import Decimal

from math_verify import StringExtractionConfig, parse, verify

from rlsys.impl.env.math_verifier import Verdict


def check_answer(answer: str, reference: str) -> Verdict:
    """The default check: does `answer` contain a math expression equal to `reference`?

    The reference may be written as datasets write it (see `reference_answer`); a multiple-choice letter is
    compared as a letter, anything else by math-verify.
    """
    reference = reference_answer(reference)
    if choice := choice_letter(reference):
        picked = answer_choice(answer)
        if picked is None:
            return Verdict(False, "unparsable", "answer names no choice letter")
        return Verdict(picked == choice, "ok")
    gold = parse_reference(reference)
    if not gold:
        return Verdict(False, "unparsable", f"reference {reference[:80]!r} has no math expression")
    predicted = parse(answer)
    if not predicted:
        return Verdict(False, "unparsable", "answer has no math expression")
    return Verdict(bool(verify(gold, predicted)), "ok")


GSM8K_FINAL = re.compile(r"####(?!.*####)\s*(.*?)\s*$", re.DOTALL)  # the last ####
# Names a bare reference may spell without their backslash ("2 pi", "3 sin x"): math, not a unit ("sec" is seconds).
MATH_WORDS = r"(?:pi|infty|infinity|sqrt|sin|cos|tan|cot|csc|arcsin|arccos|arctan|log|ln|exp)(?![A-Za-z])"
NUMBER_WITH_UNIT = re.compile(  # "1,000 dollars", "5 cm", "3.5\\mbox{ inches}": the unit is dropped ("2x" is kept)
    r"(-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+))"
    rf"(?:\s*\\(?:text|mbox|mathrm)\{{[^{{}}]*\}}|\s+(?!{MATH_WORDS})[A-Za-z]{{2,}}[A-Za-z .]*)")
BARE_MATH_WORD = re.compile(rf"(?<![\\A-Za-z]){MATH_WORDS}")
THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def reference_answer(reference: str) -> str:
    """The final answer in a reference as datasets write it.

    A GSM8K solution ends in `#### 42`: the answer is what follows the last `####`. A plain number keeps
    no thousands separators ("1,000" is 1000, not the tuple (1, 0)) and no trailing unit ("5 cm").
    """
    if match := GSM8K_FINAL.search(reference):
        reference = match.group(1)
    reference = reference.strip()
    if match := NUMBER_WITH_UNIT.fullmatch(reference):
        reference = match.group(1)
    if THOUSANDS.fullmatch(reference):
        reference = reference.replace(",", "")
    return reference


def parse_reference(reference: str) -> list:
    """math-verify's reading of a reference. MATH stores bare LaTeX (`\\frac{1}{2}`, `(3, -1)`, `[2, 5)`), which
    math-verify only reads as a whole inside `$...$`: bare, it finds no expression or only the last number. A name
    written without its backslash ("2 pi") gets one: inside `$...$` math-verify reads "pi" as p*i."""
    if "$" in reference or "\\boxed" in reference:
        return parse(reference)
    latex = BARE_MATH_WORD.sub(lambda word: "\\infty" if word[0] == "infinity" else "\\" + word[0], reference)
    return parse(f"${latex}$") or parse(reference)


CHOICE = re.compile(r"\(?([A-J])\)?\.?")
CHOICE_IN_LATEX = re.compile(r"\\(?:text|textbf|mathrm)\{\s*\(?([A-J])\)?\s*\}")
BOXED_CHOICE = re.compile(r"\\boxed\{\s*(?:\\(?:text|textbf|mathrm)\{)?\s*\(?([A-J])\)?\s*\}?\s*\}")
PARENTHESIZED_CHOICE = re.compile(r"\(([A-J])\)")


def choice_letter(reference: str) -> str | None:
    """The letter of a multiple-choice reference: `C`, `(C)`, `C.` or MATH's `\\text{(C)}`; else None."""
    match = CHOICE.fullmatch(reference) or CHOICE_IN_LATEX.fullmatch(reference)
    return match.group(1) if match else None


def answer_choice(answer: str) -> str | None:
    """The choice an answer makes: its last `\\boxed{C}`, else a letter math-verify finds after an anchor ("the answer
    is C", "Answer: D"), else its last `(C)`, else a letter math-verify finds anywhere ("C", "I pick D."). A letter
    standing alone in the reasoning ("A car travels...", "in case B") comes last: it is not the choice."""
    if letters := BOXED_CHOICE.findall(answer):
        return letters[-1]
    if found := parse(answer, extraction_config=[StringExtractionConfig(lowercase=False,
                                                                        try_extract_without_anchor=False)]):
        return str(found[0])
    if letters := PARENTHESIZED_CHOICE.findall(answer):
        return letters[-1]
    found = parse(answer, extraction_config=[StringExtractionConfig(lowercase=False)])
    return str(found[0]) if found else None


PLAIN_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?")  # math-verify reads "+46" as no number; so do we


def plain_number_verdict(answer: str, reference: str) -> Verdict | None:
    """The verdict for two plain decimal numbers (what math-verify would say, without sympy); else None.

    Most answers to arithmetic and word problems are plain numbers: deciding those in-process keeps the
    worker pool, and the core it costs, for the answers that need a real check. `reference` may be written
    as datasets write it (a GSM8K solution, "1,000").
    """
    answer, reference = answer.strip(), reference_answer(reference)
    if PLAIN_NUMBER.fullmatch(answer) and PLAIN_NUMBER.fullmatch(reference):
        return Verdict(Decimal(answer) == Decimal(reference), "ok")
    return None
