"""Synthetic prompts from a seeded generator, so that a run is repeatable: token ids for
the offline API, common English words for a server (whose tokenizer the client does not
have; a word is about one token in the BPE vocabularies of the models served here)."""

from __future__ import annotations

import random

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are "
    "but were which one all she there been their has would when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may "
    "then first any like now my such over our man even most made after also did many before "
    "must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three small house water word number "
    "part place sound light hand city tree river story song road music table paper money "
    "field group system night morning garden window market school letter doctor teacher "
    "family friend animal mountain island summer winter village street ocean forest bridge "
    "engine report question answer reason moment history nature weather picture country"
)
WORDS = tuple(_WORDS.split())


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]
