"""The project's own prompt set for collecting length-predictor data, and the prompt-only baseline's features.

Eight task types whose natural answers differ in length by two orders of magnitude, from a one-word fact to
a story, each a template filled from word lists: 533 distinct prompts. Lists
ask for N items, which ties length to a number in the prompt; explanations and stories run long, and their
length is mostly up to the model. ``prompt_set(n, seed)`` takes an even share of every task type, in a seeded
order: the same (n, seed) gives the same prompts on every machine.
"""

from __future__ import annotations

import itertools
import random
import re
import zlib
from dataclasses import dataclass

import numpy as np

COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "Kenya", "Norway", "Peru", "India", "Spain", "Italy",
             "Germany", "Mexico", "Australia", "Chile", "Greece", "Turkey", "Vietnam", "Poland", "Portugal",
             "Argentina", "Sweden", "Thailand", "Morocco", "Ireland", "Cuba", "Nigeria", "Finland", "Austria",
             "Indonesia"]
ANIMALS = ["spider", "horse", "bird", "ant", "octopus", "dog", "snake", "crab", "cow", "beetle", "starfish",
           "kangaroo", "bee", "lobster", "frog", "chicken"]
CONCEPTS = ["gravity", "photosynthesis", "inflation", "a black hole", "democracy", "machine learning",
            "the water cycle", "evolution", "compound interest", "an earthquake", "a vaccine", "the internet",
            "a rainbow", "climate change", "blockchain", "the immune system", "electricity", "a volcano",
            "supply and demand", "the greenhouse effect", "a computer virus", "recycling", "the moon's phases",
            "a solar eclipse", "DNA", "a neural network", "the stock market", "plate tectonics",
            "nuclear fusion", "an operating system"]
AUDIENCES = ["a ten-year-old", "a university student", "a busy manager", "someone who has never heard of it"]
CATEGORIES = ["fruits", "animals that live in the ocean", "European capitals", "programming languages",
              "musical instruments", "vegetables", "famous scientists", "board games", "colors", "sports",
              "kitchen tools", "flowers", "car brands", "planets and moons", "breakfast foods", "trees",
              "birds", "hobbies", "things to pack for a beach trip", "ways to save money", "dog breeds",
              "rivers", "gemstones", "occupations", "desserts"]
LIST_COUNTS = [2, 3, 5, 8, 12, 16, 20, 25]
SUBJECTS = ["a lighthouse keeper and a lost cat", "a robot learning to paint", "a dragon who is afraid of fire",
            "two friends lost in a forest", "a time traveler stuck in 1850", "a baker who finds a magic coin",
            "a child who can talk to trees", "the last day of summer camp", "a detective in a small village",
            "an astronaut alone on Mars", "a city where it always rains", "a musician who lost her voice",
            "a fox and a crow", "a haunted library", "a journey across the desert", "an old man and the sea",
            "a talking teapot", "a storm at sea", "a girl who builds a rocket", "a lonely giant"]
CODE_TASKS = ["checks whether a string is a palindrome", "returns the n-th Fibonacci number",
              "reverses a linked list", "counts the words in a text file", "merges two sorted lists",
              "finds the largest element in a list", "converts Celsius to Fahrenheit",
              "checks whether a number is prime", "removes duplicates from a list while keeping order",
              "computes the factorial of a number", "flattens a nested list", "validates an email address",
              "sorts a list of dictionaries by a key", "computes the average of a list of numbers",
              "finds all anagrams of a word in a list", "implements binary search",
              "counts the vowels in a string", "parses a CSV line into fields", "computes the GCD of two numbers",
              "transposes a matrix"]
ACTIVITIES = ["bake bread", "plant a tree", "change a flat tire", "make a cup of tea", "learn a new language",
              "set up a home aquarium", "prepare for a job interview", "write a resume", "start running",
              "organize a closet", "make a paper airplane", "brew coffee with a French press",
              "clean a laptop keyboard", "plan a birthday party", "build a campfire"]
STEP_COUNTS = [3, 5, 8]
TOPICS = ["autumn rain", "the ocean", "a mountain at dawn", "city lights", "a quiet morning", "snow", "the moon",
          "a cherry blossom", "a river", "a thunderstorm", "the desert", "a candle"]


