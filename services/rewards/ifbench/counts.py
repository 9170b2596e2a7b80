"""IFBench's own instructions that count, compare or place words and sentences: the `count:`,
`ratio:`, `sentence:` and `words:` ids of its out-of-distribution set. Each checker says whether a
response follows the instruction, with the kwargs IFBench's data gives it; a word is split the way
each IFBench checker splits it (whitespace, `\\w+` runs or NLTK's tokenizer), which differ on
purpose from one instruction to the next."""

from __future__ import annotations

import re
import string
from collections import Counter
from itertools import groupby, pairwise

from services.rewards.ifbench.text import (
    PUNCTUATION_SPACE,
    checker,
    count,
    count_words,
    no_punctuation,
    pos_tags,
    sentences,
    stopwords,
    syllables,
    word_tokens,
)

PERSON_NAMES = ("Emma", "Liam", "Sophia", "Jackson", "Olivia", "Noah", "Ava", "Lucas", "Isabella", "Mason", "Mia",
                "Ethan", "Charlotte", "Alexander", "Amelia", "Benjamin", "Harper", "Leo", "Zoe", "Daniel", "Chloe",
                "Samuel", "Lily", "Matthew", "Grace", "Owen", "Abigail", "Gabriel", "Ella", "Jacob", "Scarlett",
                "Nathan", "Victoria", "Elijah", "Layla", "Nicholas", "Audrey", "David", "Hannah", "Christopher",
                "Penelope", "Thomas", "Nora", "Andrew", "Aria", "Joseph", "Claire", "Ryan", "Stella",
                "Jonathan")  # fmt: skip
"""The names `count:person_names` counts (the instruction lists them to the model)."""
CONJUNCTIONS = frozenset(("and", "but", "for", "nor", "or", "so", "yet"))
PRONOUNS = frozenset((
    "i", "me", "we", "us", "you", "he", "him", "she", "her", "it", "they", "them", "my", "mine", "our", "ours",
    "your", "yours", "his", "hers", "its", "their", "theirs", "myself", "ourselves", "yourself", "yourselves",
    "himself", "herself", "itself", "themselves", "this", "that", "these", "those", "who", "whom", "whose", "which",
    "what", "whoever", "whomever", "whatever", "whichever", "anybody", "anyone", "anything", "everybody",
    "everyone", "everything", "nobody", "nothing", "somebody", "someone", "something", "each", "either", "neither",
    "both", "all", "some", "any", "none"))  # fmt: skip
PRIMES = frozenset((2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97))
_JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
_CONSONANTS = frozenset("bcdfghjklmnpqrstvwxyz")


# ---- count: ---------------------------------------------------------------------------------


@checker("count:word_count_range")
def word_count_range(text: str, *, min_words, max_words) -> bool:
    return count("min_words", min_words) <= count_words(text) <= count("max_words", max_words)


@checker("count:unique_word_count")
def unique_word_count(text: str, *, N) -> bool:
    return len({w.strip(PUNCTUATION_SPACE) for w in text.lower().split()}) >= count("N", N)


@checker("count:conjunctions")
def conjunctions(text: str, *, small_n) -> bool:
    """At least `small_n` different coordinating conjunctions (different as written: `And`, `and,`)."""
    used = {w for w in text.split() if w.strip(PUNCTUATION_SPACE).lower() in CONJUNCTIONS}
    return len(used) >= count("small_n", small_n)


@checker("count:person_names")
def person_names(text: str, *, N) -> bool:
    return sum(1 for name in PERSON_NAMES if re.search(rf"\b{re.escape(name)}\b", text)) >= count("N", N)


@checker("count:numbers")
def numbers(text: str, *, N) -> bool:
    """Exactly N numbers (digit runs, punctuation removed first: `3.14` is one)."""
    return len(re.findall(r"\d+", no_punctuation(text))) == count("N", N)


@checker("count:punctuation")
def punctuation(text: str) -> bool:
    """Every one of `. , ! ? ; :` and an interrobang (`?!`, `!?` or `‽`), which does not count for them."""
    if not ("!?" in text or "?!" in text or "‽" in text):
        return False
    rest = text.replace("?!", "", 1)
    if len(rest) == len(text):
        rest = text.replace("!?", "", 1)
    return set(".,!?;:") <= set(rest)


