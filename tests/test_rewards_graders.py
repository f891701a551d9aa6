"""Built-in rm types on hand-checked cases: math / math_lenient (math-verify), dapo, deepscaler /
deepscaler_lenient, f1, gpqa and boxed_<type>. The slime-named types' expectations were derived by hand from
slime's graders (slime/rollout/rm_hub: math_utils, deepscaler, math_dapo_utils, gpqa)."""

from __future__ import annotations

import pytest

from lichen.errors import ConfigError
from lichen.rewards import check_rm_type, get_rule_reward, grade, known_rm_types
from lichen.rewards.dapo import extract_dapo_answer, grade_dapo, normalize_final_answer
from lichen.rewards.deepscaler import grade_deepscaler, grade_deepscaler_lenient
from lichen.rewards.f1 import grade_f1, normalize_squad, token_f1
from lichen.rewards.gpqa import extract_choice, grade_gpqa, label_letter
from lichen.rewards.math_grader import grade_math, grade_math_lenient, math_equal, math_verify_available
from lichen.rewards.rules import extract_answer, last_boxed, normalize_answer, strict_last_boxed

# --------------------------------------------------------------------------------------------------- math


def test_math_verify_is_installed():
    # a declared dependency: without it the symbolic cases below would silently use the basic checker
    assert math_verify_available()


