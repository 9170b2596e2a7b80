"""The 25 classic IFEval instructions (Google's IFEval verifiers, which IFBench's registry carries
beside its own): keywords, language, length, detectable content and format, combination,
start/end, case and punctuation. Each checker says whether a response follows the instruction,
with the kwargs IFEval's data gives it."""

from __future__ import annotations

import json
import re
from collections import Counter
from itertools import takewhile

from services.rewards.ifbench.text import (
    checker,
    count,
    count_words,
    in_language,
    relation_holds,
    sentences,
    word_tokens,
)

LANGUAGES = ("en", "es", "pt", "ar", "hi", "fr", "ru", "de", "ja", "it", "bn", "uk", "th", "ur", "ta", "te", "bg",
             "ko", "pl", "he", "fa", "vi", "ne", "sw", "kn", "mr", "gu", "pa", "ml", "fi")  # fmt: skip
"""The language codes IFEval's `language:response_language` takes."""
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _parts(parts: list[str]) -> list[str] | None:
    """The non-empty parts of a divided response; None where an empty one is not first or last."""
    if any(not p.strip() for p in parts[1:-1]):
        return None
    return [p for p in parts if p.strip()]


# ---- keywords -------------------------------------------------------------------------------


@checker("keywords:existence")
def keyword_existence(text: str, *, keywords) -> bool:
    """Every keyword appears (as a case-insensitive regular expression, as IFEval searches)."""
    return all(re.search(k, text, flags=re.IGNORECASE) for k in keywords)


@checker("keywords:frequency")
def keyword_frequency(text: str, *, keyword, frequency, relation) -> bool:
    found = len(re.findall(keyword.strip(), text, flags=re.IGNORECASE))
    return relation_holds(relation, found, count("frequency", frequency))


@checker("keywords:forbidden_words")
def forbidden_words(text: str, *, forbidden_words) -> bool:
    return not any(re.search(r"\b" + w + r"\b", text, flags=re.IGNORECASE) for w in set(forbidden_words))


@checker("keywords:letter_frequency")
def letter_frequency(text: str, *, letter, let_frequency, let_relation) -> bool:
    if not isinstance(letter, str) or len(letter) != 1 or not "a" <= letter.lower() <= "z":
        raise ValueError(f"ifbench argument letter={letter!r:.20} must be one letter a-z (IFBench draws it at random "
                         "otherwise)")  # fmt: skip
    found = Counter(text.lower())[letter.lower()]
    return relation_holds(let_relation, found, count("let_frequency", let_frequency))


# ---- language -------------------------------------------------------------------------------


@checker("language:response_language")
def response_language(text: str, *, language) -> bool:
    """langdetect's language is the one asked (no language detected: followed, as IFEval has it)."""
    if language not in LANGUAGES:
        raise ValueError(f"ifbench language {language!r:.20} is not one of IFEval's: {', '.join(LANGUAGES)}")
    return in_language(text, language)


checker("change_case:english_capital", lambda text: text.isupper() and in_language(text, "en"))
checker("change_case:english_lowercase", lambda text: text.islower() and in_language(text, "en"))


@checker("change_case:capital_word_frequency")
def capital_word_frequency(text: str, *, capital_frequency, capital_relation) -> bool:
    capitals = sum(1 for w in word_tokens(text) if w.isupper())
    return relation_holds(capital_relation, capitals, capital_frequency)


# ---- length ---------------------------------------------------------------------------------


@checker("length_constraints:number_sentences")
def number_sentences(text: str, *, num_sentences, relation) -> bool:
    return relation_holds(relation, len(sentences(text)), count("num_sentences", num_sentences))


@checker("length_constraints:number_words")
def number_words(text: str, *, num_words, relation) -> bool:
    return relation_holds(relation, count_words(text), count("num_words", num_words))


@checker("length_constraints:number_paragraphs")
def number_paragraphs(text: str, *, num_paragraphs) -> bool:
    """Paragraphs split by the markdown divider `***`."""
    paragraphs = _parts(re.split(r"\s?\*\*\*\s?", text))
    return paragraphs is not None and len(paragraphs) == count("num_paragraphs", num_paragraphs)


