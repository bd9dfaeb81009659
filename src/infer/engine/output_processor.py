"""The output side: engine-core sequence outputs -> detokenized text, stop strings,
logprob entries -> one RequestOutput per request (group of n sequences) that changed.

Each request asks for one kind of output (`SamplingParams.output_kind`): CUMULATIVE (all
text and tokens so far, every step), DELTA (only what is new since the last output, and
only the sequences that changed: per step work in proportion to the new tokens) or
FINAL_ONLY (one output, once every sequence has finished).

Token stops (EOS, stop ids, length) are the scheduler's; stop strings need the text, so
they are found here, and the sequences they end are handed back for the core to finish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from infer.engine.detokenizer import IncrementalDetokenizer, NoText
from infer.engine.engine_core import SequenceOutput
from infer.engine.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from infer.engine.prompt_logprobs import PromptLogprobs
from infer.loader.tokenizer import Tokenizer
from infer.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    seq_id: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | NoText
    # No text wanted before the end and no stop strings: decoded once, at the end.
    text_at_end: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent: int = 0  # tokens (and logprob entries) given out in DELTA outputs
    changed: bool = False


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    kind: RequestOutputKind
    arrival_time: float
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    num_finished: int = 0  # sequences with a finish_reason
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # in a DELTA output

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.sequences)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # Sequences the core still runs that must end now: (seq id, reason, stop reason).
    to_finish: list[tuple[str, str, str | None]]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self._of_seq: dict[str, tuple[_Group, _Sequence]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_failed = 0  # charged with a failure of their own (`error` set)

    def stats(self) -> dict[str, int]:
        return {"prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "num_requests_failed": self.num_requests_failed}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            seq_ids: list[str], params: list[SamplingParams], arrival_time: float) -> None:
        self.prompt_tokens_total += len(prompt_token_ids)
        kind = params[0].output_kind
        group = _Group(request_id, prompt, prompt_token_ids, [], kind, arrival_time)
        for i, (seq_id, p) in enumerate(zip(seq_ids, params)):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           p.skip_special_tokens, p.stop,
                                           p.include_stop_str_in_output) \
                if p.detokenize else NoText()
            seq = _Sequence(seq_id, i, p, detok,
                            kind is RequestOutputKind.FINAL_ONLY and not p.stop,
                            logprobs=[] if p.logprobs is not None else None)
            group.sequences.append(seq)
            self._of_seq[seq_id] = (group, seq)
        self.groups[request_id] = group

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences the core may still run."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return []
        for seq in group.sequences:
            self._of_seq.pop(seq.seq_id, None)
        return [s.seq_id for s in group.sequences if s.finish_reason is None]

    def process(self, updates: list[SequenceOutput], now: float) -> ProcessedOutputs:
        touched: dict[str, _Group] = {}
        to_finish: list[tuple[str, str, str | None]] = []
        for update in updates:
            found = self._of_seq.get(update.seq_id)
            if found is None:
                continue  # its request was aborted
            group, seq = found
            if seq.finish_reason is not None:
                continue  # ended here by a stop string; the core had not heard yet
            self.generation_tokens_total += len(update.new_token_ids)
            if group.first_token_time is None:  # the group is here because a token came
                group.first_token_time = now
            if update.error is not None:
                for token in update.new_token_ids:  # a quiet sequence's last tokens
                    seq.token_ids.append(token)
                    seq.detok.append(token)
                group.error = update.error
                touched[group.request_id] = group
                continue
            try:
                if update.prompt_logprobs is not None:
                    group.prompt_logprobs = self._prompt_entries(group.prompt_token_ids,
                                                                 update.prompt_logprobs)
                self._apply(seq, update, to_finish)
                group.num_finished += seq.finish_reason is not None
                if seq.index == 0:
                    group.num_cached_tokens = update.num_cached_tokens
            except Exception as exc:
                log.exception("request %s failed while its output was built", group.request_id)
                group.error = f"{type(exc).__name__}: {exc}"
            if (seq.finish_reason is not None or group.error is not None
                    or group.kind is not RequestOutputKind.FINAL_ONLY):
                touched[group.request_id] = group  # FINAL_ONLY: nothing to say until the end
        outputs = []
        for group in touched.values():
            output = None
            if group.error is None:
                try:
                    output = self._output(group, now)
                except Exception as exc:
                    log.exception("request %s failed while its output was built",
                                  group.request_id)
                    group.error = f"{type(exc).__name__}: {exc}"
            if group.error is not None:
                output = self._failed(group, now)
                to_finish += [(seq_id, "error", None) for seq_id in self.remove(group.request_id)]
            if output is not None:
                outputs.append(output)
                self.num_requests_failed += output.error is not None
                if output.finished:
                    self.remove(group.request_id)
        return ProcessedOutputs(outputs, to_finish)

    def _apply(self, seq: _Sequence, update: SequenceOutput,
               to_finish: list[tuple[str, str, str | None]]) -> None:
        for i, token in enumerate(update.new_token_ids):
            seq.token_ids.append(token)
            seq.changed = True
            if seq.logprobs is not None:  # then the core sent the numbers
                lp = update.logprobs[i]
                seq.cumulative_logprob += lp
                seq.logprobs.append(self._logprob_entry(
                    token, lp, update.ranks[i], update.top_logprobs[i],
                    seq.params.detokenize))
            if seq.text_at_end:
                seq.detok.append(token)
                continue
            stop = seq.detok.push(token, check_stop=len(seq.token_ids) >= seq.params.min_tokens)
            if stop is not None and update.finish_reason in (None, "length"):
                # A stop string ends the sequence here (before the length limit would).
                seq.finish_reason, seq.stop_reason = "stop", stop
                if update.finish_reason is None:
                    to_finish.append((seq.seq_id, "stop", stop))
                return
        if update.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = update.finish_reason, update.stop_reason

    def _logprob_entry(self, token: int, lp: float, rank: int,
                       top: tuple[list[int], list[float]] | None,
                       detokenize: bool = True) -> TokenLogprobs:
        """The token's entry first, then the top ones (by rank; a tie with the token
        keeps the token's own rank)."""
        def decode(tid: int) -> str | None:
            return self.tokenizer.decode([tid], False) if detokenize else None

        entry = {token: Logprob(lp, rank, decode(token))}
        if top is not None:
            for top_rank, (tid, tlp) in enumerate(zip(*top), 1):
                if tid != token:
                    entry[tid] = Logprob(tlp, top_rank, decode(tid))
        return entry

    def _prompt_entries(self, prompt_token_ids: list[int], found: PromptLogprobs
                        ) -> list[TokenLogprobs | None]:
        tops = found.top or [None] * len(found.logprobs)
        return [None, *(self._logprob_entry(token, lp, rank, top)
                        for token, lp, rank, top in zip(prompt_token_ids[1:], found.logprobs,
                                                        found.ranks, tops))]

    def _output(self, group: _Group, now: float) -> RequestOutput | None:
        finished = group.finished
        if group.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for seq in group.sequences:
            done = seq.finish_reason is not None
            if group.kind is RequestOutputKind.DELTA and not seq.changed and not done:
                continue
            if done:
                seq.detok.flush()
            delta = seq.detok.new_text(done)
            if group.kind is RequestOutputKind.DELTA:
                if not seq.changed:
                    continue
                start, seq.num_sent = seq.num_sent, len(seq.token_ids)
                completions.append(CompletionOutput(
                    seq.index, delta, seq.token_ids[start:], self._cumulative(seq),
                    None if seq.logprobs is None else seq.logprobs[start:],
                    seq.finish_reason, seq.stop_reason))
            else:
                completions.append(CompletionOutput(
                    seq.index, seq.detok.returned_text, list(seq.token_ids),
                    self._cumulative(seq), seq.logprobs, seq.finish_reason, seq.stop_reason))
            seq.changed = False
        if not completions:
            return None
        prompt_logprobs = group.prompt_logprobs
        if group.kind is RequestOutputKind.DELTA and prompt_logprobs is not None:
            prompt_logprobs = None if group.prompt_logprobs_sent else prompt_logprobs
            group.prompt_logprobs_sent = True
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             completions, finished, group.num_cached_tokens,
                             self._metrics(group, now, finished),
                             prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _cumulative(seq: _Sequence) -> float | None:
        return seq.cumulative_logprob if seq.logprobs is not None else None

    @staticmethod
    def _metrics(group: _Group, now: float, finished: bool) -> RequestMetrics:
        return RequestMetrics(group.arrival_time, group.first_token_time, now,
                              now if finished else None)

    def _failed(self, group: _Group, now: float) -> RequestOutput:
        """The final output of a request that failed alone: what it had returned so far,
        finish_reason "error"."""
        completions = [CompletionOutput(s.index, s.detok.returned_text, list(s.token_ids),
                                        finish_reason="error")
                       for s in group.sequences]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             completions, True, group.num_cached_tokens,
                             self._metrics(group, now, True), error=group.error)