@checker("count:words_japanese")
def words_japanese(text: str, *, N) -> bool:
    """Every N-th whitespace word (numbers aside) holds a Japanese character."""
    every = count("N", N, 1)
    words = (w.strip(PUNCTUATION_SPACE) for i, w in enumerate(text.split(), 1) if i % every == 0)
    return all(not w or w.isdigit() or _JAPANESE.search(w) for w in words)


@checker("count:pronouns")
def pronouns(text: str, *, N) -> bool:
    """At least N pronouns among NLTK's word tokens (`she/her` counts two)."""
    return sum(1 for w in word_tokens(text.replace("/", " ").lower()) if w in PRONOUNS) >= count("N", N)


@checker("count:keywords_multiple")
def keywords_multiple(text: str, *, keyword1, keyword2, keyword3, keyword4, keyword5) -> bool:
    """keyword1..5 appear exactly 1, 2, 3, 5 and 7 times (substrings, any case)."""
    lowered = text.lower()
    wanted = zip((keyword1, keyword2, keyword3, keyword4, keyword5), (1, 2, 3, 5, 7), strict=True)
    return all(lowered.count(k.strip().lower()) == n for k, n in wanted)


# ---- ratio: ---------------------------------------------------------------------------------


@checker("ratio:stop_words")
def stop_words(text: str, *, percentage) -> bool:
    words = count_words(text)
    if words == 0:
        return False
    found = sum(1 for t in re.findall(r"\w+", text) if t.lower() in stopwords())
    return found / words * 100 <= count("percentage", percentage)


def _endings(text: str) -> Counter:
    return Counter(s[-1] for s in sentences(text) if s and s[-1] in ".?!")


@checker("ratio:sentence_type")
def sentence_type(text: str) -> bool:
    """Twice as many sentences ending in `.` as in `?`."""
    ends = _endings(text)
    return ends["."] == 2 * ends["?"]


@checker("ratio:sentence_balance")
def sentence_balance(text: str) -> bool:
    ends = _endings(text)
    return ends["."] == ends["?"] == ends["!"]


@checker("ratio:overlap")
def overlap(text: str, *, reference_text, percentage) -> bool:
    """The share of the response's character trigrams found in the reference is within 2 points
    of `percentage`."""

    def trigrams(s: str) -> set[str]:
        return {s[i : i + 3] for i in range(len(s) - 2)}

    mine = trigrams(text)
    if not mine:
        return False
    share = len(mine & trigrams(reference_text)) / len(mine) * 100
    target = count("percentage", percentage)
    return target - 2 <= share <= target + 2


@checker("ratio:sentence_words")
def sentence_words(text: str) -> bool:
    """Exactly three sentences, all of the same number of characters."""
    found = sentences(text)
    return len(found) == 3 and len({len(s.strip()) for s in found}) == 1


# ---- sentence: ------------------------------------------------------------------------------


@checker("sentence:alliteration_increment")
def alliteration_increment(text: str) -> bool:
    """Each sentence alliterates more than the one before (a run of k words with the same first
    letter scores k)."""
    previous = -1
    for sentence in sentences(text):
        words = [w for w in (w.lstrip(PUNCTUATION_SPACE) for w in sentence.lower().split()) if w]
        runs = (len(list(g)) for _, g in groupby(w[0] for w in words))
        score = sum(k for k in runs if k > 1)
        if score <= previous:
            return False
        previous = score
    return True


@checker("sentence:keyword")
def sentence_keyword(text: str, *, word, N) -> bool:
    """Sentence N holds `word` (a whole word, any case)."""
    if not word:
        raise ValueError("ifbench argument word must be a word (IFBench draws it at random otherwise)")
    found = sentences(text)
    n = count("N", N, 1)
    return len(found) >= n and re.search(rf"\b{re.escape(word)}\b", found[int(n) - 1], re.IGNORECASE) is not None


@checker("sentence:increment")
def sentence_increment(text: str, *, small_n) -> bool:
    """Each sentence has exactly `small_n` more words than the one before."""
    step = count("small_n", small_n)
    sizes = [len(no_punctuation(s).split()) for s in sentences(text)]
    return all(b == a + step for a, b in zip(sizes, sizes[1:], strict=False))