@pytest.mark.parametrize(
    "response,label,want",
    [
        # the equivalences the issue names
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{x+1}", "1+x", 1.0),
        (r"\boxed{42}", "43", 0.0),
        (r"\boxed{42}", "", 0.0),  # empty label
        (r"\boxed{42}", "   ", 0.0),
        # normalisations
        (r"\boxed{\tfrac{3}{4}}", "0.75", 1.0),
        (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1.0),
        (r"\boxed{\left(1, 2\right)}", "(1,2)", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{90^{\circ}}", "90", 1.0),
        (r"\boxed{.5}", "0.5", 1.0),
        (r"\boxed{\text{5 apples}}", "5 apples", 1.0),
        (r"\boxed{ 1 0 }", "10", 1.0),  # spaces
        (r"\boxed{1,000}", "1000", 1.0),
        # symbolic (math-verify)
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0),
        (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        (r"\boxed{50\%}", "0.5", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
        (r"\boxed{-7}", "7", 0.0),
        (r"\boxed{\pi}", "3", 0.0),
        (r"\boxed{0.333}", r"\frac{1}{3}", 0.0),
        # nesting and several boxes
        (r"\boxed{\frac{1}{\sqrt{3}}}", r"\frac{\sqrt{3}}{3}", 1.0),
        (r"first \boxed{1} then \boxed{2}", "2", 1.0),
        (r"first \boxed{2} then \boxed{1}", "2", 0.0),
        (r"\fbox{7}", "7", 1.0),  # \fbox when there is no \boxed
        (r"\fbox{7} and \boxed{8}", "8", 1.0),  # \boxed wins over a later-found \fbox
        # malformed boxes
        (r"\boxed{12", "12", 0.0),  # never closed: a box was attempted, so no number fallback
        (r"\boxed{3} and then \boxed{4", "3", 1.0),  # the unbalanced last box is skipped
        (r"\boxed{}", "0", 0.0),  # empty box
        (r"\boxedx{5}", "5", 1.0),  # not a box command: falls back to the last number
        # no box at all: the last number
        ("the total is 12 apples", "12", 1.0),
        ("nothing numeric", "12", 0.0),
        # labels that carry their own box, non-string labels
        (r"\boxed{5}", r"\boxed{5}", 1.0),
        (r"\boxed{5}", 5, 1.0),
        (r"\boxed{5}", None, 0.0),
    ],
)
def test_math_lenient(response, label, want):
    assert grade_math_lenient(response, label, {}) == want


@pytest.mark.parametrize(
    "response,label,want",
    [
        # slime's math (grade_answer_verl): only the last \boxed{...} is an answer
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"first \boxed{1} then \boxed{2}", "2", 1.0),
        (r"\boxed{5}", r"\boxed{5}", 1.0),  # a boxed label is unwrapped
        (r"\boxed{5}", 5, 1.0),
        ("the total is 12 apples", "12", 0.0),  # no box: no answer (lenient: the last number)
        (r"\fbox{7}", "7", 0.0),  # \fbox is not read
        (r"\boxed 5", "5", 0.0),  # the unbraced form is not read
        (r"\boxedx{5}", "5", 0.0),  # the last \boxed... must be \boxed{
        (r"\boxed{3} and then \boxed{4", "3", 0.0),  # the last box is unbalanced: no look-back
        (r"\boxed{12", "12", 0.0),
        (r"\boxed{42}", "", 0.0),
        (r"\boxed{5}", None, 0.0),
    ],
)
def test_math_keeps_slimes_boxed_only_rule(response, label, want):
    assert grade_math(response, label, {}) == want
    assert grade("math", response, label) == want


def test_strict_last_boxed():
    assert strict_last_boxed(r"a \boxed{x{y}} b \boxed{z}") == "z"
    assert strict_last_boxed(r"\boxed{1} \boxed{") is None and strict_last_boxed("none") is None


def test_math_equal_is_not_fooled_by_empty_strings():
    assert not math_equal("", "0")
    assert not math_equal("$ $", "")


def test_normalize_answer_cases():
    assert normalize_answer(r"\left( \dfrac{1}{2}, .5 \right)") == r"(\frac{1}{2},0.5)"
    assert normalize_answer(r"45^\circ.") == "45"
    assert normalize_answer(r"\text{yes}") == "yes"


def test_extract_answer_and_last_boxed():
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert last_boxed(r"\fbox{1} x") == "1"
    assert extract_answer(r"\boxed{1") is None
    assert extract_answer("x 1,234 y") == "1,234"


# --------------------------------------------------------------------------------------------------- dapo


@pytest.mark.parametrize(
    "response,label,acc,pred",
    [
        ("work...\nAnswer: 42", "42", True, "42"),
        ("Answer: 41\nwait\nAnswer: 42", "42", True, "42"),  # the last Answer: counts
        ("Answer: 42\nwait\nAnswer: 41", "42", False, "41"),
        ("answer: $\\frac{1}{2}$", "0.5", True, r"\frac{1}{2}"),
        ("Answer: x = 7", "7", True, "7"),
        ("Answer: 12 cm", "12", True, "12"),
        ("Answer: 1,000", "1000", True, "1000"),
        ("Answer: \\boxed{9}", "9", True, "9"),
        ("Answer: 30\\%", "30", True, "30"),
        ("the answer is 42", "42", False, ""),  # no "Answer:" line
        ("Answer:", "42", False, ""),
    ],
)
def test_dapo(response, label, acc, pred):
    out = grade_dapo(response, label, {})
    assert out == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


@pytest.mark.parametrize("marker", ["<|im_end|>", "<|endoftext|>"])
def test_dapo_strips_chat_end_markers(marker):
    # a response decoded with its special tokens ends in the end marker, right after the answer
    assert grade_dapo(f"Answer: 42{marker}", "42", {}) == {"score": 1.0, "acc": True, "pred": "42"}
    assert grade_dapo(f"Answer: \\boxed{{7}}{marker}", f"7{marker}", {})["acc"] is True
    assert grade("boxed_dapo", f"\\boxed{{7}}{marker}", "7")["acc"] is True


def test_dapo_reads_answer_in_the_last_300_characters_only():
    # slime's compute_score grades solution_str[-300:]
    assert grade_dapo("Answer: 5\n" + "x" * 290, "5", {})["acc"] is True  # 300 characters: all of it is read
    assert grade_dapo("Answer: 5\n" + "x" * 291, "5", {})["acc"] is False  # 301: the "A" is cut off
    assert grade_dapo("Answer: 5\n" + "x" * 400, "5", {}) == {"score": -1.0, "acc": False, "pred": ""}


def test_dapo_helpers():
    assert extract_dapo_answer("a\nAnswer: 3 \nmore") == "3"
    assert extract_dapo_answer("none") is None
    assert normalize_final_answer(r"\frac12 dollars") == r"\frac{1}{2}"


# --------------------------------------------------------------------------------------------- deepscaler


@pytest.mark.parametrize(
    "response,label,want",
    [
        (r"<think>maybe \boxed{3}</think> so \boxed{4}", "4", 1.0),
        (r"<think>maybe \boxed{4}</think> so \boxed{3}", "4", 0.0),  # the thinking part is not graded
        (r"<think>\boxed{4}", "4", 0.0),  # thinking never ended
        (r"<think>a</think>b</think> the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),  # after the last </think>
        (r"<think>x</think> \boxed{6}", ["5", "6"], 1.0),  # a list of accepted answers
        (r"<think>x</think> \boxed{6}", "", 0.0),
    ],
)
def test_deepscaler_boxed_cases_agree(response, label, want):
    assert grade_deepscaler(response, label, {}) == want
    assert grade_deepscaler_lenient(response, label, {}) == want


@pytest.mark.parametrize(
    "response,label,strict,lenient",
    [
        ("<think>x</think> the total is 4", "4", 0.0, 1.0),  # no box: slime gives 0
        (r"###Response the answer is \boxed{4}", "4", 1.0, 0.0),  # no </think>: slime grades after ###Response
        (r"a ###Response \boxed{4} ###Response \boxed{5}", "4", 1.0, 0.0),  # up to the second ###Response
        (r"a ###Response \boxed{4} ###Response \boxed{5}", "5", 0.0, 0.0),
        (r"<think>\boxed{4}</think> \fbox{4}", "4", 0.0, 1.0),
    ],
)
def test_deepscaler_slime_rule_and_lenient(response, label, strict, lenient):
    assert grade_deepscaler(response, label, {}) == strict
    assert grade_deepscaler_lenient(response, label, {}) == lenient


# ------------------------------------------------------------------------------------------------------ f1


def test_squad_normalisation():
    assert normalize_squad("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_squad("an apple a day") == "apple day"


@pytest.mark.parametrize(
    "pred,gold,want",
    [
        ("Paris", "paris", 1.0),
        ("the city of Paris", "Paris", 2 * (1 / 3) * 1 / (1 / 3 + 1)),  # P = 1/3, R = 1 -> 0.5
        ("Paris France", "Paris Texas", 0.5),  # P = R = 1/2
        ("red red blue", "red blue blue", 2 / 3),  # overlap counts multiplicity: min(2,1) + min(1,2) = 2
        ("London", "Paris", 0.0),
        ("the", "a", 1.0),  # both normalise to nothing
        ("the", "Paris", 0.0),
    ],
)
def test_token_f1(pred, gold, want):
    assert token_f1(pred, gold) == pytest.approx(want)


def test_grade_f1_best_gold_and_thinking():
    assert grade_f1("<think>London</think> Paris", ["London Bridge", "Paris"], {}) == 1.0
    assert grade_f1("Paris", None, {}) == 0.0
    assert grade_f1("Paris", [], {}) == 0.0


# ---------------------------------------------------------------------------------------------------- gpqa


@pytest.mark.parametrize(
    "response,want",
    [
        ("Let me think. The answer is B.", "B"),
        ("Answer: (C)", "C"),
        ("the correct answer is: **D**", "D"),
        ("I considered A and C. A is correct.", "A"),
        ("(B) is the correct one", "B"),
        ("Options A and C fail; so D", "D"),  # last standalone letter
        (r"\boxed{\text{(C)}}", "C"),
        ("The answer is a bit unclear, but C", "C"),  # lower-case 'a' is not a choice
        ("<think>The answer is A</think> The answer is B", "B"),
        ("no letter here", None),
        ("BAD CAB", None),  # letters inside words do not count
    ],
)
def test_gpqa_extraction(response, want):
    assert extract_choice(response) == want


def test_gpqa_labels_and_choices():
    meta = {"choices": ["red", "green", "blue", "cyan", "pink"]}
    assert label_letter("b", {}) == "B" and label_letter(2, {}) == "C"
    assert label_letter("(C)", {}) is None  # slime reads a one-letter label only
    assert label_letter("blue", meta) == "C"
    assert grade_gpqa("The answer is E", "pink", meta) == 1.0
    assert grade_gpqa("The answer is E", "D", {}) == 0.0
    assert grade_gpqa("The answer is J", "J", {}) == 1.0  # A-J by default, as slime
    assert grade_gpqa("The answer is A", "Z", {}) == 0.0  # a label naming no choice scores 0, no error


def test_gpqa_metadata_letters_and_correct_letter():
    assert grade_gpqa("The answer is K", "x", {"valid_letters": ["j", "k"], "correct_letter": "k"}) == 1.0
    assert grade_gpqa("The answer is B", "A", {"correct_letter": "B"}) == 1.0  # correct_letter wins over the label


def test_gpqa_label_as_choice_text_folds_like_slime():
    meta = {"choices": ["red", "green", "Light  blue", "cyan"]}
    assert label_letter("light blue", meta) == "C"
    assert label_letter("  LIGHT-Blue \n", meta) == "C"  # non-alphanumerics fold to one space
    assert grade_gpqa("The answer is C", "LIGHT BLUE", meta) == 1.0
    assert grade_gpqa("The answer is B", "LIGHT BLUE", meta) == 0.0


def test_gpqa_without_a_letter_looks_for_the_answer_text():
    meta = {"choices": ["red", "green", "light blue", "cyan"]}
    assert grade_gpqa("it must be light-blue.", "C", meta) == 1.0  # the correct choice's text
    assert grade_gpqa("it must be green.", "C", meta) == 0.0
    assert grade_gpqa("surely 42 kelvin", "42 kelvin", {}) == 1.0  # a label that is no letter, as text


def test_gpqa_choices_as_dict():
    meta = {"choices": {"B": "green", "A": "red", "D": "cyan", "C": "blue"}}  # letter keys in any order
    assert label_letter("Blue", meta) == "C" and label_letter("B", meta) == "B"
    assert grade_gpqa("The answer is C", "blue", meta) == 1.0
    five = {"choices": {"1": "a", "2": "b", "3": "c", "4": "d", "5": "pink"}}  # other keys: by position
    assert grade_gpqa("The answer is E", "pink", five) == 1.0


@pytest.mark.parametrize("label,want", [(2.0, "C"), (0.0, "A"), (3, "D"), (7.0, "H"), (2.5, "C")])
def test_gpqa_numeric_labels_are_indexes(label, want):
    assert label_letter(label, {}) == want  # int() of the number, as slime
    assert grade_gpqa(f"The answer is {want}", label, {}) == 1.0


@pytest.mark.parametrize("label", [float("nan"), float("inf"), 10, True])
def test_gpqa_numeric_labels_naming_no_choice_score_zero(label):
    assert label_letter(label, {}) is None
    assert grade_gpqa("The answer is C", label, {}) == 0.0


# ------------------------------------------------------------------------------------------------- boxed_


def test_boxed_prefix_grades_only_the_last_box():
    assert grade("boxed_exact", r"I think 4, finally \boxed{5}", "5") == 1.0
    assert grade("boxed_exact", "5", "5") == 0.0  # no box, no credit
    assert grade("boxed_f1", r"blah \boxed{the Paris}", "Paris") == 1.0
    assert grade("boxed_gpqa", r"A is wrong, \boxed{B}", "B") == 1.0
    assert grade("boxed_math", r"\boxed{\frac{2}{4}}", "0.5") == 1.0
    assert grade("boxed_math", r"\boxed{12 apples, 13}", "13") == 0.0  # the box content is the answer as a whole
    assert grade("boxed_dapo", r"\boxed{7}", "7") == {"score": 1.0, "acc": True, "pred": "7"}
    assert grade("boxed_dapo", "7", "7")["score"] == -1.0


def test_rm_type_names():
    names = known_rm_types()
    for name in (
        "math",
        "math_lenient",
        "dapo",
        "deepscaler",
        "deepscaler_lenient",
        "f1",
        "gpqa",
        "code",
        "remote_rm",
        "boxed_math",
        "boxed_gpqa",
    ):
        assert name in names
        check_rm_type(name)
    for bad in ("boxed_code", "boxed_", "Math", "boxed_boxed_math"):
        with pytest.raises(ConfigError, match="not a known rm type"):
            check_rm_type(bad)
    with pytest.raises(ConfigError, match="asynchronously"):
        get_rule_reward("code")
