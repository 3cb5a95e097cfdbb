"""Synthetic, seeded training data for the trained tiny Inkling (tools/train_tiny_inkling.py): the tasks
the page's gates ask of a served model, in the served chat template and Inkling's output markup, never
with a gate's own prompt (`gate_prompts()`; tests/test_tiny_tasks.py checks a large sample).

Each example is a chat (messages, the tools offered) and the assistant's target text, which carries the
markup the `inkling_py` parsers read:
- needles: filler prose (varied, or one sentence repeated) with secret codes for random names at random depths, then questions for some of
  them (one per user turn), answered `<|content_text|>CODE<|end_message|>`;
- additions of two numbers below 100: the sum, after a column-by-column reasoning block;
- tool calls when tools are offered: `<|message_model|><|content_invoke_tool_json|>{"name": .., "args": ..}
  <|end_message|>`, the tool and its argument taken from the question;
- JSON objects when asked: the bare object (what a JSON-mode grammar lets through from the first token);
- a reasoning block before the answer when asked to think (is n prime?): `<|content_thinking|>..<|end_message|>` then
  the answer's text block.
Digits tokenize one by one (the tokenizer's pre-tokenizer), so codes and sums are copied digit by digit.
"""
from __future__ import annotations

import json
import random

END = "<|end_message|>"
TEXT = "<|content_text|>"
THINK = "<|content_thinking|>"
TOOL_CALL = "<|message_model|><|content_invoke_tool_json|>"

# The gates' own fixed prompts and names (tests/hpu/gates.py): training never shows them.
GATE_NEEDLE_NAMES = ("Aldebaran", "Bellatrix", "Capella", "Deneb", "Electra", "Fomalhaut")
GATE_FILLER = ("The committee reviewed the quarterly figures, noted the weather in the northern valley, "
               "and moved on to the next item on a long and uneventful agenda. ")


def gate_prompts() -> list[str]:
    """The gates' fixed prompts, with each needle question the gates can ask."""
    fixed = ["What is 17 + 25? Answer with the number only.", "Give a JSON object with keys a=1 and b=2.",
             "What is the weather in Paris?", "Name three prime numbers above 100, briefly.",
             "Think, then answer: is 221 prime?", "What time is it in UTC? Use the tool.", GATE_FILLER]
    return fixed + [f"What is the secret code of {name}?" for name in GATE_NEEDLE_NAMES]


SYLLABLES = ("ka", "lo", "mi", "ra", "ten", "vo", "sel", "dar", "ni", "phe", "us", "or", "bri", "que", "an",
             "zel", "to", "ri", "mar", "gon", "il", "sa", "the", "ver", "cu", "lix", "po", "en", "dro", "fa")
SUBJECTS = ("The old miller", "A quiet river", "The council", "Every traveller", "The green valley", "A small boat",
            "The library", "Her brother", "The morning train", "A careful clerk", "The northern road", "The market")
VERBS = ("crossed", "watched", "described", "carried", "remembered", "painted", "measured", "followed", "counted",
         "ignored", "repaired", "visited", "discussed", "checked", "opened", "listed", "studied", "passed")
OBJECTS = ("the long bridge", "a field of barley", "the harbour lights", "three wooden chairs", "the winter garden",
           "an empty square", "the distant hills", "a box of letters", "the stone tower", "the evening clouds",
           "a row of lamps", "the narrow stairs", "the yearly accounts", "the rainfall in the eastern hills",
           "the last point of a short meeting", "the old records of the port")
TAILS = ("before noon", "without a word", "in the rain", "once again", "for many years", "with some care",
         "after the fair", "near the coast", "as usual", "at dawn")
TOPICS = ("weather", "time", "price", "population", "temperature", "score", "news", "traffic", "forecast",
          "exchange rate", "elevation", "timezone")
ARG_NAMES = ("city", "zone", "place", "location", "region", "symbol", "team", "code")
PLACES = ("Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Madrid", "Dublin", "Seoul", "Nairobi",
          "Perth", "Vienna", "Austin", "UTC", "CET", "EST", "PST", "Rome", "Lagos", "Hanoi", "Delhi")
KEYS = tuple("abcdefghxyz") + ("name", "count", "id", "size", "color", "ok")


def random_name(rng: random.Random) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()
        if name not in GATE_NEEDLE_NAMES:
            return name


# Made-up lowercase words: a real document's rarer words, which a small tokenizer cuts into pieces (the
# gates' filler tokenizes so). Built from other pieces than the names' syllables, but they share letters.
ONSETS = ("b", "c", "d", "f", "g", "h", "m", "n", "p", "r", "s", "t", "w", "st", "tr", "pl", "gr", "ch", "sh", "sp")
VOWELS = ("a", "e", "i", "o", "u", "ea", "ou", "ai", "ee", "oi")
CODAS = ("", "n", "r", "t", "s", "nd", "st", "ck", "ll", "m", "ng", "ful", "ment", "ly", "ing", "ed", "ure", "ive")


