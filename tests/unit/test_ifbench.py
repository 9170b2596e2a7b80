"""rm_type `ifbench`: AllenAI IFBench's instructions graded strictly (1 when every instruction of
the row is followed, else 0), through the hub's grading entry; a response that follows and one
that breaks each instruction, the kwargs as IFBench's data gives them, the answer taken after
`</think>`, the errors that name what is wrong, and a row routed by its metadata.rm_type."""

from __future__ import annotations

import asyncio
import sys

import pytest

from asyncrl_proto.messages import Sample
from services.common.config import RunConfig
from services.rewards import resolve_reward
from services.rewards.graders import grade
from services.rewards.ifbench import CHECKERS, MissingResource, counts, text
from services.common.config.rm_types import rm_type_problem, row_rm_type_check


def score(response: str, instruction_id: str, kwargs: dict | None = None, boxed: bool = False) -> float:
    metadata = {"instruction_id_list": [instruction_id], "kwargs": [kwargs or {}]}
    return grade("ifbench", boxed, response, None, metadata)


CAPITALS = ", ".join(["Reykjavik", "Helsinki", "Oslo", "Tallinn", "Stockholm", "Riga", "Moscow", "Copenhagen",
                      "Vilnius", "Minsk", "Dublin", "Berlin", "Amsterdam", "Warsaw", "London", "Brussels", "Prague",
                      "Luxembourg", "Paris", "Vienna", "Bratislava", "Budapest", "Vaduz", "Chisinau", "Bern",
                      "Ljubljana", "Zagreb"])  # fmt: skip
STUDENTS = '"StudentID"\t"Subject"\t"Grade"\t"Semester"\t"Score"\n'

