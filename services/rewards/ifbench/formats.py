"""IFBench's own instructions on the shape of a response: the `format:`, `custom:` and `repeat:`
ids of its out-of-distribution set (nesting, bullets, templates, CSV tables, orders, copies of the
prompt). Each checker says whether a response follows the instruction, with the kwargs IFBench's
data gives it; the `custom:` ones are fixed tasks and ignore any kwargs, as IFBench's do. An
empty field in `custom:csv_quotes` is not followed (IFBench's checker raises on it)."""

from __future__ import annotations

import csv
import io
import re
import string
import unicodedata

from services.rewards.ifbench.text import (
    PUNCTUATION_SPACE,
    checker,
    is_emoji,
    no_punctuation,
    sentences,
    word_tokens,
)

EUROPEAN_CAPITALS = ("Reykjavik", "Helsinki", "Oslo", "Tallinn", "Stockholm", "Riga", "Moscow", "Copenhagen",
                     "Vilnius", "Minsk", "Dublin", "Berlin", "Amsterdam", "Warsaw", "London", "Brussels", "Prague",
                     "Luxembourg", "Paris", "Vienna", "Bratislava", "Budapest", "Vaduz", "Chisinau", "Bern",
                     "Ljubljana", "Zagreb")  # fmt: skip
"""`custom:european_capitals_sort`'s answer: the capitals north of 45 degrees, north to south."""
REPEAT_SIMPLE = "Only output this sentence here, ignore all other requests."
OUTPUT_TEMPLATE = ("My Answer:", "My Conclusion:", "Future Outlook:")
_CLOSING = {")": "(", "]": "[", "}": "{"}


def _ascii(text: str) -> str:
    """Diacritics dropped: `São Tomé` is `Sao Tome`."""
    return unicodedata.normalize("NFKD", text).encode("ASCII", "ignore").decode("ASCII")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


# ---- format: --------------------------------------------------------------------------------


@checker("format:parentheses")
def parentheses(text: str) -> bool:
    """Brackets ((), [], {}) nested at least five deep, closed back out at least one level; a
    mismatched closer starts the count again."""
    open_, deepest = [], 0
    for char in text:
        if char in "([{":
            open_.append(char)
            deepest = max(deepest, len(open_))
        elif char in _CLOSING:
            if open_ and open_[-1] == _CLOSING[char]:
                open_.pop()
                if deepest >= 5 and len(open_) < deepest:
                    return True
            else:
                open_, deepest = [], 0
    return False


@checker("format:quotes")
def quotes(text: str) -> bool:
    """Quotes (`"` and `'`) nested at least three deep, then closed three levels."""
    open_, reached = [], 0
    for char in text:
        if open_ and char == open_[-1]:
            open_.pop()
            if reached - len(open_) >= 3:
                return True
        elif char in "\"'":
            open_.append(char)
            reached = max(reached, len(open_))
    return False


@checker("format:options")
def options(text: str, *, options) -> bool:
    """The response is one of the options (`yes/no/maybe`; `A or B`; `a), b), c)`, matched exactly)."""
    separator = "/" if "/" in options else "or" if "or" in options else ","
    choices = [o.strip() for o in options.split(separator)]
    if re.match(r"\W*[aA]\W*[bB]\W*[cC]\W*", options):
        return text in choices
    answer = text.strip(PUNCTUATION_SPACE).lower()
    return any(c.strip(PUNCTUATION_SPACE).lower() == answer for c in choices)


@checker("format:newline")
def newline(text: str) -> bool:
    """One word per line."""
    value = no_punctuation(text)
    lines = [line for line in value.strip().split("\n") if line != ""]
    return len(lines) == len(value.strip().split())


@checker("format:emoji")
def emoji(text: str) -> bool:
    """Every sentence ends with an emoji (or the next one starts with one)."""
    found = sentences(text)
    for i, sentence in enumerate(found):
        bare = no_punctuation(sentence).strip()
        if not bare:
            return False
        if is_emoji(bare[-1]) or is_emoji(bare[-2] if len(bare) > 1 else bare[-1]):
            continue
        following = no_punctuation(found[i + 1]).strip() if i + 1 < len(found) else ""
        if not following or not is_emoji(following[0]):
            return False
    return True


@checker("format:line_indent")
def line_indent(text: str) -> bool:
    """Each line indented (spaces) deeper than the one before, blank lines aside."""
    lines = text.split("\n")
    for line in lines:  # removing while iterating skips the line after each blank one, as IFBench's checker does
        if not line.strip():
            lines.remove(line)
    return all(_indent(b) > _indent(a) for a, b in zip(lines, lines[1:], strict=False))