# Numbers that are not codes: sentence tails (a year, a count, six-digit order numbers) and document heads
# (ids in hex or digits, as the gates' own `fresh_head()` puts one first).
NUMBER_TAIL_SHARE = 0.2
NUMBER_TAILS = (lambda rng: f"in {rng.randint(1700, 2030)}", lambda rng: f"for {rng.randint(2, 90)} days",
                lambda rng: f"at number {rng.randint(1, 999)}", lambda rng: f"under order {code(rng)}",
                lambda rng: f"with {rng.randint(10, 9999)} others")
MONTHS = ("January", "March", "May", "July", "September", "November")
HEADS = (lambda rng: f"Document {hex_id(rng)}. ", lambda rng: f"Report {rng.randrange(10**8)}. ",
         lambda rng: f"File {hex_id(rng)}-{rng.randint(1, 99)}. ", lambda rng: f"Record {code(rng)} of the archive. ",
         lambda rng: f"Minutes, {rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(1900, 2030)}. ")
HEAD_SHARE = 0.6


def hex_id(rng: random.Random) -> str:
    # a draw of 12 hex digits, zero-padded to a width of 6 to 16: the committed model's data (the width pads
    # only the 16-digit ids and the rare small draws)
    return f"{rng.randrange(16 ** 12):0{rng.choice((6, 8, 12, 16))}x}"


def head(rng: random.Random) -> str:
    """A needle document's first line: an id or a date in HEAD_SHARE of the documents, else nothing."""
    return rng.choice(HEADS)(rng) if rng.random() < HEAD_SHARE else ""


def rare_word(rng: random.Random) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.choice((1, 1, 2, 2, 3))))


def sentence(rng: random.Random, rare: float = 0.0) -> str:
    """A filler sentence: a short one (subject, verb, object, tail), or a long one of two to four clauses
    joined by commas and "and", as long-context probes' filler sentences often are. Each word after the
    first and before the tail is a made-up one with probability `rare`; one tail in NUMBER_TAIL_SHARE holds a
    number (a year, a count, an order of six digits), so that a code is found by its name, not by being the
    only digits in the document."""
    if rng.random() < 0.4:
        text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    else:
        clauses = [f"{rng.choice(VERBS)} {rng.choice(OBJECTS)}" for _ in range(rng.randint(2, 4))]
        text = f"{rng.choice(SUBJECTS)} {', '.join(clauses[:-1])}, and {clauses[-1]}"
    first, *rest = text.split(" ")
    words = [rare_word(rng) + ("," if word.endswith(",") else "") if rng.random() < rare else word for word in rest]
    tail = rng.choice(NUMBER_TAILS)(rng) if rng.random() < NUMBER_TAIL_SHARE else rng.choice(TAILS)
    return " ".join([first, *words, tail]) + ". "


# Shares of made-up words in a needle document's filler, one drawn per document.
RARE_WORD_SHARES = (0.0, 0.25, 0.5)


def filler(rng: random.Random, sentences: int, repeated: bool) -> list[str]:
    """A needle document's filler: varied sentences, or one sentence repeated; in a third of the documents a
    quarter of the words are made up, in another third half of them."""
    rare = rng.choice(RARE_WORD_SHARES)
    return [sentence(rng, rare)] * sentences if repeated else [sentence(rng, rare) for _ in range(sentences)]


def needle_sentence(name: str, secret: str) -> str:
    return f"The secret code of {name} is {secret}. "


def code(rng: random.Random) -> str:
    return f"{rng.randrange(10**6):06d}"


def answer(text: str) -> str:
    return f"{TEXT}{text}{END}"


# --- tasks: each returns (messages, tools, targets): one target per assistant turn ----------------------
def needles(rng: random.Random, filler_sentences: int) -> tuple[list[dict], list, list[str]]:
    """A document (after its head, if any) with 1-4 secret codes at random depths, then a question for each
    (in random order). Half of the documents repeat one sentence, as long-context probes often do."""
    body = filler(rng, filler_sentences, repeated=rng.random() < 0.5)
    names = []
    while len(names) < rng.randint(1, 4):
        name = random_name(rng)
        if name not in (n for n, _ in names):
            names.append((name, code(rng)))
    for name, secret in names:
        body.insert(rng.randint(0, len(body)), needle_sentence(name, secret))
    body.insert(0, head(rng))
    rng.shuffle(names)
    asks = ["What is the secret code of {}? Answer with the six digits only.",
            "What is the secret code of {}?", "Give the secret code of {}. Six digits only."]
    messages, targets = [], []
    for i, (name, secret) in enumerate(names):
        question = rng.choice(asks).format(name)
        messages.append({"role": "user", "content": ("".join(body) + "\n\n" if i == 0 else "") + question})
        messages.append({"role": "assistant", "content": None})
        targets.append(answer(secret))
    return messages, [], targets