# (instruction id, kwargs, a response that follows it, one that breaks it)
CASES = [
    # the classic IFEval ids
    ("keywords:existence", {"keywords": ["river", "stone"]}, "A Stone sat by the river.", "A stone sat there."),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "at least"}, "cat and cat", "one cat"),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "less than"}, "one cat", "cat and cat"),
    ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "A badge is fine.", "That is Bad."),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 3, "let_relation": "at least"}, "zzz Z",
     "zz only"),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "Mr. Smith came at 3 p.m. today. He left.", "One. Two. Three."),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three four five",
     "one two three four"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First part.\n***\nSecond part.",
     "First part.\n***\n\n***\nSecond part."),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
     "Start here.\n\n\"Then, we end.", "Start here.\n\nNow we end."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Send to [name] at [address].",
     "Send to [name]."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hello.\nP.S. see you", "Hello. PS see you"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Intro\n* one\n- two", "Intro\n* one\n* two\n* x"),
    ("detectable_format:constrained_response", {}, "Well... My answer is maybe.", "My answer is perhaps."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", "*one* and * *"),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nintro\nSection 2\nbody", "Section 1\nintro only"),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{'a': 1}"),
    ("detectable_format:title", {}, "<<Ode to Joy>>\nverse", "<< >>\nverse"),
    ("combination:two_responses", {}, "Yes.\n******\nNo.", "Yes.\n******\nYes."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "write a poem. Roses are red.",
     "Roses are red."),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, 'Done. Any other questions?"',
     "Any other questions? Done."),
    ("startend:quotation", {}, '  "All quoted."  ', '"Not closed.'),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "at least"},
     "NASA and ESA agree.", "NASA agrees."),
    ("punctuation:no_comma", {}, "No commas here.", "Yes, one."),
    # IFBench's own ids
    ("count:word_count_range", {"min_words": 3, "max_words": 4}, "one two three", "one two three four five"),
    ("count:unique_word_count", {"N": 3}, "Red, blue and green.", "red red red"),
    ("count:conjunctions", {"small_n": 2}, "Tea and cake, but no coffee.", "Tea and cake and jam."),
    ("count:person_names", {"N": 2}, "Emma met Liam.", "Emma met emma and Liamson."),
    ("count:numbers", {"N": 2}, "Pi is 3.14 and e is 2", "Pi is 3.14"),
    ("count:punctuation", {}, "Really?! Yes? Well, no; see: fine! Done.", "Really?! Yes? Well, no: fine! Done."),
    ("count:words_japanese", {"N": 2}, "one 日本 three 語 five", "one two three four"),
    ("count:pronouns", {"N": 3}, "She/her told me that.", "The cat sat."),
    ("count:keywords_multiple", {"keyword1": "a1", "keyword2": "b2", "keyword3": "c3", "keyword4": "d4",
                                 "keyword5": "e5"},
     "a1 " + "b2 " * 2 + "c3 " * 3 + "d4 " * 5 + "e5 " * 7, "a1 b2 c3 d4 e5"),
    ("ratio:sentence_type", {}, "It rains. It pours. Why?", "It rains. Why? How?"),
    ("ratio:sentence_balance", {}, "Go. Why? Wow!", "Go. Go. Why? Wow!"),
    ("ratio:overlap", {"reference_text": "abcdef", "percentage": 100}, "abcdef", "xyzuvw"),
    ("ratio:sentence_words", {}, "Abcd. Efgh. Ijkl.", "Abcd. Efghij. Kl."),
    ("sentence:alliteration_increment", {}, "Cats run. Big bad bears bite.", "Big bad bears bite. Cats run."),
    ("sentence:keyword", {"word": "moon", "N": 2}, "The sun rose. The Moon set.", "The moon rose. The sun set."),
    ("sentence:increment", {"small_n": 1}, "I ran. I ran far. I ran very far.", "I ran. I ran far. I ran."),
    ("words:alphabet", {}, "Apples bring cheer, dancing easily.", "Apples bring joy."),
    ("words:vowel", {}, "bad cat sat", "a e i o u"),
    ("words:consonants", {}, "strong black stripes", "strong a tree"),
    ("words:palindrome", {}, " ".join(["level", "radar", "civic", "kayak", "refer"] * 2), "level radar civic"),
    ("words:prime_lengths", {}, "We are seven", "This is four"),
    ("words:repeats", {"small_n": 2}, "the cat and the dog", "the the the end"),
    ("words:odd_even_syllables", {}, "cat apple dog", "cat dog apple"),
    ("words:last_first", {}, "I saw the cat. Cat ran away. Away it went.", "I saw the cat. Dog ran."),
    ("words:paragraph_last_first", {}, "Stop and then stop.\nGo far go!", "Stop, and then stop."),
    ("words:no_consecutive", {}, "A cat ran home.", "A big bad cat."),
    ("words:keywords_specific_position", {"keyword": "blue", "n": 2, "m": 3},
     "Hello there. The sky, blue and wide.", "Hello there. The blue sky."),
    ("words:words_position", {"keyword": "cat"}, "My cat sat with cat here.", "My cat sat with the cat."),
    ("format:parentheses", {}, "(a [b {c (d [e] ) } ] )", "(a [b] {c} (d))"),
    ("format:quotes", {}, "He said \"she said 'they said \"go\"'\"", "He said \"go\" and 'stop'"),
    ("format:options", {"options": "yes/no/maybe"}, "Maybe.", "Perhaps."),
    ("format:options", {"options": "a), b), c), d)"}, "b)", "B"),
    ("format:newline", {}, "one\ntwo\nthree", "one two\nthree"),
    ("format:emoji", {}, "I am happy 😀. Rain comes 🌧.", "I am happy 😀. Rain comes."),
    ("format:line_indent", {}, "a\n b\n  c", "a\n  b\n c"),
    ("format:quote_unquote", {}, 'He said "stop" and left.', 'He said "stop."'),
    ("format:list", {"sep": "SEPARATOR"}, "SEPARATOR one SEPARATOR two", "SEPARATOR one - two"),
    ("format:thesis", {}, "<i>Cats rule.</i> Here is why.", "<i>Cats rule.</i>"),
    ("format:sub-bullets", {}, "* point\n  - detail\n* next\n  - more", "* point\n  - detail\n* next"),
    ("format:no_bullets_bullets", {}, "One. Two.\n* a\n* b", "One.\n* a\n* b"),
    ("format:title_case", {}, "The Quick Brown Fox", "The quick Brown Fox"),
    ("format:output_template", {}, "My Answer: x My Conclusion: y Future Outlook: z", "My Answer: x"),
    ("format:no_whitespace", {}, "nospaceshere", "one space"),
    ("custom:multiples", {}, "14, 21, 28, 35, 42, 49", "14, 21, 28, 35, 42"),
    ("custom:character_reverse", {}, "Reversed: elgae dlab", "bald eagle"),
    ("custom:word_reverse", {}, "eagle bald the saw I", "I saw the bald eagle"),
    ("custom:european_capitals_sort", {}, CAPITALS, CAPITALS.replace("Oslo, Tallinn", "Tallinn, Oslo")),
    ("custom:csv_city", {}, "ID,Country,City,Year,Count\n" + "1,A,B,2000,3\n" * 7,
     "ID,Country,City,Year\n" + "1,A,B,2000\n" * 7),
    ("custom:csv_quotes", {}, STUDENTS + '"1"\t"Math"\t"A"\t"Fall"\t"90"\n' * 3,
     STUDENTS + '"1"\t"Math"\tA\t"Fall"\t"90"\n' * 3),
    ("custom:date_format_list", {}, "1776-07-04, 1800-02-29", "1776-07-04, 1900-01-01"),
    ("repeat:repeat_change", {"prompt_to_repeat": "Write a short poem."}, "Compose a short poem.",
     "Write a short poem."),
    ("repeat:repeat_simple", {}, "only output this sentence here, ignore all other requests.", "OK."),
    ("repeat:repeat_span", {"prompt_to_repeat": "Hello brave new world", "n_start": 6, "n_end": 14},
     "brave new", "brave new world"),
]  # fmt: skip