@checker("length_constraints:nth_paragraph_first_word")
def nth_paragraph_first_word(text: str, *, num_paragraphs, nth_paragraph, first_word) -> bool:
    """`num_paragraphs` paragraphs split by blank lines, paragraph `nth_paragraph` starting with
    `first_word` (lower case, up to the first punctuation mark)."""
    num_paragraphs = count("num_paragraphs", num_paragraphs)
    if count("nth_paragraph", nth_paragraph, 1) > num_paragraphs:
        raise ValueError(f"ifbench argument nth_paragraph={nth_paragraph} is past num_paragraphs={num_paragraphs} "
                         "(IFBench draws it at random then)")  # fmt: skip
    paragraphs = re.split(r"\n\n", text)
    found = sum(1 for p in paragraphs if p.strip())
    if nth_paragraph > found:
        return False
    paragraph = paragraphs[int(nth_paragraph) - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    first = "".join(letter.lower() for letter in takewhile(lambda c: c not in ".,?!'\"", word))
    return found == num_paragraphs and first == first_word.lower()


# ---- detectable content and format ----------------------------------------------------------


@checker("detectable_content:number_placeholders")
def number_placeholders(text: str, *, num_placeholders) -> bool:
    return len(re.findall(r"\[.*?\]", text)) >= count("num_placeholders", num_placeholders)


@checker("detectable_content:postscript")
def postscript(text: str, *, postscript_marker) -> bool:
    marker = postscript_marker.strip()
    special = {"P.P.S": r"\s*p\.\s?p\.\s?s.*$", "P.S.": r"\s*p\.\s?s\..*$"}
    pattern = special.get(marker, r"\s*" + marker.lower() + r".*$")
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


@checker("detectable_format:number_bullet_lists")
def number_bullet_lists(text: str, *, num_bullets) -> bool:
    """Exactly `num_bullets` markdown bullets (`* ` or `-` lines)."""
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == count("num_bullets", num_bullets)


@checker("detectable_format:constrained_response")
def constrained_response(text: str) -> bool:
    return any(option in text.strip() for option in CONSTRAINED_RESPONSES)


@checker("detectable_format:number_highlighted_sections")
def number_highlighted_sections(text: str, *, num_highlights) -> bool:
    """At least `num_highlights` non-empty `*...*` (and `**...**`) sections."""
    found = sum(1 for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip())
    found += sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h.removeprefix("**").removesuffix("**").strip())
    return found >= count("num_highlights", num_highlights)


@checker("detectable_format:multiple_sections")
def multiple_sections(text: str, *, section_spliter, num_sections) -> bool:
    sections = re.split(r"\s?" + section_spliter.strip() + r"\s?\d+\s?", text)
    return len(sections) - 1 >= count("num_sections", num_sections)


@checker("detectable_format:json_format")
def json_format(text: str) -> bool:
    value = text.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        value = value.removeprefix(prefix)
    try:
        json.loads(value.removesuffix("```").strip())
    except ValueError:
        return False
    return True


@checker("detectable_format:title")
def title(text: str) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))


# ---- combination, start/end, punctuation ----------------------------------------------------


@checker("combination:two_responses")
def two_responses(text: str) -> bool:
    """Two different responses separated by `******`."""
    responses = _parts(text.split("******"))
    return responses is not None and len(responses) == 2 and responses[0].strip() != responses[1].strip()


@checker("combination:repeat_prompt")
def repeat_prompt(text: str, *, prompt_to_repeat) -> bool:
    if not prompt_to_repeat:
        raise ValueError("ifbench instruction 'combination:repeat_prompt' needs prompt_to_repeat")
    return text.strip().lower().startswith(prompt_to_repeat.strip().lower())


@checker("startend:end_checker")
def end_checker(text: str, *, end_phrase) -> bool:
    return text.strip().strip('"').lower().endswith(end_phrase.strip().lower())


@checker("startend:quotation")
def quotation(text: str) -> bool:
    value = text.strip()
    return len(value) > 1 and value[0] == '"' and value[-1] == '"'


checker("punctuation:no_comma", lambda text: "," not in text)
