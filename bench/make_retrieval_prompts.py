#!/usr/bin/env python3
"""Generates the long-range retrieval prompts (TinyStories
style, for the bundled models' 512-token context) with a fixed seed.

Each prompt introduces a fact early (a name, an object, a colour, a place
or a number), then tells >= 250 tokens of unrelated story text that never
repeats it, then ends on a cue whose continuation must state the fact.
Output: JSON lines with the text split into `before` (story up to the fact),
`fact` (the fact's words as they appear in the intro), `after` (the rest of
the prompt, ending with the cue), `answer` (what the continuation must
start with), `kind` and `template`.

    /usr/bin/python3 bench/make_retrieval_prompts.py \
        --out bench/data/retrieval_prompts_stories260K.jsonl
    /usr/bin/python3 bench/make_retrieval_prompts.py --min_words 220 \
        --max_words 260 --out bench/data/retrieval_prompts_tinystories-656K.jsonl
"""

import argparse
import json
import random

NAMES_F = ["Lily", "Sue", "Anna", "Mia", "Lucy", "Amy", "Kate", "Zoe", "Emma",
           "Sara", "Molly", "Jane", "Mary", "Ellie", "Rose"]
NAMES_M = ["Tom", "Tim", "Ben", "Max", "Sam", "Jack", "Leo", "Bob", "Jake",
           "Joe", "Timmy", "Billy", "Mark", "Fred", "Spot"]
COLOURS = ["red", "blue", "green", "yellow", "pink", "purple", "orange",
           "white", "black", "brown"]
OBJECTS = ["ball", "doll", "kite", "teddy bear", "toy car", "book", "hat",
           "balloon", "boat", "drum", "train", "blanket"]