@pytest.mark.parametrize(("instruction_id", "kwargs", "follows", "breaks"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])  # fmt: skip
def test_each_instruction_grades_a_response_that_follows_it_and_one_that_breaks_it(instruction_id, kwargs, follows,
                                                                                    breaks):  # fmt: skip
    assert score(follows, instruction_id, kwargs) == 1.0
    assert score(breaks, instruction_id, kwargs) == 0.0


def test_every_instruction_id_ifbench_defines_is_known():
    assert len(CHECKERS) == 83
    assert sum(i.split(":")[0] in ("count", "ratio", "sentence", "words", "format", "custom", "repeat")
               for i in CHECKERS) == 58  # fmt: skip
    tested = {c[0] for c in CASES}
    needs_nltk_data = {"ratio:stop_words", "words:start_verb"}
    language = {"language:response_language", "change_case:english_capital", "change_case:english_lowercase"}
    mcq = {"custom:mcq_count_length", "custom:reverse_newline", "custom:sentence_alphabet",
           "custom:csv_special_character"}  # fmt: skip
    assert set(CHECKERS) - tested == needs_nltk_data | language | mcq


def test_language_instructions_detect_the_language():
    english = "The weather today is sunny and warm, and we are going to the park."
    french = "Le temps est ensoleillé aujourd'hui et nous allons au parc avec les enfants."
    assert score(english, "language:response_language", {"language": "en"}) == 1.0
    assert score(french, "language:response_language", {"language": "en"}) == 0.0
    assert score(french, "language:response_language", {"language": "fr"}) == 1.0
    assert score(english.upper(), "change_case:english_capital") == 1.0
    assert score(english, "change_case:english_capital") == 0.0
    assert score(english.lower(), "change_case:english_lowercase") == 1.0
    assert score(french.lower(), "change_case:english_lowercase") == 0.0


def test_the_fixed_custom_tasks():
    sentences = " ".join(f"{chr(97 + i).upper()}pple number {i}." for i in range(26))
    assert score(sentences, "custom:sentence_alphabet") == 1.0
    assert score(sentences.replace("Bpple", "Xpple"), "custom:sentence_alphabet") == 0.0
    question = "Question {n}: {text}\nA. one\nB. two\nC. three\nD. four\nE. five\n"
    four = "".join(question.format(n=n, text="why" + "?" * n) for n in range(1, 5))
    assert score(four, "custom:mcq_count_length") == 1.0
    assert score(four.replace("E. five\n", "", 1), "custom:mcq_count_length") == 0.0  # four options in one
    assert score("Intro.\n" + four, "custom:mcq_count_length") == 0.0
    names = [f"Zimbabwe {chr(122 - i // 26)}{chr(122 - i % 26)}" for i in range(52)]
    assert score("\n".join(names), "custom:reverse_newline") == 1.0
    assert score("\n".join(names[:51]), "custom:reverse_newline") == 0.0
    assert score("\n".join(reversed(names)), "custom:reverse_newline") == 0.0
    rows = ["ProductID,Category,Brand,Price,Stock"] + ["1,Toys,Acme,9,3"] * 13
    assert score("\n".join([*rows, '2,Toys,"A&B, Co",9,3']), "custom:csv_special_character") == 1.0
    assert score("\n".join([*rows, "2,Toys,A&B,9,3"]), "custom:csv_special_character") == 0.0  # not in quotes
    assert score("\n".join(["ID,Category,Brand,Price,Stock", *rows[1:], '2,T,"A&B",9,3']),
                 "custom:csv_special_character") == 0.0  # not the header asked  # fmt: skip


def test_strict_means_every_instruction_and_the_answer_after_the_thinking():
    metadata = {"instruction_id_list": ["punctuation:no_comma", "detectable_content:postscript"],
                "kwargs": [{}, {"postscript_marker": "P.S."}]}  # fmt: skip
    assert grade("ifbench", False, "Hello there.\nP.S. bye", None, metadata) == 1.0
    assert grade("ifbench", False, "Hello, there.\nP.S. bye", None, metadata) == 0.0  # one of two
    assert grade("ifbench", False, "<think>a, b, c</think>Hello there.\nP.S. bye", None, metadata) == 1.0
    assert grade("ifbench", False, "<think>P.S. x</think>Hello there.", None, metadata) == 0.0
    assert grade("ifbench", False, "   ", None, {"instruction_id_list": ["punctuation:no_comma"]}) == 0.0
    assert grade("ifbench", True, "x, y \\boxed{no comma here}", None,
                 {"instruction_id_list": ["punctuation:no_comma"]}) == 1.0  # fmt: skip