@dataclass(frozen=True)
class Prompt:
    pid: str  # stable id: task and the template's fill-in
    task: str
    text: str


def _fact() -> list[Prompt]:
    out = [Prompt(f"fact-capital-{c}", "fact", f"Answer in one word: what is the capital of {c}?") for c in COUNTRIES]
    out += [Prompt(f"fact-legs-{a}", "fact", f"Answer with just a number: how many legs does a {a} have?")
            for a in ANIMALS]
    return out


def _sentence() -> list[Prompt]:
    return [Prompt(f"sentence-{c}", "sentence", f"In one sentence, what is {c}?") for c in CONCEPTS]


def _haiku() -> list[Prompt]:
    return [Prompt(f"haiku-{t}", "haiku", f"Write a haiku about {t}.") for t in TOPICS]


def _list() -> list[Prompt]:
    return [Prompt(f"list-{n}-{c}", "list", f"List {n} {c}. Write one per line, with no explanations.")
            for n, c in itertools.product(LIST_COUNTS, CATEGORIES)]


def _explain() -> list[Prompt]:
    return [Prompt(f"explain-{c}-{a}", "explain", f"Explain {c} to {a}.")
            for c, a in itertools.product(CONCEPTS, AUDIENCES)]


def _steps() -> list[Prompt]:
    return [Prompt(f"steps-{n}-{a}", "steps", f"Describe how to {a} in {n} steps.")
            for n, a in itertools.product(STEP_COUNTS, ACTIVITIES)]


def _story() -> list[Prompt]:
    lengths = ["a short story", "a very short story", "a story"]
    return [Prompt(f"story-{i}-{s}", "story", f"Write {w} about {s}.")
            for (i, w), s in itertools.product(enumerate(lengths), SUBJECTS)]


def _code() -> list[Prompt]:
    return [Prompt(f"code-{t}", "code", f"Write a Python function that {t}.") for t in CODE_TASKS]


TASKS = {"fact": _fact, "sentence": _sentence, "haiku": _haiku, "list": _list, "explain": _explain,
         "steps": _steps, "story": _story, "code": _code}


def all_prompts() -> dict[str, list[Prompt]]:
    """Every prompt of every task type, in template order."""
    return {task: build() for task, build in TASKS.items()}


def prompt_set(n: int, seed: int = 0) -> list[Prompt]:
    """``n`` prompts, an even share of each task type (a type with too few gives all it has, the others more).

    Each type is shuffled with ``seed`` and the types are interleaved round-robin, so a prefix of the result
    is itself balanced.
    """
    rng = random.Random(seed)
    pools = []
    for task, prompts in all_prompts().items():
        pool = list(prompts)
        random.Random(f"{seed}-{task}").shuffle(pool)
        pools.append(pool)
    rng.shuffle(pools)
    out: list[Prompt] = []
    for round_ in itertools.zip_longest(*pools):
        out.extend(p for p in round_ if p is not None)
        if len(out) >= n:
            break
    if len(out) < n:
        raise ValueError(f"the prompt set has only {len(out)} prompts, asked for {n}")
    return out[:n]


# ---- prompt features: what an auxiliary length predictor sees (the prompt's text, nothing from the LLM) ----

HASH_DIMS = 256
_WORD = re.compile(r"[a-z0-9']+")
_NUMBER = re.compile(r"\b\d+\b")


def _bucket(token: str) -> int:
    return zlib.crc32(token.encode()) % HASH_DIMS  # crc32, not hash(): stable across processes


def prompt_features(text: str) -> np.ndarray:
    """A fixed-size vector for a prompt: hashed bag of words and word bigrams (binary), log word count, and
    the first number in the prompt (log1p, with a has-number flag) since a count asked for ("List 12 ...")
    bounds the answer. ``HASH_DIMS + 3`` floats."""
    words = _WORD.findall(text.lower())
    x = np.zeros(HASH_DIMS + 3, dtype=np.float32)
    for token in itertools.chain(words, (f"{a} {b}" for a, b in itertools.pairwise(words))):
        x[_bucket(token)] = 1.0
    x[HASH_DIMS] = np.log1p(len(words))
    numbers = _NUMBER.findall(text)
    if numbers:
        x[HASH_DIMS + 1] = np.log1p(float(numbers[0]))
        x[HASH_DIMS + 2] = 1.0
    return x