# ---- words: ---------------------------------------------------------------------------------


@checker("words:alphabet")
def alphabet(text: str) -> bool:
    """Word i starts with the letter after word i-1's, z wrapping to a."""
    words = no_punctuation(text).strip(PUNCTUATION_SPACE).split()
    if not words or not "a" <= words[0][0].lower() <= "z":
        return False
    first = words[0][0].lower()
    return all(w.lower()[0] == chr((ord(first) - ord("a") + i) % 26 + ord("a")) for i, w in enumerate(words[1:], 1))


@checker("words:vowel")
def vowel(text: str) -> bool:
    """One paragraph (line) using at most three different vowels."""
    lines = text.strip().split("\n")
    return len(lines) == 1 and len(set(lines[0].lower()) & set("aeiou")) <= 3


@checker("words:consonants")
def consonants(text: str) -> bool:
    """Every whitespace word holds two consonants in a row."""
    words = text.lower().strip().split()
    return all(any(a in _CONSONANTS and b in _CONSONANTS for a, b in zip(w, w[1:], strict=False)) for w in words)


@checker("words:palindrome")
def palindrome(text: str) -> bool:
    """At least ten palindromes of five letters or more."""
    words = no_punctuation(text).lower().split()
    return sum(1 for w in words if len(w) >= 5 and w == w[::-1]) >= 10


checker("words:prime_lengths", lambda text: all(len(w) in PRIMES for w in no_punctuation(text).split()))


@checker("words:start_verb")
def start_verb(text: str) -> bool:
    """The first token is tagged a verb by NLTK's tagger (installed NLTK data: text.py)."""
    tokens = word_tokens(text)
    return bool(tokens) and "VB" in pos_tags(tokens)[0][1]


@checker("words:repeats")
def repeats(text: str, *, small_n) -> bool:
    limit = count("small_n", small_n)
    return all(n <= limit for n in Counter(no_punctuation(text.lower()).split()).values())


@checker("words:odd_even_syllables")
def odd_even_syllables(text: str) -> bool:
    """Words alternate between an odd and an even number of syllables (syllapy's count)."""
    parity = [syllables(w) % 2 for w in no_punctuation(text).lower().split() if w.strip()]
    return all(a != b for a, b in zip(parity, parity[1:], strict=False))


@checker("words:last_first")
def last_first(text: str) -> bool:
    """Each sentence starts with the word the one before ended with."""
    found = sentences(text)
    pairs = ((a.rstrip(PUNCTUATION_SPACE).split(), b.lstrip(PUNCTUATION_SPACE).split()) for a, b in pairwise(found))
    return all(last and first and last[-1].lower() == first[0].lower() for last, first in pairs)


@checker("words:paragraph_last_first")
def paragraph_last_first(text: str) -> bool:
    """Each line starts and ends with the same word."""
    lines = (line.strip().lower().strip(PUNCTUATION_SPACE).split() for line in text.split("\n"))
    return all(not words or words[0] == words[-1] for words in lines)


@checker("words:no_consecutive")
def no_consecutive(text: str) -> bool:
    """No two words in a row start with the same letter."""
    words = no_punctuation(text.lower()).split()
    return all(a[0] != b[0] for a, b in zip(words, words[1:], strict=False))


@checker("words:keywords_specific_position")
def keywords_specific_position(text: str, *, keyword, n, m) -> bool:
    """Word m (NLTK tokens that hold a letter or digit) of sentence n is `keyword`."""
    n, m = int(count("n", n, 1)), int(count("m", m, 1))
    found = sentences(text)
    if len(found) < n:
        return False
    words = [t for t in word_tokens(found[n - 1]) if any(c.isalnum() for c in t)]
    return len(words) >= m and words[m - 1].lower() == keyword.strip().lower()


@checker("words:words_position")
def words_position(text: str, *, keyword) -> bool:
    """The second token and the second to last (a final punctuation mark aside) are `keyword`."""
    words, keyword = word_tokens(text), keyword.strip().lower()
    back = 3 if words and words[-1] in string.punctuation else 2
    return len(words) >= back and words[1].lower() == words[-back].lower() == keyword