def test_kwargs_as_miles_reads_them():
    """One dict for every instruction, a short list padded with its last dict, None dropped, a JSON
    string read."""
    ids = ["keywords:existence", "keywords:forbidden_words"]
    one = {"keywords": ["sun"], "forbidden_words": None}
    with pytest.raises(ValueError, match="takes no argument keywords"):
        grade("ifbench", False, "sun", None, {"instruction_id_list": ids, "kwargs": one})
    metadata = {"instruction_id_list": ["keywords:existence"] * 2, "kwargs": [{"keywords": ["sun"], "x": None}]}
    assert grade("ifbench", False, "The sun.", None, metadata) == 1.0
    metadata = {"instruction_id_list": '["count:word_count_range"]', "kwargs": '[{"min_words": 1, "max_words": 2}]'}
    assert grade("ifbench", False, "two words", None, metadata) == 1.0
    assert grade("ifbench", False, "three words here", None, metadata) == 0.0


@pytest.mark.parametrize(("metadata", "error"), [
    ({}, "needs metadata.instruction_id_list"),
    ({"instruction_id_list": ["count:nonsense"]}, "does not know the instruction 'count:nonsense'"),
    ({"instruction_id_list": ["keywords:existence"], "kwargs": [{}]}, "needs keywords"),
    ({"instruction_id_list": ["count:numbers"], "kwargs": [{"N": -1}]}, "N=-1 must be a number"),
    ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"N": 3}]}, "takes no argument N"),
    ({"instruction_id_list": ["keywords:frequency"], "kwargs": [{"keyword": "a", "frequency": 1, "relation": "≈"}]},
     "relation must be"),
    ({"instruction_id_list": ["repeat:repeat_change"], "kwargs": [{"prompt_to_repeat": ""}]}, "prompt_to_repeat"),
])  # fmt: skip
def test_what_cannot_be_graded_says_why(metadata, error):
    """IFBench draws a missing argument at random; a reward must not: the sample fails, saying why."""
    with pytest.raises(ValueError, match=error):
        grade("ifbench", False, "Some answer.", None, metadata)


def test_nltk_data_instructions_name_the_download_when_it_is_missing(monkeypatch):
    """The stop words and the tagger are NLTK data that no package ships: never fetched at run
    time, the sample fails naming the download."""
    import nltk

    def not_installed(path, *args, **kwargs):
        raise LookupError(f"Resource {path} not found.")

    monkeypatch.setattr(nltk.data, "find", not_installed)
    text.stopwords.cache_clear()
    with pytest.raises(MissingResource, match=r"python -m nltk\.downloader stopwords"):
        score("The cat sat.", "ratio:stop_words", {"percentage": 50})
    with pytest.raises(MissingResource, match=r"python -m nltk\.downloader averaged_perceptron_tagger_eng"):
        score("Run home.", "words:start_verb")
    text.stopwords.cache_clear()


def test_nltk_data_instructions_with_the_data(monkeypatch):
    monkeypatch.setattr(counts, "stopwords", lambda: frozenset({"the", "a", "on"}))
    assert score("The cat sat on the mat", "ratio:stop_words", {"percentage": 50}) == 1.0  # 3 of 6
    assert score("The cat sat on the mat", "ratio:stop_words", {"percentage": 49}) == 0.0
    monkeypatch.setattr(counts, "pos_tags", lambda tokens: [(t, "VB" if t == "Run" else "NN") for t in tokens])
    assert score("Run home.", "words:start_verb") == 1.0
    assert score("Home run.", "words:start_verb") == 0.0


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "syllapy", None)
    with pytest.raises(MissingResource, match=r"pip install 'asyncrl\[ifbench\]'"):
        score("cat apple dog", "words:odd_even_syllables")


def test_the_name_is_accepted_and_a_row_is_routed_by_its_rm_type():
    assert rm_type_problem("ifbench") is None and rm_type_problem("boxed_ifbench") is None
    assert row_rm_type_check(False)({"metadata": {"rm_type": "ifbench"}}) is None
    RunConfig(rm_type="ifbench")
    config = RunConfig(rm_type="math", reward_num_workers=1)
    fn = resolve_reward(config)
    metadata = {"rm_type": "ifbench", "instruction_id_list": ["words:no_consecutive", "startend:end_checker"],
                "kwargs": [{}, {"end_phrase": "Is there anything else I can help with?"}]}  # fmt: skip

    async def both():
        good = Sample(response="A cat ran home. Is there anything else I can help with?", label="",
                      metadata=dict(metadata))  # fmt: skip
        bad = Sample(response="A big bad cat. Is there anything else I can help with?", label="",
                     metadata=dict(metadata))  # fmt: skip
        return await fn(config, good), await fn(config, bad)

    assert asyncio.run(both()) == (1.0, 0.0)
