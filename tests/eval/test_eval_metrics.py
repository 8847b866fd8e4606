"""Benchmark metrics on hand-made examples (values worked out by hand in the comments), and against
the packages LongBench's official eval.py imports (`rouge`, `fuzzywuzzy`) on random strings."""
import random

import pytest

from kvpress_c.eval import metrics as M
from kvpress_c.eval import longbench, ruler


def test_string_match():
    assert M.string_match_all("The numbers are 123 and 456.", ["123", "789"]) == 0.5
    assert M.string_match_all("ABC-def", ["abc", "DEF"]) == 1.0  # case-insensitive
    assert M.string_match_part("The numbers are 123 and 456.", ["789", "456"]) == 1.0
    assert M.string_match_part("nothing", ["789"]) == 0.0


def test_qa_f1_by_hand():
    # normalised: "cat sat" vs "cat sat on mat": overlap 2, P = 1, R = 1/2, F1 = 2/3
    assert M.qa_f1("The cat sat.", "a cat sat on the mat") == pytest.approx(2 / 3)
    assert M.qa_f1("the Maren", "The Maren!") == 1.0
    assert M.qa_f1("", "x") == 0.0
    # repeated words are clipped: pred "x y y", ref "y": overlap 1, P 1/3, R 1 -> 2(1/3)/(4/3) = 1/2
    assert M.qa_f1("x y y", "y") == pytest.approx(0.5)


def test_rouge_l_by_hand():
    # one sentence each; unique words 5 and 5; LCS the-cat-on-the-mat -> unique {the, cat, on, mat} = 4
    assert M.rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(0.8, abs=1e-7)
    # two reference sentences: union LCS counted once per new word
    # ref "a b c. d e" (m = 5 unique), hyp "a c d" (n = 3): LCS(a b c, a c d) = {a, c}; LCS(d e, a c d) = {d}
    # llcs = 3, R = 3/5, P = 1, F = 0.75
    assert M.rouge_l("a c d", "a b c. d e") == pytest.approx(0.75, abs=1e-7)
    assert M.rouge_l("", "a b") == 0.0 and M.rouge_l("...", "a b") == 0.0


def test_classification_by_hand():
    classes = ["Individual", "Number of something", "City", "Number"]
    assert M.classification("City", "City", all_classes=classes) == 1.0
    # "Number" is a strict substring of the answer: dropped, leaving only the answer
    assert M.classification("Number of something", "Number of something", all_classes=classes) == 1.0
    assert M.classification("City or Individual", "City", all_classes=classes) == 0.5
    assert M.classification("Country", "City", all_classes=classes) == 0.0
    # LongBench removes while iterating, which skips the element after a removal: [A, AB, ABC] for
    # answer ABC drops A, skips AB, keeps ABC -> [AB, ABC] -> 1/2
    assert M.classification("ABC", "ABC", all_classes=["A", "AB", "ABC"]) == 0.5


def test_count_retrieval_code_sim_by_hand():
    assert M.count("There are 3 paragraphs, maybe 4", "3") == 0.5
    assert M.count("no digits", "3") == 0.0
    assert M.retrieval("Paragraph 12, not Paragraph 3", "Paragraph 12") == 0.5
    assert M.retrieval("12", "Paragraph 12") == 1.0
    # first line without ` # //: "x = foo(1)"; matching blocks "x = foo(" + ")" = 9 of 20 chars -> 90
    assert M.code_sim("```python\n# comment\nx = foo(1)\n", "x = foo(2)") == 0.9
    assert M.code_sim("", "x") == 0.0


def test_rouge1_for_the_needle():
    r = M.rouge1("eat a sandwich in Dolores Park", "Eat a sandwich and sit in Dolores Park.")
    # needle words: eat a sandwich and sit in dolores park (8); found 6 -> recall 0.75, precision 1
    assert r["recall"] == pytest.approx(0.75) and r["precision"] == 1.0
    assert r["f"] == pytest.approx(2 * 0.75 / 1.75)


def _random_text(rng, words=("the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "x1")):
    parts = []
    for _ in range(rng.randint(1, 4)):
        parts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))))
    return ". ".join(parts) + rng.choice(["", ".", " "])


def test_rouge_l_equals_the_rouge_package():
    rouge = pytest.importorskip("rouge")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    scorer = rouge.Rouge()
    for _ in range(300):
        a, b = _random_text(rng), _random_text(rng)
        try:
            want = scorer.get_scores([a], [b], avg=True)["rouge-l"]["f"]
        except Exception:  # LongBench's rouge_score returns 0 on the package's errors
            want = 0.0
        assert M.rouge_l(a, b) == pytest.approx(want, abs=1e-12), (seed, a, b)


def test_code_sim_equals_fuzzywuzzy_without_levenshtein():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    alphabet = "abc (){}=+_.:\n"
    for _ in range(300):
        a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert M.fuzz_ratio(a, b) == fuzz.ratio(a, b), (seed, a, b)


def test_longbench_scoring_rules():
    trec = {"task": "trec", "answers": ["City"], "all_classes": ["City", "Country"]}
    assert longbench.score("\nCity\nCountry", trec)["score"] == 1.0  # first line only
    assert longbench.score("Country City", trec)["score"] == 0.5
    qa = {"task": "hotpotqa_e", "answers": ["the Maren", "Maren river"]}
    assert longbench.score("Maren river", qa)["score"] == 1.0  # max over answers
    assert longbench.length_bucket({"meta": {"length": 3999}}) == "0-4k"
    assert longbench.length_bucket({"meta": {"length": 8000}}) == "8k+"


def test_ruler_scoring():
    assert ruler.score("1234567 and 7654321", {"answers": ["1234567", "7654321"], "metric": "all"})["score"] == 1.0
    assert ruler.score("1234567", {"answers": ["1234567", "7654321"], "metric": "all"})["score"] == 0.5
    assert ruler.score("Ada Morrow", {"answers": ["Ada Morrow", "Morrow"], "metric": "part"})["score"] == 1.0
