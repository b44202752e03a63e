"""SYNTHETIC tasks: deterministic questions of the five domains for the simulated worker pool.

`synthetic_tasks(n, seed=...)` makes `n` questions in the `Record` format, with gold answers
the real scorers grade (the scorer of each domain: `SIM_SCORERS`) and, in `meta['sim']`, what
the simulated pool (`routing/simulated/pool.py`) needs to answer them wrongly in a plausible way:
distractor answers, and for CODE the correct and a buggy program. The questions are made up
(arithmetic, small programs, letter-choice facts, who-did-what puzzles, and facts about
fictional people); nothing is downloaded. Numbers measured on them say nothing about real
benchmarks: they only have to make the routing problem non-trivial.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax_routeweaver.data.records import Domain, Record

__all__ = ["LEVELS", "SIM_DATA_SOURCE", "SIM_POOL", "SIM_SCORERS", "normalize_ws",
           "synthetic_tasks"]

LEVELS = ("easy", "medium", "hard")
SIM_DATA_SOURCE = "routeweaver_simulated"
SIM_POOL = "synthetic"
# Which real scorer grades each synthetic domain (the scorer the original implementation maps
# that domain's datasets to).
SIM_SCORERS: Mapping[Domain, str] = {
    Domain.MATH: "math",
    Domain.CODE: "apps_functional",
    Domain.KNOWLEDGE: "mc_letter",
    Domain.REASON: "bbeh_mini",
    Domain.RECALL: "triviaqa",
}


def normalize_ws(text: str) -> str:
    """`text` with every run of whitespace one space, no leading or trailing space."""
    return " ".join(text.split())


@dataclasses.dataclass(frozen=True)
class _Draft:
    question: str
    gold: list[str]
    meta: dict[str, Any]


def _numeric_distractors(gold: int, rng: random.Random) -> list[str]:
    pool = [gold + 1, gold - 1, gold + 2, gold - 2, gold + 10, gold - 10, gold * 2, gold + 3]
    out: list[str] = []
    for value in pool:
        if value != gold and str(value) not in out:
            out.append(str(value))
    rng.shuffle(out)
    return out[:5]


def _gen_math(rng: random.Random, level: str) -> _Draft:
    if level == "easy":
        a, b, c = rng.randint(12, 99), rng.randint(3, 19), rng.randint(5, 99)
        question, gold = f"What is {a} * {b} + {c}?", a * b + c
    elif level == "medium":
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randint(3, 12), rng.randint(6, 24)
            c = rng.randint(1, a * b - 1)
            question = (f"A baker bakes {a} trays with {b} rolls on each tray and sells {c} "
                        f"rolls. How many rolls are left?")
            gold = a * b - c
        elif kind == 1:
            v, t, w = rng.randint(40, 120), rng.randint(2, 7), rng.randint(5, 60)
            question = (f"A train travels at {v} km per hour for {t} hours and then covers "
                        f"another {w} km. How many kilometres does it travel in total?")
            gold = v * t + w
        else:
            a, b = 3 * rng.randint(5, 40), rng.randint(2, 30)
            question = (f"Lena has {a} marbles. She gives a third of them to Tom and then buys "
                        f"{b} more. How many marbles does she have now?")
            gold = a - a // 3 + b
    else:
        kind = rng.randrange(3)
        if kind == 0:
            m = rng.randint(3, 13)
            r = rng.randint(1, m - 1)
            limit = rng.randint(40, 400)
            question = (f"Find the sum of all positive integers less than {limit} that leave a "
                        f"remainder of {r} when divided by {m}.")
            gold = sum(k for k in range(1, limit) if k % m == r)
        elif kind == 1:
            x = rng.randint(-20, 20)
            a, c = rng.sample(range(2, 15), 2)
            b = rng.randint(-50, 50)
            d = (a - c) * x + b
            question = f"If {a}x + {b} = {c}x + {d}, what is the value of x?"
            question = question.replace("+ -", "- ")
            gold = x
        else:
            n = rng.choice([2, 3, 5, 6, 7]) ** rng.randint(1, 4) * rng.choice([1, 10, 12, 18, 45])
            question = f"How many positive divisors does {n} have?"
            gold = sum(1 for k in range(1, n + 1) if n % k == 0)
    return _Draft(question, [str(gold)], {"sim": {"distractors": _numeric_distractors(gold, rng)}})


# ---------------------------------------------------------------------------- code
@dataclasses.dataclass(frozen=True)
class _CodeTemplate:
    """A function-writing task family: parameters -> (question, correct source, buggy source)."""

    level: str
    func_name: str
    params: Callable[[random.Random], dict[str, Any]]
    question: Callable[[dict[str, Any]], str]
    solution: Callable[[dict[str, Any]], str]
    buggy: Callable[[dict[str, Any]], str]
    inputs: Callable[[random.Random, dict[str, Any]], list[list[Any]]]


def _int_list(rng: random.Random, lo: int, hi: int, max_len: int = 8) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, max_len))]


def _coin_params(rng: random.Random) -> dict[str, Any]:
    while True:  # coin sets where greedy is wrong for some amount, so the bug is catchable
        coins = sorted(rng.sample(range(2, 26), 3))
        bad = [a for a in range(1, 80) if _greedy_coins(coins, a) != _dp_coins(coins, a)]
        if bad:
            return {"coins": coins, "bad": bad[:3]}


def _greedy_coins(coins: list[int], amount: int) -> int:
    count = 0
    for coin in sorted(coins, reverse=True):
        count += amount // coin
        amount %= coin
    return count if amount == 0 else -1


def _dp_coins(coins: list[int], amount: int) -> int:
    best = [0] + [math.inf] * amount
    for a in range(1, amount + 1):
        for coin in coins:
            if coin <= a and best[a - coin] + 1 < best[a]:
                best[a] = best[a - coin] + 1
    return -1 if best[amount] == math.inf else int(best[amount])


_CODE_TEMPLATES: tuple[_CodeTemplate, ...] = (
    _CodeTemplate(
        "easy", "count_beyond",
        lambda rng: {"t": rng.randint(-200, 200), "op": rng.choice([">", "<"])},
        lambda p: (f"Write a Python function `count_beyond(xs)` that takes a list of integers "
                   f"`xs` and returns how many of them are strictly "
                   f"{'greater' if p['op'] == '>' else 'less'} than {p['t']}."),
        lambda p: f"def count_beyond(xs):\n    return sum(1 for x in xs if x {p['op']} {p['t']})\n",
        lambda p: (f"def count_beyond(xs):\n"
                   f"    return sum(1 for x in xs if x {p['op']}= {p['t']})\n"),
        lambda rng, p: ([[_int_list(rng, p["t"] - 5, p["t"] + 5)] for _ in range(4)]
                        + [[[p["t"], p["t"] + 1, p["t"] - 1]], [[]]]),
    ),
    _CodeTemplate(
        "easy", "clamped_sum",
        lambda rng: {"lo": rng.randint(-50, 0), "hi": rng.randint(1, 50)},
        lambda p: (f"Write a Python function `clamped_sum(xs)` that returns the sum of the "
                   f"integers in `xs` after clamping each of them into the range "
                   f"[{p['lo']}, {p['hi']}] (values below {p['lo']} count as {p['lo']}, values "
                   f"above {p['hi']} count as {p['hi']})."),
        lambda p: (f"def clamped_sum(xs):\n"
                   f"    return sum(min(max(x, {p['lo']}), {p['hi']}) for x in xs)\n"),
        lambda p: f"def clamped_sum(xs):\n    return sum(min(x, {p['hi']}) for x in xs)\n",
        lambda rng, p: ([[_int_list(rng, p["lo"] - 30, p["hi"] + 30)] for _ in range(4)]
                        + [[[p["lo"] - 7, p["hi"] + 3, 0]], [[]]]),
    ),
    _CodeTemplate(
        "medium", "kth_largest_distinct",
        lambda rng: {"k": rng.randint(2, 4), "d": rng.randint(-99, -1)},
        lambda p: (f"Write a Python function `kth_largest_distinct(xs)` that returns the "
                   f"{_ORDINALS[p['k']]} largest distinct value in the list of integers `xs`, "
                   f"or {p['d']} if `xs` has fewer than {p['k']} distinct values."),
        lambda p: (f"def kth_largest_distinct(xs):\n"
                   f"    values = sorted(set(xs), reverse=True)\n"
                   f"    return values[{p['k'] - 1}] if len(values) >= {p['k']} else {p['d']}\n"),
        lambda p: (f"def kth_largest_distinct(xs):\n"
                   f"    values = sorted(xs, reverse=True)\n"
                   f"    return values[{p['k'] - 1}] if len(values) >= {p['k']} else {p['d']}\n"),
        lambda rng, p: ([[_int_list(rng, 0, 20, 10)] for _ in range(4)]
                        + [[[9, 9, 9, 4, 4, 2, 1, 0]], [[5] * (p["k"] + 1)]]),
    ),
    _CodeTemplate(
        "medium", "best_window_sum",
        lambda rng: {"w": rng.randint(2, 6), "d": rng.randint(-99, -1)},
        lambda p: (f"Write a Python function `best_window_sum(xs)` that returns the largest sum "
                   f"of {p['w']} consecutive elements of the list of integers `xs`, or {p['d']} "
                   f"if `xs` has fewer than {p['w']} elements."),
        lambda p: (f"def best_window_sum(xs):\n"
                   f"    if len(xs) < {p['w']}:\n"
                   f"        return {p['d']}\n"
                   f"    return max(sum(xs[i:i + {p['w']}]) for i in range(len(xs) - {p['w']} + 1))"
                   f"\n"),
        lambda p: (f"def best_window_sum(xs):\n"
                   f"    if len(xs) <= {p['w']}:\n"
                   f"        return {p['d']}\n"
                   f"    return max(sum(xs[i:i + {p['w']}]) for i in range(len(xs) - {p['w']}))"
                   f"\n"),
        lambda rng, p: ([[_int_list(rng, -10, 30, 12)] for _ in range(4)]
                        + [[[1] * (p["w"] - 1) + [0, 50, 60, 70, 80, 90, 99][: p["w"] + 1]],
                           [list(range(p["w"]))]]),
    ),
    _CodeTemplate(
        "hard", "count_climbs",
        lambda rng: {"k": rng.randint(2, 6), "mod": rng.randint(1000, 99999)},
        lambda p: (f"Write a Python function `count_climbs(n)` that returns the number of "
                   f"different ways to climb a staircase of `n` steps when each move climbs "
                   f"between 1 and {p['k']} steps, modulo {p['mod']}. For n = 0 there is "
                   f"exactly one way."),
        lambda p: (f"def count_climbs(n):\n"
                   f"    ways = [1] + [0] * n\n"
                   f"    for i in range(1, n + 1):\n"
                   f"        ways[i] = sum(ways[i - s] for s in range(1, {p['k']} + 1) if s <= i)"
                   f" % {p['mod']}\n"
                   f"    return ways[n]\n"),
        lambda p: (f"def count_climbs(n):\n"
                   f"    ways = [1] + [0] * n\n"
                   f"    for i in range(1, n + 1):\n"
                   f"        ways[i] = sum(ways[i - s] for s in range(1, {p['k']}) if s <= i)"
                   f" % {p['mod']}\n"
                   f"    return ways[n]\n"),
        lambda rng, p: [[0], [1], [p["k"]], [rng.randint(p["k"] + 1, 20)], [rng.randint(21, 60)]],
    ),
    _CodeTemplate(
        "hard", "fewest_coins",
        _coin_params,
        lambda p: (f"Write a Python function `fewest_coins(amount)` that returns the smallest "
                   f"number of coins with values {', '.join(map(str, p['coins']))} (each value "
                   f"can be used any number of times) that add up to exactly `amount`, or -1 "
                   f"if that is impossible."),
        lambda p: (f"def fewest_coins(amount):\n"
                   f"    coins = {p['coins']}\n"
                   f"    best = [0] + [None] * amount\n"
                   f"    for a in range(1, amount + 1):\n"
                   f"        options = [best[a - c] for c in coins if c <= a and best[a - c] is not"
                   f" None]\n"
                   f"        best[a] = min(options) + 1 if options else None\n"
                   f"    return -1 if best[amount] is None else best[amount]\n"),
        lambda p: (f"def fewest_coins(amount):\n"
                   f"    count = 0\n"
                   f"    for c in sorted({p['coins']}, reverse=True):\n"
                   f"        count += amount // c\n"
                   f"        amount %= c\n"
                   f"    return count if amount == 0 else -1\n"),
        lambda rng, p: [[a] for a in p["bad"]] + [[rng.randint(1, 99)] for _ in range(3)],
    ),
)

_ORDINALS = {1: "first", 2: "second", 3: "third", 4: "fourth", 5: "fifth", 6: "sixth",
             7: "seventh"}


def _run_source(source: str, func_name: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<sim:{func_name}>", "exec"), namespace)  # our own template text
    return namespace[func_name]


def _gen_code(rng: random.Random, level: str) -> _Draft:
    templates = [t for t in _CODE_TEMPLATES if t.level == level]
    template = rng.choice(templates)
    for _ in range(20):
        params = template.params(rng)
        solution, buggy = template.solution(params), template.buggy(params)
        good_fn = _run_source(solution, template.func_name)
        bad_fn = _run_source(buggy, template.func_name)
        tests, bug_caught = [], False
        for args in template.inputs(rng, params):
            expected = good_fn(*args)
            tests.append({"input": args, "output": expected})
            try:
                bug_caught = bug_caught or bad_fn(*args) != expected
            except Exception:  # a crashing buggy program is caught too
                bug_caught = True
        if bug_caught:
            break
    else:  # pragma: no cover - the templates' edge inputs always expose the bug
        raise RuntimeError(f"simulated code template {template.func_name}: bug not exposed")
    meta = {"func_name": template.func_name, "test_type": "functional", "tests": tests,
            "sim": {"solution": solution, "buggy_solution": buggy}}
    return _Draft(template.question(params), [], meta)


# ---------------------------------------------------------------------------- knowledge
_FACT_CATEGORIES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Which element has the chemical symbol {key}?", (
        ("Fe", "Iron"), ("Cu", "Copper"), ("Na", "Sodium"), ("K", "Potassium"),
        ("Ag", "Silver"), ("Au", "Gold"), ("Pb", "Lead"), ("Sn", "Tin"), ("Hg", "Mercury"),
        ("W", "Tungsten"), ("Sb", "Antimony"))),
    ("What is the SI unit of {key}?", (
        ("force", "newton"), ("energy", "joule"), ("power", "watt"), ("pressure", "pascal"),
        ("electric charge", "coulomb"), ("electrical resistance", "ohm"),
        ("frequency", "hertz"), ("magnetic flux", "weber"), ("inductance", "henry"),
        ("capacitance", "farad"))),
    ("How many sides does a {key} have?", (
        ("triangle", "3"), ("quadrilateral", "4"), ("pentagon", "5"), ("hexagon", "6"),
        ("heptagon", "7"), ("octagon", "8"), ("nonagon", "9"), ("decagon", "10"),
        ("hendecagon", "11"), ("dodecagon", "12"))),
    ("Which planet is the {key} planet from the Sun?", (
        ("first", "Mercury"), ("second", "Venus"), ("third", "Earth"), ("fourth", "Mars"),
        ("fifth", "Jupiter"), ("sixth", "Saturn"), ("seventh", "Uranus"),
        ("eighth", "Neptune"))),
)
_LETTERS = "ABCDEFGHIJ"
_N_OPTIONS = {"easy": 4, "medium": 6, "hard": 10}


def _gen_knowledge(rng: random.Random, level: str) -> _Draft:
    template, facts = rng.choice(_FACT_CATEGORIES)
    key, answer = rng.choice(facts)
    n_options = min(_N_OPTIONS[level], len(facts))
    others = rng.sample([value for _, value in facts if value != answer], n_options - 1)
    options = [*others, answer]
    rng.shuffle(options)
    letter = _LETTERS[options.index(answer)]
    lines = [template.format(key=key)]
    lines += [f"{_LETTERS[i]}. {option}" for i, option in enumerate(options)]
    lines.append("Answer with the letter of the correct option.")
    wrong = [_LETTERS[i] for i in range(n_options) if _LETTERS[i] != letter]
    rng.shuffle(wrong)
    return _Draft("\n".join(lines), [letter], {"sim": {"distractors": wrong[:5]}})


# ---------------------------------------------------------------------------- reason
_PEOPLE = ("Ari", "Bex", "Cato", "Dara", "Eli", "Fenn", "Gia", "Hal", "Ivo", "Juno", "Kit",
           "Lux", "Mira", "Nico", "Oren", "Pia", "Quin", "Rey", "Sol", "Tao", "Uma", "Vik")
_N_PEOPLE = {"easy": 3, "medium": 5, "hard": 7}


def _gen_reason(rng: random.Random, level: str) -> _Draft:
    k = _N_PEOPLE[level]
    ranking = rng.sample(_PEOPLE, k)  # tallest first
    facts = []
    for taller, shorter in itertools.pairwise(ranking):
        if rng.random() < 0.5:
            facts.append(f"{taller} is taller than {shorter}.")
        else:
            facts.append(f"{shorter} is shorter than {taller}.")
    rng.shuffle(facts)
    position = 0 if level == "easy" else rng.randrange(k)
    if position == 0 or (level != "easy" and position == k - 1 and rng.random() < 0.5):
        ask = "tallest" if position == 0 else "shortest"
        question_tail = f"Who is the {ask} of these {k} people?"
    else:
        question_tail = f"Who is the {_ORDINALS[position + 1]} tallest of these {k} people?"
    question = f"{' '.join(facts)} {question_tail} Answer with a name."
    gold = ranking[position]
    wrong = [name for name in ranking if name != gold]
    rng.shuffle(wrong)
    return _Draft(question, [gold], {"sim": {"distractors": wrong[:5]}})


# ---------------------------------------------------------------------------- recall
_SYLLABLES = ("ba", "dor", "ka", "lin", "mar", "nev", "ro", "sel", "tam", "vor", "zen", "ar",
              "el", "ith", "qua", "bri", "del", "fen", "gal", "hol", "ost", "pra", "ul", "wyn")
_SUFFIX = {"country": ("ia", "or", "and", "ova", "estan"),
           "city": ("ton", "burg", "mora", "heim", "port", "grad"),
           "river": ("a", "en", "is", "ar", "o"),
           "person": ("", "", "o", "a", "en")}
_INSTRUMENTS = ("cello", "oboe", "harp", "viola", "bassoon", "flute", "clarinet",
                "harpsichord", "lute", "trumpet", "organ", "violin")


def _fictional_name(rng: random.Random, kind: str, used: set[str]) -> str:
    while True:
        stem = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
        name = (stem + rng.choice(_SUFFIX[kind])).capitalize()
        if kind == "person":
            name = f"{name} {(''.join(rng.choice(_SYLLABLES) for _ in range(2))).capitalize()}"
        if name not in used:
            used.add(name)
            return name


def _gen_recall(rng: random.Random, level: str, used: set[str]) -> _Draft:
    relation = rng.randrange(4)
    fresh: set[str] = set(used)  # distractor names must not collide with real entities
    if relation == 0:
        country, city = _fictional_name(rng, "country", used), _fictional_name(rng, "city", used)
        question = f"What is the capital city of the country {country}?"
        gold, wrong = [city], [_fictional_name(rng, "city", fresh) for _ in range(4)]
    elif relation == 1:
        city, year = _fictional_name(rng, "city", used), rng.randint(1100, 1950)
        question = f"In which year was the town of {city} founded?"
        gold = [str(year)]
        wrong = [str(year + d) for d in rng.sample([-100, -50, -12, -1, 1, 12, 50, 100], 4)]
    elif relation == 2:
        city, river = _fictional_name(rng, "city", used), _fictional_name(rng, "river", used)
        question = f"Which river flows through the city of {city}?"
        gold = [f"{river} River", river]
        wrong = [f"{_fictional_name(rng, 'river', fresh)} River" for _ in range(4)]
    else:
        person = _fictional_name(rng, "person", used)
        instrument = rng.choice(_INSTRUMENTS)
        question = f"Which instrument did the composer {person} play?"
        gold = [instrument]
        wrong = rng.sample([i for i in _INSTRUMENTS if i != instrument], 4)
    return _Draft(question, gold, {"sim": {"distractors": wrong}})


def synthetic_tasks(n: int, *, seed: int,
                    domains: Sequence[Domain | str] = tuple(Domain),
                    levels: Sequence[str] = LEVELS) -> list[Record]:
    """`n` deterministic synthetic questions (a SIMULATION data set) in the `Record` format.

    Task i has domain `domains[i % len(domains)]` and difficulty
    `levels[(i // len(domains)) % len(levels)]` (balanced; `levels` a subset of `LEVELS`,
    a level listed twice is drawn twice as often), `sample_id` `sim-<seed>-<i>`, the real
    scorer named in `SIM_SCORERS` (math: integer gold; apps_functional: call-based tests +
    `func_name`; mc_letter: a letter A-J; bbeh_mini: a name; triviaqa: aliases of a fact
    from a generated fictional fact table), `meta['difficulty']`, and simulator-only data
    in `meta['sim']` (distractors; the correct and the buggy program for CODE). Question texts
    are unique. `batch_index` and `forced_mode` are left None for the pipeline to assign.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"synthetic_tasks: n must be a non-negative integer, got {n!r}")
    try:
        chosen = [Domain(d.upper() if isinstance(d, str) else d) for d in domains]
    except ValueError as exc:
        raise ValueError(f"synthetic_tasks: unknown domain in {list(domains)!r}: {exc}") from None
    if not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"synthetic_tasks: domains must be non-empty and distinct, "
                         f"got {list(domains)!r}")
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"synthetic_tasks: levels must be non-empty, from {LEVELS}; "
                         f"got {list(levels)!r}")
    used_names: set[str] = set()
    seen: set[str] = set()
    records = []
    for i in range(n):
        domain = chosen[i % len(chosen)]
        level = levels[(i // len(chosen)) % len(levels)]
        rng = random.Random(f"routeweaver-sim:{seed}:{i}")
        for _attempt in range(100):
            if domain is Domain.MATH:
                draft = _gen_math(rng, level)
            elif domain is Domain.CODE:
                draft = _gen_code(rng, level)
            elif domain is Domain.KNOWLEDGE:
                draft = _gen_knowledge(rng, level)
            elif domain is Domain.REASON:
                draft = _gen_reason(rng, level)
            else:
                draft = _gen_recall(rng, level, used_names)
            if normalize_ws(draft.question) not in seen:
                break
        else:
            raise ValueError(f"synthetic_tasks: ran out of distinct {domain.value}/{level} "
                             f"questions at task {i}; ask for fewer tasks")
        seen.add(normalize_ws(draft.question))
        records.append(Record(
            sample_id=f"sim-{seed}-{i:05d}", domain=domain, dataset=f"sim_{domain.lower()}",
            scorer_dataset=SIM_SCORERS[domain], question=draft.question,
            gold=tuple(draft.gold), meta={"difficulty": level, **draft.meta}, pool=SIM_POOL,
            data_source=SIM_DATA_SOURCE))
    return records