def column_sum(a: int, b: int) -> tuple[str, str]:
    """The reasoning for a + b, column by column (units, then tens with the carry), and the sum: a model this
    small copies digits well but cannot carry in one step."""
    units, tens = a % 10 + b % 10, a // 10 + b // 10 + (a % 10 + b % 10) // 10
    carry = " + 1" if units >= 10 else ""
    reasoning = f"{a % 10} + {b % 10} = {units}. {a // 10} + {b // 10}{carry} = {tens}."
    return reasoning, str(a + b)


def addition(rng: random.Random):
    """a + b, the sum after a short column-by-column reasoning block (Inkling thinks unless told not to)."""
    a, b = rng.randrange(100), rng.randrange(100)
    ask = rng.choice(["What is {} + {}? Answer with the number only.", "What is {} + {}?", "Add {} and {}.",
                      "Think, then answer: what is {} + {}?", "Think first: add {} and {}."]).format(a, b)
    reasoning, total = column_sum(a, b)
    return [{"role": "user", "content": ask}], [], [f"{THINK}{reasoning}{END}{answer(total)}"]


def tool_call(rng: random.Random):
    offered = rng.sample(TOPICS, rng.randint(1, 3))
    tools = [{"type": "function", "function": {
        "name": "get_" + topic.replace(" ", "_"), "description": f"The {topic} for a place",
        "parameters": {"type": "object", "properties": {rng.choice(ARG_NAMES): {"type": "string"}}}}}
        for topic in offered]
    pick = rng.randrange(len(offered))
    function = tools[pick]["function"]
    arg = next(iter(function["parameters"]["properties"]))
    place = rng.choice(PLACES)
    ask = rng.choice(["What is the {} in {}?", "What is the {} in {}? Use the tool.", "Find the {} for {}.",
                      "Tell me the {} in {}.", "Look up the {} of {}.", "Which {} does {} have? Use the tool.",
                      "I need the {} for {}, please.", "Use the tool: the {} in {}.",
                      "What {} is it in {}?", "What {} is it in {}? Use the tool."]).format(offered[pick], place)
    call = json.dumps({"name": function["name"], "args": {arg: place}})
    return [{"role": "user", "content": ask}], tools, [f"{TOOL_CALL}{call}{END}"]


def json_object(rng: random.Random):
    keys = rng.sample(KEYS, rng.randint(1, 3))
    values = {k: rng.randrange(10) for k in keys}
    listed = " and ".join(f"{k}={v}" for k, v in values.items()) if len(keys) < 3 else \
        ", ".join(f"{k}={v}" for k, v in list(values.items())[:-1]) + f" and {keys[-1]}={values[keys[-1]]}"
    ask = rng.choice(["Give a JSON object with keys {}.", "Write a JSON object with keys {}.",
                      "Return JSON with keys {}."]).format(listed)
    return [{"role": "user", "content": ask}], [], [json.dumps(values)]


def divisor(n: int) -> int | None:
    return next((d for d in range(2, int(n ** 0.5) + 1) if n % d == 0), None)


def thinking(rng: random.Random):
    n = rng.randrange(11, 400)
    d = divisor(n)
    reasoning = (f"I check the divisors of {n} up to its square root. " +
                 (f"{n} = {d} x {n // d}, so it is not prime." if d else f"None divides {n}, so it is prime."))
    reply = ("No" if d else "Yes") + f", {n} is {'not ' if d else ''}prime."
    ask = rng.choice(["Think, then answer: is {} prime?", "Think first: is {} a prime number?",
                      "Is {} prime? Think it through."]).format(n)
    return [{"role": "user", "content": ask}], [], [f"{THINK}{reasoning}{END}{answer(reply)}"]


SHORT_TASKS = {"addition": addition, "tool call": tool_call, "JSON": json_object, "thinking": thinking}
SHORT_TASK_WEIGHTS = {"addition": 4, "tool call": 3, "JSON": 1, "thinking": 1}   # how often each is drawn


def short_example(rng: random.Random):
    name = rng.choices(list(SHORT_TASK_WEIGHTS), weights=list(SHORT_TASK_WEIGHTS.values()))[0]
    return name, SHORT_TASKS[name](rng)


def free_of_gate_prompts(messages: list[dict]) -> bool:
    text = "\n".join(m["content"] or "" for m in messages)
    return not any(prompt in text for prompt in gate_prompts())


def tokenizer_corpus(seed: int = 0, examples: int = 3000) -> list[str]:
    """Text the tokenizer's merges are learned from: the training tasks' own prompts and answers."""
    rng = random.Random(seed)
    texts = []
    for _ in range(examples):
        messages, tools, targets = needles(rng, 4) if rng.random() < 0.3 else short_example(rng)[1]
        texts += [m["content"] for m in messages if m["content"]] + targets + [json.dumps(tools)]
    return texts