PLACES = ["park", "beach", "forest", "zoo", "farm", "lake", "garden",
          "store", "castle", "river"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten"]
ANIMALS = ["cats", "dogs", "fish", "birds", "bunnies", "ducks"]

# Neutral story sentences: no names, colours, objects, places or numbers of
# the lists above ({P} = pronoun, {p} = lower case, {poss} = possessive).
FILLER = [
    "The sun was bright and warm.",
    "{P} saw a big tree with many leaves.",
    "A little bird sang a happy song.",
    "{P} walked slowly and looked around.",
    "The wind blew softly through the grass.",
    "{P} smiled because the day was so nice.",
    "Some clouds moved across the sky.",
    "{P} found a shiny stone on the ground and picked it up.",
    "A butterfly flew past {poss} nose.",
    "{P} laughed and jumped up and down.",
    "{P} was a little hungry, so {p} ate an apple.",
    "The apple was sweet and juicy.",
    "Then {p} drank some cold water.",
    "{P} heard a funny noise and turned around.",
    "It was only a small squirrel.",
    "The squirrel ran up the tree very fast.",
    "{P} waved at the squirrel, but it did not wave back.",
    "{P} sat down to rest for a while.",
    "The flowers smelled very good.",
    "A bee buzzed near the flowers.",
    "{P} was careful not to touch the bee.",
    "{P} sang a little song to {poss}self.",
    "Soon {p} felt happy and calm.",
    "{P} saw an old man walking with a cane.",
    "The old man said hello and smiled.",
    "{P} said hello back and kept walking.",
    "There was a puddle on the path.",
    "{P} jumped over the puddle.",
    "{P} did not want to get wet.",
    "{P} looked at the sky and thought about many things.",
    "{P} thought about cookies and cake.",
    "{P} thought about a big, soft bed.",
    "A frog hopped out from under a leaf.",
    "The frog said ribbit and hopped away.",
    "{P} giggled at the silly frog.",
    "The day was long and full of fun.",
    "{P} helped a little ant carry a crumb.",
    "The ant was very strong for its size.",
    "{P} was proud of the little ant.",
    "Then it started to get a bit cold.",
    "{P} rubbed {poss} hands to keep warm.",
    "{P} kept walking and looking at everything.",
]


def pronouns(female):
    return ({"P": "She", "p": "she", "poss": "her", "Poss": "Her"} if female
            else {"P": "He", "p": "he", "poss": "his", "Poss": "His"})


def filler(rng, pr, words):
    out, count = [], 0
    pool = list(FILLER)
    rng.shuffle(pool)
    i = 0
    while count < words:
        s = pool[i % len(pool)]
        i += 1
        if i % len(pool) == 0:
            rng.shuffle(pool)
        s = s.format(**pr).replace("hisself", "himself")
        out.append(s)
        count += len(s.split())
    return " ".join(out)


def make(rng, kind, words):
    """One prompt. Template 0 of each kind ends on the words that preceded
    the fact in the intro (copying, the easy case for small models);
    template 1 asks for the fact in other words."""
    female = rng.random() < 0.5
    name = rng.choice(NAMES_F if female else NAMES_M)
    pr = pronouns(female)
    child = "girl" if female else "boy"
    P, p, poss = pr["P"], pr["p"], pr["poss"]
    t = rng.randrange(2)
    if kind == "name":
        fact = answer = name
        if t == 0:
            before = f"Once upon a time, there was a little {child} named "
            rest = f". {name} loved to play outside. "
            cue = f"Everyone in the town knew the little {child} named"
        else:
            before = f"Once upon a time, there was a {child}. {pr['Poss']} name was "
            rest = ". "
            cue = (f'A new friend asked, "What is your name?" The {child} '
                   f'smiled and said, "My name is')
    elif kind == "object":
        fact = answer = rng.choice(OBJECTS)
        if t == 0:
            before = f"Once upon a time, {name} loved {poss} new "
            rest = ". "
            cue = f"At the end of the day, {name} still loved {poss} new"
        else:
            before = f"Once upon a time, {name} got a "
            rest = f" for {poss} birthday. "
            cue = f"When {name} got home, {p} played with {poss} new"
    elif kind == "colour":
        fact = answer = rng.choice(COLOURS)
        if t == 0:
            before = f"Once upon a time, {name} wore a "
            rest = " hat. "
            cue = f"The next day, {name} wore a"
        else:
            before = f"Once upon a time, {name} had a "
            rest = f" ball. {P} played with it every day. "
            cue = f"{name} went to get {poss} ball. The ball was"
    elif kind == "place":
        fact = answer = rng.choice(PLACES)
        if t == 0:
            before = f"Once upon a time, {name} and {poss} mom went to the "
            rest = ". "
            cue = f"The next day, {name} and {poss} mom went to the"
        else:
            before = f"One day, {name} went for a walk to the "
            rest = ". "
            cue = f"{name} had so much fun at the"
    else:  # number
        fact = answer = rng.choice(NUMBERS)
        animal = rng.choice(ANIMALS)
        before = f"Once upon a time, {name} had "
        rest = f" {animal}. "
        cue = (f"In the evening, {name} counted {poss} {animal}. {P} had"
               if t == 0 else f"Everyone knew that {name} had")
    after = rest + filler(rng, pr, words) + " " + cue
    return {"kind": kind, "template": f"{kind}{t}", "before": before,
            "fact": fact, "after": after, "answer": answer}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=600)
    ap.add_argument("--seed", type=int, default=16)
    # Filler words between the fact and the cue: the bundled tokenizers
    # take ~2.6 (stories260K, 512 pieces) and ~1.2 (tinystories-656K)
    # tokens per word; both ranges give >= 250 tokens within 512.
    ap.add_argument("--min_words", type=int, default=100)
    ap.add_argument("--max_words", type=int, default=125)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    kinds = ["name", "object", "colour", "place", "number"]
    with open(a.out, "w") as f:
        for i in range(a.count):
            words = rng.randint(a.min_words, a.max_words)
            f.write(json.dumps(make(rng, kinds[i % len(kinds)], words)) + "\n")


if __name__ == "__main__":
    main()
