"""A step's host-side inputs (`ModelRunner.prepare`), hand-computed: the one-token decode
steps' column-by-column form and the general form give the same inputs."""

from __future__ import annotations

import dataclasses

from infer.engine.model_runner import ModelRunner
from infer.engine.scheduler import ScheduledRequest, SchedulerOutput

TABLES = {"a": [3], "b": [7, 8], "c": [1, 2, 4], "d": [9]}
DECODES = (ScheduledRequest("a", 5, 1, True, None),  # launched ahead: its id on the device
           ScheduledRequest("b", 9, 1, True, (42,)))


def prepare(*items: ScheduledRequest) -> dict:
    # prepare reads only the plan and the tables
    return dataclasses.asdict(ModelRunner.prepare(None, SchedulerOutput(items), TABLES))


def test_a_step_of_decodes():
    assert prepare(*DECODES) == dict(
        input_ids=[42], positions=[5, 9], query_lens=[1, 1], seq_lens=[6, 10],
        block_tables=[[3], [7, 8]], sample_rows=[0, 1], sample_request_ids=["a", "b"],
        sample_counts=[1, 1])


def test_decodes_beside_a_prefill_chunk_and_a_verify_row():
    chunk = ScheduledRequest("c", 16, 3, False, (1, 2, 3))  # a chunk that does not sample
    verify = ScheduledRequest("d", 4, 3, True, (5, 6, 7), (6, 7))  # two drafts
    assert prepare(*DECODES, chunk, verify) == dict(
        input_ids=[42, 1, 2, 3, 5, 6, 7], positions=[5, 9, 16, 17, 18, 4, 5, 6],
        query_lens=[1, 1, 3, 3], seq_lens=[6, 10, 19, 7],
        block_tables=[[3], [7, 8], [1, 2, 4], [9]], sample_rows=[0, 1, 5, 6, 7],
        sample_request_ids=["a", "b", "d"], sample_counts=[1, 1, 3])
    decodes_alone = prepare(*DECODES)
    mixed = prepare(*DECODES, chunk)  # the general form, decodes first
    assert {k: v[:2] for k, v in mixed.items() if k != "input_ids"} == \
        {k: v[:2] for k, v in decodes_alone.items() if k != "input_ids"}
