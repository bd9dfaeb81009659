"""Speculative decoding: proposers of draft tokens (`ngram.py`: prompt lookup) and the
verification rule that keeps the target's distribution (`rejection.py`). The engine's
scheduler already schedules a request's drafts after its last token and takes back
1 .. k + 1 accepted tokens (`Scheduler.update`); nothing here touches it.
"""