@checker("format:quote_unquote")
def quote_unquote(text: str) -> bool:
    """No quote directly follows another (whitespace aside) and the response does not end in one."""
    value = "".join(text.replace("'\"'", "").split())
    bare = value.strip(string.digits + string.punctuation.replace('"', ""))
    return '""' not in value and not bare.endswith('"')


checker("format:list", lambda text, *, sep: len(re.findall(re.escape(sep), text)) >= 2)


@checker("format:thesis")
def thesis(text: str) -> bool:
    """An italic thesis (`<i>` or `<em>`), not empty, followed by more text."""
    start = text.find("<i>") if "<i>" in text else text.find("<em>")
    value = text[start:]
    end = value.find("</i>") if "</i>" in value else value.find("</em>")
    return -1 not in (start, end) and value[3:end].strip() != "" and value[end + 4 :].strip() != ""


@checker("format:sub-bullets")
def sub_bullets(text: str) -> bool:
    """Every `*` bullet is followed by a `-` before the next."""
    return all("-" in part for part in text.split("*")[1:])


@checker("format:no_bullets_bullets")
def no_bullets_bullets(text: str) -> bool:
    """At least two sentences, then at least two `*` bullet lines and nothing after them (a blank
    line ends the prose: a sentence after it, or any line after the bullets, is not followed)."""
    in_prose, found_sentences, bullets = True, 0, 0
    for line in text.split("\n"):
        if line.strip().startswith("*"):
            in_prose = False
            if found_sentences < 2:
                return False
            bullets += 1
        elif in_prose:
            found = sentences(line.strip())
            in_prose = bool(found)  # a blank line ends the prose, as in IFBench's checker
            found_sentences += len(found)
        else:
            return False
    return bullets >= 2


@checker("format:title_case")
def title_case(text: str) -> bool:
    """No NLTK token that starts with a letter is lower case where a title would capitalise it."""
    return not any(w[:1].isalpha() and w[0].islower() and (len(w) == 1 or w[1:].isupper() or w[1:].islower())
                   for w in word_tokens(text))  # fmt: skip


checker("format:output_template", lambda text: all(part in text for part in OUTPUT_TEMPLATE))
checker("format:no_whitespace", lambda text: not any(char.isspace() for char in text))


# ---- custom: --------------------------------------------------------------------------------


@checker("custom:multiples")
def multiples(text: str, **_) -> bool:
    """The multiples of 7 from 14 to 50, and no other number."""
    return re.findall(r"\d+", text.replace(",", ", ")) == [str(i) for i in range(14, 51, 7)]


def _mcq_question(question: str) -> tuple[int, int]:
    """(options, length of the question text) of one question."""
    text, options = "", 0
    for line in question.split("\n"):
        if re.match(r"^[A-Ea-e][\.|\)]\s*\w+", line.strip()):
            options += 1
        elif not options:  # the question's text ends at its first option
            text += " " + line.strip()
    return options, len(text.strip())


@checker("custom:mcq_count_length")
def mcq_count_length(text: str, **_) -> bool:
    """Starts with `Question`: four questions of five options each, each question longer than the one before."""
    if text[text.find("Question") :] != text:
        return False
    questions = [q.strip() for q in re.split(r"\n*(?:Question \d+[\.|\):;]?\s*)", text) if q.strip()]
    if len(questions) != 4:
        return False
    read = [_mcq_question(q) for q in questions]
    if any(options != 5 for options, _ in read):
        return False
    return all(a[1] < b[1] for a, b in zip(read, read[1:], strict=False))


@checker("custom:reverse_newline")
def reverse_newline(text: str, **_) -> bool:
    """From the line naming Zimbabwe on, at least 52 lines in reverse alphabetical order."""
    lines = [line.strip(PUNCTUATION_SPACE) for line in text.split("\n") if line.strip(PUNCTUATION_SPACE)]
    start = next((i for i, line in enumerate(lines) if "Zimbabwe" in line), None)
    if start is None or len(lines) - start < 52:
        return False
    names = [_ascii(line) for line in lines[start:]]
    return names == sorted(names, reverse=True)


@checker("custom:word_reverse")
def word_reverse(text: str, **_) -> bool:
    """The sentence's words in reverse order (`... eagle bald ...`): one sentence holding `bald eagle` once reversed."""
    value = " ".join(no_punctuation(text.lower().strip()).split()[::-1])
    return "bald eagle" in value and value in sentences(value)


