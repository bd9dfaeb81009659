"""Speculative decoding: proposers of draft tokens (`drafter.py`: n-gram prompt lookup;
`model_drafter.py`: the model's own first layers, `early_exit.py`, or a draft model,
`draft_model.py`) and the verification rule that keeps the target's distribution
(`rejection.py`, `sampling.py`). The engine's scheduler already schedules a request's
drafts after its last token and takes back 1 .. k + 1 accepted tokens
(`Scheduler.update`); nothing here touches it.
"""