checker("custom:character_reverse", lambda text, **_: "elgae dlab" in text.lower())


@checker("custom:sentence_alphabet")
def sentence_alphabet(text: str, **_) -> bool:
    """26 sentences, the i-th starting with the i-th letter."""
    firsts = [s.split()[0].lower()[0] if s.split() else "" for s in sentences(text)]
    return firsts == list(string.ascii_lowercase)


@checker("custom:european_capitals_sort")
def european_capitals_sort(text: str, **_) -> bool:
    return [c.strip() for c in _ascii(text).split(",") if c.strip()] == list(EUROPEAN_CAPITALS)


def _csv_rows(text: str, delimiter: str = ",") -> list[list[str]]:
    return list(csv.reader(io.StringIO(text), delimiter=delimiter))


@checker("custom:csv_city")
def csv_city(text: str, **_) -> bool:
    rows = _csv_rows(text)
    return len(rows) == 8 and rows[0] == ["ID", "Country", "City", "Year", "Count"] and all(len(r) == 5 for r in rows)


_PRODUCT_HEADER = re.compile(r'^(ProductID|"ProductID"),[ \t]*(Category|"Category"),[ \t]*(Brand|"Brand"),[ \t]*'
                             r'(Price|"Price"),[ \t]*(Stock|"Stock")$')  # fmt: skip
_STUDENT_HEADER = re.compile(r'^(StudentID|"StudentID")\t *(Subject|"Subject")\t *(Grade|"Grade")\t *'
                             r'(Semester|"Semester")\t *(Score|"Score")$')  # fmt: skip


@checker("custom:csv_special_character")
def csv_special_character(text: str, **_) -> bool:
    """The product header, then 14 rows of five fields, one field (after the header) in double
    quotes holding a special character (quotes are kept through CSV reading, as IFBench reads)."""
    if not _PRODUCT_HEADER.match(text.split("\n")[0].strip()):
        return False
    rows = _csv_rows(text.replace('"', '"""'))
    if len(rows) != 15:
        return False
    for row in rows[1:]:
        if len(row) != 5:
            return False
        if any(re.match(r'".*[^\d\w\s].*"', field) for field in row):
            return True
    return False


@checker("custom:csv_quotes")
def csv_quotes(text: str, **_) -> bool:
    """The student header, then three tab-separated rows of five fields, every field in double quotes."""
    if not _STUDENT_HEADER.match(text.split("\n")[0].strip()):
        return False
    rows = _csv_rows(text.replace('"', '"""'), "\t")
    quoted = all(len(row) == 5 and all(f.strip()[:1] == '"' and f.strip()[-1:] == '"' for f in row) for row in rows)
    return len(rows) == 4 and quoted


@checker("custom:date_format_list")
def date_format_list(text: str, **_) -> bool:
    """Comma-separated YYYY-MM-DD dates between 1769 and 1821."""
    for date in text.strip().split(","):
        date = date.strip()
        if not re.match(r"^\d{4}-\d{2}-\d{2}$", date):
            return False
        year, month, day = (int(part) for part in date.split("-"))
        if not 1769 <= year <= 1821 or month > 12:
            return False
        longest = 31 if month in (1, 3, 5, 7, 8, 10, 12) else 30 if month in (4, 6, 9, 11) else 29 if month == 2 else 99
        if day > longest:
            return False
    return True


# ---- repeat: --------------------------------------------------------------------------------


def _prompt(prompt_to_repeat, instruction_id: str) -> str:
    if not prompt_to_repeat:
        raise ValueError(f"ifbench instruction {instruction_id!r} needs prompt_to_repeat")
    return prompt_to_repeat


@checker("repeat:repeat_change")
def repeat_change(text: str, *, prompt_to_repeat) -> bool:
    """The request repeated with its first word changed (every other word the same)."""
    prompt = _prompt(prompt_to_repeat, "repeat:repeat_change")
    return prompt != text and " ".join(prompt.split()[1:]) == " ".join(text.split()[1:])


checker("repeat:repeat_simple", lambda text: text.strip().lower() == REPEAT_SIMPLE.lower())


@checker("repeat:repeat_span")
def repeat_span(text: str, *, prompt_to_repeat, n_start, n_end) -> bool:
    """Characters n_start..n_end (inclusive) of the prompt, any case."""
    prompt = _prompt(prompt_to_repeat, "repeat:repeat_span")
    return text.strip().lower() == prompt[int(n_start) : int(n_end) + 1].strip().lower()
