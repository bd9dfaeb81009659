"""EngineCore: the scheduler, the model runner and the sampler, one step at a time.

It deals in sequences (scheduler requests) and token ids only: no tokenizer, no text, no
request groups. Each step returns a `SequenceOutput` per sequence that changed: the tokens
it kept, their logprob numbers, and why it finished if it did. Inputs are checked before
they get here (`InputProcessor`); text, stop strings and outputs are the output
processor's.

With async scheduling the next step (decodes, prefill chunks, admissions) is launched on
the device (`_launch_ahead`, planned by `Scheduler.schedule_ahead`) before this step's
tokens are read back and accounted, so the GPU never waits for the host's bookkeeping.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from infer.cache.kv_manager import KVCacheManager
from infer.config import ModelConfig
from infer.distributed.group import SINGLE, TensorParallelGroup
from infer.distributed.mirrored_runner import MirroredRunner
from infer.distributed.workers import TensorParallelError, Workers
from infer.engine.config import EngineConfig
from infer.engine.grammar_admission import GrammarAdmission
from infer.engine.grammar_process import GrammarWorkerError, RemoteMatcher
from infer.engine.model_runner import ModelRunner, StepInputs
from infer.engine.prompt_logprobs import (
    PromptLogprobs,
    PromptLogprobsJob,
    PromptLogprobsState,
    launch_prompt_logprobs,
)
from infer.engine.request import Request
from infer.engine.runner_setup import (
    build_runner,
    capture_graphs,
    set_layer_kernels,
    uses_graphs,
)
from infer.engine.sampler import SamplingBatch, sample, warm_up_sampler
from infer.engine.scheduler import Scheduler, SchedulerOutput
from infer.engine.structured_output import GrammarMatcher, StructuredOutputs
from infer.loader.tokenizer import Tokenizer
from infer.sampling_params import RequestOutputKind, SamplingParams
from infer.spec.drafter import Drafter, NgramDrafter
from infer.spec.early_exit import EarlyExit
from infer.spec.model_drafter import ModelDrafter
from infer.spec.rejection import Verified
from infer.spec.sampling import verified_logprobs, verify_drafts
from infer.transfer import HostCopy, to_device

log = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step failed for a reason no single sequence explains (e.g. the forward); the
    sequences it had scheduled (`seq_ids`) are finished and their blocks freed."""

    def __init__(self, cause: Exception, seq_ids: list[str]) -> None:
        super().__init__(f"engine step failed: {cause!r}")
        self.seq_ids = seq_ids
        # The engine cannot go on (a tensor-parallel rank died): nothing will step again.
        self.fatal = isinstance(cause, TensorParallelError)


class SequenceOutput(NamedTuple):
    """What one step did to one sequence (a tuple: one is built per sequence per step)."""

    seq_id: str
    new_token_ids: list[int]
    # Per new token, when the sequence asked for logprobs: the token's raw logprob, and
    # the (ids, logprobs) of the `logprobs` most likely tokens.
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the step failed for this sequence alone
    ranks: list[int] | None = None  # with logprobs: each new token's rank (1 = most likely)
    # With prompt_logprobs, on the sequence's first token: the prompt's logprobs
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class _Sequence:
    request: Request
    params: SamplingParams
    # structured output: where it stands (in the grammar worker: `grammar_process`)
    grammar: GrammarMatcher | RemoteMatcher | None = None
    # `params.reads_output`, asked of every sequence every step: taken once
    reads_output: bool = field(init=False)
    # Whose output side reads its tokens only at the end (one final output, no stop
    # strings, no logprobs): its outputs are sent on its first token (time to first token,
    # prompt tokens cached) and when it ends, carrying every token not sent yet; a step
    # between builds no output for it.
    quiet: bool = field(init=False)
    sent: int = 0  # output tokens sent (a quiet sequence's)

    def __post_init__(self) -> None:
        params = self.params
        self.reads_output = params.reads_output
        self.quiet = (params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop
                      and params.logprobs is None and params.prompt_logprobs is None)

    def unsent(self) -> list[int]:
        """A quiet sequence's tokens not sent yet, now counted as sent."""
        tokens = self.request.output_token_ids[self.sent:]
        self.sent += len(tokens)
        return tokens


# A draft still on the device, in `Request.spec_token_ids` (its value is in
# `EngineCore._device_drafts`; the host never reads it).
DEVICE_DRAFT = -1


@dataclass
class _StepInFlight:
    """A launched step not yet accounted: the scheduler and sequences do not show it."""

    out: SchedulerOutput
    # The requests it was launched for: an id may be finished and reused by a new request
    # before the step is accounted, and that one must not receive this step's tokens.
    requests: dict[str, Request]
    seq_ids: list[str]  # the sequences that sample, in row order
    token_ids: torch.Tensor | None  # [rows] sampled ids on the device
    results: HostCopy | None  # token ids, logprobs, top logprobs on their way to the host
    # (row, matcher) of the rows sampled under a grammar mask, whose tokens their matchers
    # take (a sequence finished since only leaves its matcher unread)
    masked: list[tuple[int, GrammarMatcher | RemoteMatcher]] = field(default_factory=list)
    grammars_advanced: bool = False  # its tokens were fed to the sequences' grammars
    grammar_step: int = 0  # its number in the grammar worker, when that masked it
    grammar_failure: str | None = None  # the worker failed it: its masked rows are void
    # Sequences whose drafts the step judged, and their verdicts on the way to the host
    # (token ids [S, K + 1], how many of each row count [S]).
    spec_ids: list[str] = field(default_factory=list)
    verified: HostCopy | None = None  # (+ raw logprobs, top ids, top logprobs, or Nones)
    # (index in spec_ids, matcher) of the rows judged under grammar masks
    spec_grammars: list[tuple[int, GrammarMatcher]] = field(default_factory=list)
    prompt_job: PromptLogprobsJob | None = None  # prompt logprobs it computed
    verdict: Verified | None = None  # `verified`, on the device
    # The proposal round queued behind it (`speculative_round_ahead`): by sequence, its
    # request and its drafts for the step after, on the device.
    ahead: dict[str, tuple[Request, torch.Tensor]] = field(default_factory=dict)


def _constrained(seqs: list[_Sequence]
                 ) -> list[tuple[int, GrammarMatcher | RemoteMatcher]]:
    """(row, matcher) of the sequences whose grammar still allows tokens (a finished
    grammar's row is left unmasked: its token is discarded with the sequence)."""
    return [(row, seq.grammar) for row, seq in enumerate(seqs)
            if seq.grammar is not None and not seq.grammar.terminated]


_READS_OUTPUT = operator.attrgetter("reads_output")  # (any(map(...)): the scan in C)


def _same_rows_again(batch: SamplingBatch, min_rows: list[int], seqs: list[_Sequence],
                     pending: Collection[str]) -> SamplingBatch | None:
    """`batch` (built for the same rows, `seqs`) for this step: its seeded rows at their
    new positions; None if a row of `min_rows` still bans its stop tokens (then the batch
    is built anew)."""
    for row in min_rows:
        seq = seqs[row]
        request = seq.request
        if len(request.output_token_ids) + (request.request_id in pending) < seq.params.min_tokens:
            return None
    if not batch.seeded_rows:
        return batch
    positions = [len((request := seqs[row].request).output_token_ids)
                 + (request.request_id in pending) for row, _, _ in batch.seeded_rows]
    return batch.at_seeded_positions(positions)


class EngineCore:
    def __init__(self, config: EngineConfig, model: nn.Module, model_config: ModelConfig,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 eos_token_ids: tuple[int, ...], tokenizer: Tokenizer | None = None,
                 draft: tuple[nn.Module, ModelConfig] | None = None,
                 tp: TensorParallelGroup = SINGLE, workers: Workers | None = None) -> None:
        """`draft`: the draft model and its config (speculative_method='draft'). `tp`: this
        rank's group (rank 0: the core runs here), `workers`: the other ranks' processes
        when this one started them."""
        self.config = config
        self.tokenizer = tokenizer  # for structured output's grammars only; never decodes
        # Drafts proposed on the device, by sequence (`DEVICE_DRAFT`s in their requests),
        # until the sequence samples again or ends.
        self._device_drafts: dict[str, torch.Tensor] = {}
        self.model_config = mc = model_config
        self.device, self.dtype = device, dtype
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.quantization = "none"  # the format in effect (load_core sets it)
        self.tp, self.workers = tp, workers
        runner = build_runner(config, model, mc, device, dtype, max_model_len,
                              draft[1] if draft else None, tp)
        self.attention_backend, self.kernel_backend = runner.attention_backend, \
            runner.kernel_backend
        self.block_size, num_blocks = runner.block_size, runner.num_blocks
        self.kv_cache_dtype = str(runner.kv_pool.dtype).removeprefix("torch.")
        self.kv = KVCacheManager(num_blocks, self.block_size, config.prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens,
            batching=config.batching_mode, chunked_prefill=config.chunked_prefill,
            max_prefill_chunk=config.prefill_chunk_size,
        )
        self.runner = runner
        self.graph_capture_seconds = 0.0
        self.graphs_on = uses_graphs(config, device, self.attention_backend)
        self.drafter = self._make_drafter(draft, num_blocks)
        if self.graphs_on:
            self.graph_capture_seconds += capture_graphs(runner, config, max_model_len,
                                                         verify=self.drafter is not None)
        warm_up_sampler(model_config.vocab_size, device)
        if tp.size > 1:
            # Every call that runs the model goes to the other ranks first (workers).
            self.runner = MirroredRunner(runner, tp, workers)
            workers.before_leaving = runner.release_graphs
        self.sequences: dict[str, _Sequence] = {}
        # Sequences whose prompt logprobs are not all out yet (`prompt_logprobs.py`).
        self._prompt_lp: dict[str, PromptLogprobsState] = {}
        # Constrained sequences waiting for their grammars; the thread that builds a core
        # steps it.
        self.grammars = GrammarAdmission(config, tokenizer, model_config.vocab_size, device,
                                         self.scheduler.max_num_seqs,
                                         threading.get_native_id())
        self._in_flight: _StepInFlight | None = None
        # The last sampling batch that only its rows' params decide, those rows, and the
        # rows among them with a min_tokens (whose bans may still apply)
        self._last_batch: tuple[list[_Sequence], SamplingBatch, list[int]] | None = None
        self.num_steps = 0
        self.num_steps_launched_ahead = 0
        self.num_discarded_tokens = 0  # sampled for a sequence that stopped or was aborted
        self.num_draft_tokens = 0  # drafts judged
        self.num_accepted_tokens = 0  # and accepted
        self.num_verified_rows = 0  # sequence-steps that had drafts judged
        # [i]: drafts judged / accepted at draft position i (0: the first after the token)
        self.drafts_at = [0] * config.num_speculative_tokens
        self.accepted_at = [0] * config.num_speculative_tokens
        # Called once a step is scheduled, before it runs (a server refreshes its gauges:
        # a long step would otherwise show the state from before it).
        self.on_step_start: Callable[[], None] | None = None

    def _make_drafter(self, draft: tuple[nn.Module, ModelConfig] | None, num_blocks: int
                      ) -> Drafter | None:
        config, method = self.config, self.config.speculative_method
        k = config.num_speculative_tokens
        if method == "none":
            return None
        if method == "ngram":
            return NgramDrafter(k, config.ngram_min, config.ngram_max, self.max_model_len)
        if method == "self":
            layers = config.self_draft_layers or max(1, self.model_config.num_layers // 2)
            runner = ModelRunner(EarlyExit(self.runner.model, layers), self.model_config,
                                 num_blocks, self.block_size, self.device, self.dtype,
                                 self.attention_backend, self.kernel_backend,
                                 shares_cache_of=self.runner)
            proposing = config.speculative_max_batch
            log.info("speculative decoding: self-drafts from the first %d of %d layers",
                     layers, self.model_config.num_layers)
        else:
            if draft is None:
                raise ValueError("speculative_method='draft' needs the draft model loaded")
            set_layer_kernels(draft[0], config, self.kernel_backend)
            runner = ModelRunner(draft[0], draft[1], num_blocks, self.block_size, self.device,
                                 self.runner.kv_pool.dtype, self.attention_backend,
                                 self.kernel_backend)
            # It runs every step the model runs (its cache follows), at any batch size.
            proposing = config.max_num_seqs
        drafter = ModelDrafter(runner, self.kv, k, self.max_model_len,
                               own_cache=method == "draft")
        if self.graphs_on:
            self.graph_capture_seconds += drafter.enable_graphs(
                min(proposing, config.max_num_seqs), self.max_model_len,
                logits=config.logits_in_graphs,
                ahead_batch=config.speculative_max_batch if config.speculative_round_ahead
                else 0, split_keys=config.verify_decode_attention)
            if method == "draft" and config.mixed_step_graphs != "off":
                pieces = runner.enable_piecewise_graphs(config.max_num_batched_tokens)
                self.graph_capture_seconds += pieces.capture_seconds
        return drafter

    # -- sequences -------------------------------------------------------------------
    def add(self, request: Request, params: SamplingParams) -> None:
        """Schedule a sequence. A constrained one first waits, off the step loop, for its
        grammar and matcher (`grammar_admission.py`, `_admit_compiled`); a bad constraint
        ends it with an `error` output."""
        if params.structured_outputs is not None:
            self.grammars.submit(request, params)
        else:
            self._schedule(request, params, None)

    def _schedule(self, request: Request, params: SamplingParams,
                  grammar: GrammarMatcher | None) -> None:
        if not params.ignore_eos:
            request.eos_token_ids = frozenset(self.eos_token_ids)
        request.stop_token_ids = frozenset(params.stop_token_ids)
        request.min_tokens = params.min_tokens
        if params.prompt_logprobs is not None:
            self._prompt_lp[request.request_id] = PromptLogprobsState(
                params.prompt_logprobs, len(request.prompt_token_ids))
            request.skip_prefix_cache = True
        self.scheduler.add(request)
        self.sequences[request.request_id] = _Sequence(request, params, grammar)

    def _admit_compiled(self) -> list[SequenceOutput]:
        """Schedule the sequences whose matchers are ready; `error` outputs for those whose
        constraint failed (`GrammarAdmission.admit`)."""
        ready, failed = self.grammars.admit()
        for request, params, matcher in ready:
            self._schedule(request, params, matcher)
        return [SequenceOutput(seq_id, [], finish_reason="error", error=error)
                for seq_id, error in failed]

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar library bound to this model's vocabulary."""
        return self.grammars.library()

    def warm_structured_outputs(self) -> threading.Thread | None:
        """The grammar library made in a thread (`GrammarAdmission.warm`)."""
        return self.grammars.warm()

    def finish(self, seq_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence now (a stop string, an abort), freeing its blocks."""
        seq = self.sequences.pop(seq_id, None)
        self._prompt_lp.pop(seq_id, None)
        self._device_drafts.pop(seq_id, None)
        if seq is not None:
            self.scheduler.finish(seq.request, reason, stop_reason)
            self.grammars.drop([seq.grammar])
        self.grammars.forget(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.sequences or self.grammars.waiting)

    def unfinished_ids(self) -> list[str]:
        """Every sequence not finished: scheduled, or waiting for its grammar."""
        return [*self.sequences, *self.grammars.waiting]

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[SequenceOutput]:
        """Run one step; an output for every sequence that changed.

        A failure is charged to the sequence that caused it whenever that can be told: it
        is finished (its blocks freed) with an `error` output, and the rest of the step goes
        on. Host-side preparation that fails is re-run one sequence at a time to find the
        culprit; then nothing of the step has been accounted, so the others are simply
        scheduled again. A failure that no single sequence explains (e.g. the model forward)
        finishes every sequence the step had scheduled, freeing their blocks, and raises
        StepFailed naming them; sequences outside the step keep going.
        """
        if self.grammars.waiting:
            failed = self._admit_compiled()
            if failed:
                return failed
        step, self._in_flight = self._in_flight, None
        out = step.out if step is not None else self.scheduler.schedule()
        if out.empty:
            if self.grammars.waiting:  # nothing to run until a grammar is ready
                self.grammars.wait_for_one()
            return []
        if self.on_step_start is not None:
            self.on_step_start()
        try:
            if step is None:
                try:
                    step = self._launch(out, self.runner.prepare(out, self.kv.tables))
                except Exception as exc:
                    return self._fail_launch(out, exc)
            self._in_flight = self._try_launch_ahead(step)
            return self._finish(step)
        except BaseException as exc:
            failed = self._abort_scheduled(out)
            if self._in_flight is not None:
                failed += self._abort_scheduled(self._in_flight.out)
                self._in_flight = None
            if isinstance(exc, Exception):
                raise StepFailed(exc, failed) from exc
            raise

    def _abort_scheduled(self, out: SchedulerOutput) -> list[str]:
        aborted = [i.request_id for i in out.scheduled if i.request_id in self.sequences]
        for seq_id in aborted:
            self.finish(seq_id, "abort")
        return aborted

    def _fail_launch(self, out: SchedulerOutput, exc: Exception) -> list[SequenceOutput]:
        culprits = self._culprits(out)
        if not culprits:
            raise exc
        log.warning("step preparation failed (%r); failing %d sequence(s): %s", exc,
                    len(culprits), ", ".join(culprits))
        return self._end_with_error(culprits, f"{type(exc).__name__}: {exc}")

    def _end_with_error(self, seq_ids: list[str], error: str) -> list[SequenceOutput]:
        """Finish these sequences (their blocks freed); an `error` output for each, with a
        quiet sequence's tokens not sent yet."""
        outputs = []
        for seq_id in seq_ids:
            seq = self.sequences.get(seq_id)
            tokens = seq.unsent() if seq is not None and seq.quiet else []
            self.finish(seq_id, "error")
            outputs.append(SequenceOutput(seq_id, tokens, finish_reason="error", error=error))
        return outputs

    def _culprits(self, out: SchedulerOutput) -> list[str]:
        """The sequences whose host-side step preparation fails when run on its own."""
        culprits = []
        for item in out.scheduled:
            seq = self.sequences.get(item.request_id)
            if seq is None:
                continue
            try:
                inputs = self.runner.prepare(SchedulerOutput((item,)), self.kv.tables)
                if inputs.sample_request_ids:
                    self._sampling_batch([seq])
            except Exception:
                culprits.append(item.request_id)
        return culprits

    def _launch(self, out: SchedulerOutput, inputs: StepInputs,
                device_input_ids: torch.Tensor | None = None,
                prev: _StepInFlight | None = None) -> _StepInFlight:
        """Queue the step's forward and sampling on the device; nothing waits for them,
        except constrained rows of a step launched ahead of `prev`: their masks need
        prev's tokens, which are read (and fed to the grammars) while this forward runs."""
        seqs = [self.sequences[rid] for rid in inputs.sample_request_ids]
        requests = {i.request_id: self.sequences[i.request_id].request for i in out.scheduled}
        mirror_ids, device_drafts = device_input_ids, {}
        if device_input_ids is None and self._device_drafts:
            device_input_ids, device_drafts = self._ids_with_device_drafts(out, inputs)
        hidden = self.runner.forward(inputs, device_input_ids)
        logits = self.runner.sample_logits(hidden, inputs)
        prompt_job = None
        if self._prompt_lp:
            prompts = {i.request_id: self.sequences[i.request_id].request.prompt_token_ids
                       for i in out.scheduled if i.request_id in self._prompt_lp}
            prompt_job = launch_prompt_logprobs(self.runner, hidden, out.scheduled,
                                                self._prompt_lp, prompts)
        if self.drafter is not None:
            self.drafter.mirror(out, requests, mirror_ids)
        self.num_steps += 1
        if prev is not None:
            self.num_steps_launched_ahead += 1
        step = self._sample(out, requests, inputs, logits, seqs, prev, device_drafts)
        step.prompt_job = prompt_job
        if len(device_drafts) == len(out.scheduled) and self.config.speculative_round_ahead:
            self._propose_ahead(step, device_input_ids)
        return step

    def _propose_ahead(self, step: _StepInFlight, ids: torch.Tensor) -> None:
        """Queue the next proposal round behind a step verifying device drafts, before its
        verdict is read (`ModelDrafter.propose_ahead`): when every sequence of the step
        verifies k drafts and the batch is still one that drafts."""
        k = self.config.num_speculative_tokens
        if (step.seq_ids or len(self.sequences) > self.config.speculative_max_batch
                or any(len(item.spec_token_ids) != k for item in step.out.scheduled)):
            return
        requests = [step.requests[rid] for rid in step.spec_ids]
        drafts = self.drafter.propose_ahead(requests, ids.view(len(requests), k + 1),
                                            step.verdict)
        if drafts is not None:
            step.ahead = {r.request_id: (r, row) for r, row in zip(requests, drafts)}

    def _ids_with_device_drafts(self, out: SchedulerOutput, inputs: StepInputs
                                ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The step's input ids on the device, its drafts still there written in: (None,
        {}) when it verifies no device drafts; else the ids and the drafts it took, by
        sequence (each cut to the drafts the step computes)."""
        at, offset, taken = [], 0, {}
        for item in out.scheduled:
            drafts = item.spec_token_ids
            offset += item.num_new_tokens
            if drafts and drafts[0] == DEVICE_DRAFT:
                device = self._device_drafts.get(item.request_id)
                if device is None:
                    raise RuntimeError(f"sequence {item.request_id}: its drafts on the "
                                       "device are gone")
                taken[item.request_id] = device[:len(drafts)]
                at.extend(range(offset - len(drafts), offset))
        if not taken:
            return None, {}
        ids = to_device(torch.tensor(inputs.input_ids, dtype=torch.long), self.device)
        ids[to_device(torch.tensor(at), self.device)] = torch.cat(list(taken.values()))
        return ids, taken

    def _sample(self, out: SchedulerOutput, requests: dict[str, Request], inputs: StepInputs,
                logits: torch.Tensor, seqs: list[_Sequence], prev: _StepInFlight | None,
                device_drafts: dict[str, torch.Tensor]) -> _StepInFlight:
        if not seqs:
            return _StepInFlight(out, requests, [], None, None)
        if max(inputs.sample_counts) > 1:  # (seqs: at least one count)
            return self._launch_verify(out, requests, inputs, logits, device_drafts)
        masked, masks, grammar_step, failure = [], None, 0, None
        if any(seq.grammar is not None for seq in seqs):
            if self.grammars.process is None:
                if prev is not None:
                    self._advance_grammars(prev)
                if masked := _constrained(seqs):
                    masks = self.structured_outputs().sampler_masks(len(seqs), masked,
                                                                    logits.device)
            elif masked := _constrained(seqs):
                try:
                    grammar_step, masks = self.grammars.process.masks(len(seqs), masked)
                except GrammarWorkerError as exc:  # the rows go unmasked, and fail
                    failure = str(exc)
        pending = {item.request_id for item in out.scheduled if item.token_ids is None}
        result = sample(logits, self._sampling_batch(seqs, pending), masks)
        if grammar_step:
            try:
                self.grammars.process.publish(grammar_step, result.token_ids)
            except GrammarWorkerError as exc:
                failure = str(exc)
        results = HostCopy(result.token_ids, result.logprobs, result.ranks,
                           result.top_logprob_ids, result.top_logprobs)
        return _StepInFlight(out, requests, inputs.sample_request_ids, result.token_ids, results,
                             masked, grammar_step=grammar_step, grammar_failure=failure)

    def _launch_verify(self, out: SchedulerOutput, requests: dict[str, Request],
                       inputs: StepInputs, logits: torch.Tensor,
                       device_drafts: dict[str, torch.Tensor]) -> _StepInFlight:
        """Sampling of a step with drafts: the sequences with drafts have them judged
        (`spec.sampling`), the others sample as usual. Grammars mask every row, a drafted
        position by the state after the drafts before it (drafts a grammar refuses were
        cut when proposed). Never launched ahead: drafts are proposed from the tokens
        accounted."""
        plain_rows, plain_ids, spec_rows, spec_ids, counts = [], [], [], [], []
        row = 0
        for rid, count in zip(inputs.sample_request_ids, inputs.sample_counts):
            if count == 1:
                plain_rows.append(row)
                plain_ids.append(rid)
            else:
                spec_rows.extend(range(row, row + count))
                spec_ids.append(rid)
                counts.append(count)
            row += count
        drafts = {i.request_id: list(i.spec_token_ids) for i in out.scheduled}
        seqs = [self.sequences[rid] for rid in spec_ids]
        plain = [self.sequences[rid] for rid in plain_ids]
        if any(seq.grammar is not None for seq in (*seqs, *plain)):
            self._mask_verify(logits, inputs, drafts)
        spec_drafts = [drafts[rid] for rid in spec_ids]  # DEVICE_DRAFT: in device_drafts
        batch = self._sampling_batch(
            [seq for seq, c in zip(seqs, counts) for _ in range(c)],
            drafted=[d[:j] for d, c in zip(spec_drafts, counts) for j in range(c)])
        spec_logits = (logits if spec_rows == list(range(len(logits)))
                       else logits[to_device(torch.tensor(spec_rows), logits.device)])
        verified = verify_drafts(
            spec_logits, batch, counts, spec_drafts, [seq.params.greedy for seq in seqs],
            [seq.params.seed for seq in seqs],
            [len(seq.request.output_token_ids) for seq in seqs],
            [device_drafts.get(rid) for rid in spec_ids] if device_drafts else None)
        lp = None
        if any(seq.params.logprobs is not None for seq in seqs):
            lp = verified_logprobs(spec_logits, counts, verified.token_ids,
                                   max(seq.params.logprobs or 0 for seq in seqs))
        step = _StepInFlight(out, requests, plain_ids, None, None, spec_ids=spec_ids,
                             verified=HostCopy(verified.token_ids, verified.num_tokens,
                                               *(lp or (None, None, None, None))),
                             verdict=verified)
        step.spec_grammars = _constrained(seqs)
        if plain_ids:
            plain_logits = logits[to_device(torch.tensor(plain_rows), logits.device)]
            step.masked = _constrained(plain)
            result = sample(plain_logits, self._sampling_batch(plain))
            step.token_ids = result.token_ids
            step.results = HostCopy(result.token_ids, result.logprobs, result.ranks,
                                    result.top_logprob_ids, result.top_logprobs)
        return step

    def _mask_verify(self, logits: torch.Tensor, inputs: StepInputs,
                     drafts: dict[str, list[int]]) -> None:
        """Grammar masks on a verify step's rows: a sequence's first row by its grammar's
        state, the row of its j-th draft by the state after its first j drafts."""
        entries, rows, row = [], [], 0
        for rid, count in zip(inputs.sample_request_ids, inputs.sample_counts):
            grammar = self.sequences[rid].grammar
            if grammar is not None and not grammar.terminated:
                entries.append((row, grammar, drafts[rid] if count > 1 else []))
                rows.extend(range(row, row + count))
            row += count
        if not entries:
            return
        structured = self.structured_outputs()
        masks = structured.step_masks(row)
        structured.fill_masks_with_drafts(entries, masks)
        with torch.inference_mode():
            structured.apply_masks(logits, masks, rows)

    def _try_launch_ahead(self, prev: _StepInFlight) -> _StepInFlight | None:
        """A launch ahead that fails is dropped: nothing of it was accounted, and the next
        step prepares the same work again the ordinary way, where a failure is charged."""
        try:
            return self._launch_ahead(prev)
        except Exception as exc:
            log.debug("launch ahead failed (%r); planning the next step after this one", exc)
            return None

    def _launch_ahead(self, prev: _StepInFlight) -> _StepInFlight | None:
        """Launch the step after `prev` before prev's tokens reach the host, when the
        scheduler can plan it now and no sequence's sampling depends on prev's token
        values (penalties, bad words). None: the next step is planned once prev is accounted."""
        if not self.config.async_scheduling:
            return None
        if self.drafter is not None and len(self.sequences) <= self.config.speculative_max_batch:
            return None  # drafts come from prev's tokens: the next step waits for them
        if any(map(_READS_OUTPUT, self.sequences.values())):
            return None
        plan = self.scheduler.schedule_ahead(prev.out)
        if plan is None:
            return None
        inputs = self.runner.prepare(plan, self.kv.tables)
        # The plan's first rows decode the tokens prev sampled, still on the device; the
        # other rows' ids are on the host.
        decoding = [item.request_id for item in plan.scheduled if item.token_ids is None]
        if not decoding:
            return self._launch(plan, inputs, prev=prev)
        ids = prev.token_ids
        if decoding != prev.seq_ids:  # not prev's rows in prev's order: gather them
            row_of = {seq_id: row for row, seq_id in enumerate(prev.seq_ids)}
            rows = [row_of[seq_id] for seq_id in decoding]
            ids = ids[to_device(torch.tensor(rows), self.device)]
        if inputs.input_ids:
            ids = torch.cat([ids, to_device(torch.tensor(inputs.input_ids, dtype=ids.dtype),
                                            self.device)])
        return self._launch(plan, inputs, ids, prev=prev)

    def _finish(self, step: _StepInFlight) -> list[SequenceOutput]:
        """Wait for the step's tokens and account them."""
        outputs = self._advance_grammars(step)  # errors of sequences the grammar worker failed
        sequences = self.sequences
        live = {rid for rid, request in step.requests.items()
                if rid in sequences and sequences[rid].request is request}
        if step.prompt_job is not None:
            step.prompt_job.deliver({rid: state for rid, state in self._prompt_lp.items()
                                     if rid in live})
        sampled: dict[str, list[int]] = {}
        rows: dict[str, int] = {}  # a sequence's row, where the step computed logprobs
        chosen_lp = ranks = top_ids = top_lps = None
        if step.seq_ids:
            token_ids, chosen_lp, ranks, top_ids, top_lps = (
                None if t is None else t.tolist() for t in step.results.wait())
            sampled = {seq_id: [token] for seq_id, token in zip(step.seq_ids, token_ids)
                       if seq_id in live}
            self.num_discarded_tokens += len(step.seq_ids) - len(sampled)
            if chosen_lp is not None:
                rows = {seq_id: row for row, seq_id in enumerate(step.seq_ids)}
        spec_lp: dict[str, tuple[list[float], list[int], list]] = {}
        if step.spec_ids:
            spec_tokens, spec_counts, chosen, s_ranks, s_ids, s_lps = (
                None if t is None else t.tolist() for t in step.verified.wait())
            for i, matcher in step.spec_grammars:
                if not matcher.accept_all(spec_tokens[i][:spec_counts[i]]):
                    raise RuntimeError(f"sequence {step.spec_ids[i]}: verified tokens "
                                       f"{spec_tokens[i][:spec_counts[i]]} are not allowed "
                                       "by its grammar")
                if matcher.terminated:  # the step's update ends it ("stop")
                    for seq in self._live(step, [step.spec_ids[i]]):
                        seq.request.updates_at_end_only = False
            drafted = {i.request_id: len(i.spec_token_ids) for i in step.out.scheduled}
            for i, (seq_id, tokens, count) in enumerate(
                    zip(step.spec_ids, spec_tokens, spec_counts)):
                self._count_verdict(drafted[seq_id], count - 1)
                if self.drafter.own_cache and count - 1 == drafted[seq_id]:
                    step.requests[seq_id].draft_behind = True
                if seq_id not in live:
                    self.num_discarded_tokens += count
                    continue
                sampled[seq_id] = tokens[:count]
                k = self.sequences[seq_id].params.logprobs
                if k is not None:
                    spec_lp[seq_id] = (chosen[i][:count], s_ranks[i][:count], [
                        (s_ids[i][j][:k], s_lps[i][j][:k]) if k else None
                        for j in range(count)])
        out = step.out
        if len(live) < len(out.scheduled):
            out = SchedulerOutput(tuple(i for i in out.scheduled if i.request_id in live))
        prompt_lp = self._prompt_lp
        for update in self.scheduler.update(out, sampled):
            rid = update.request_id
            seq = sequences[rid]
            if (seq.grammar is not None and update.finish_reason is None
                    and seq.grammar.terminated):  # the grammar allows nothing more
                self.scheduler.finish(seq.request, "stop")
                update = update._replace(finish_reason="stop")
            if seq.quiet:
                if seq.sent and update.finish_reason is None:
                    continue
                update = update._replace(new_token_ids=seq.unsent())
                # Its next update that matters is its last (a grammar that a token finishes
                # asks for that token's: `_advance_grammars`)
                seq.request.updates_at_end_only = True
            if seq.params.logprobs is None:
                output = SequenceOutput(rid, update.new_token_ids, None, None,
                                        update.finish_reason, update.stop_reason,
                                        seq.request.num_cached_tokens)
            elif rid in spec_lp:
                n = len(update.new_token_ids)  # the verified tokens up to a stop
                lps, token_ranks, tops = spec_lp[rid]
                output = SequenceOutput(rid, update.new_token_ids, lps[:n], tops[:n],
                                        update.finish_reason, update.stop_reason,
                                        seq.request.num_cached_tokens, ranks=token_ranks[:n])
            else:  # then the batch computed chosen_lp
                row, k = rows[rid], seq.params.logprobs
                top = (top_ids[row][:k], top_lps[row][:k]) if top_ids is not None and k else None
                output = SequenceOutput(rid, update.new_token_ids, [chosen_lp[row]], [top],
                                        update.finish_reason, update.stop_reason,
                                        seq.request.num_cached_tokens, ranks=[ranks[row]])
            state = prompt_lp.get(rid) if prompt_lp else None
            if state is not None and state.complete:
                output = output._replace(prompt_logprobs=state.result())
                del self._prompt_lp[rid]
                seq.request.skip_prefix_cache = False
            outputs.append(output)
            if update.finish_reason is not None:
                del self.sequences[rid]
                self._prompt_lp.pop(rid, None)
                self._device_drafts.pop(rid, None)
                self.grammars.drop([seq.grammar])
        if self.drafter is not None:
            self._propose(sampled, step.ahead)
        return outputs

    def _count_verdict(self, drafted: int, accepted: int) -> None:
        self.num_verified_rows += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(drafted):
            self.drafts_at[i] += 1
            self.accepted_at[i] += i < accepted

    def _propose(self, seq_ids: Collection[str],
                 ahead: dict[str, tuple[Request, torch.Tensor]]) -> None:
        """Drafts for the next step of the sequences that just sampled: none in batches
        above speculative_max_batch, none while a step launched ahead is in flight (they
        would be for a position it computes), drafts a grammar refuses cut off; those of
        the round queued `ahead` where it made them."""
        seqs = [seq for seq_id in seq_ids if (seq := self.sequences.get(seq_id)) is not None]
        for seq in seqs:
            seq.request.spec_token_ids = []
            self._device_drafts.pop(seq.request.request_id, None)
        if (not seqs or len(self.sequences) > self.config.speculative_max_batch
                or self._in_flight is not None):
            return
        if ahead:
            seqs = [seq for seq in seqs if not self._take_ahead(seq.request, ahead)]
            if not seqs:
                return
        requests = [seq.request for seq in seqs]
        if (self.drafter.on_device and self.config.speculative_drafts_on_device
                and not any(seq.grammar is not None or seq.reads_output for seq in seqs)):
            # Their values matter only on the device: the round is queued, not waited for.
            for request, drafts in zip(requests, self.drafter.propose_on_device(requests)):
                if drafts is not None:
                    request.spec_token_ids = [DEVICE_DRAFT] * len(drafts)
                    self._device_drafts[request.request_id] = drafts
            return
        for seq, drafts in zip(seqs, self.drafter.propose(requests)):
            if seq.grammar is not None and drafts:
                drafts = drafts[:seq.grammar.allowed_prefix(drafts)]
            seq.request.spec_token_ids = drafts

    def _take_ahead(self, request: Request,
                    ahead: dict[str, tuple[Request, torch.Tensor]]) -> bool:
        """Give `request` its drafts from the round queued ahead, if that round made some."""
        made = ahead.get(request.request_id)
        if made is None or made[0] is not request:
            return False
        request.spec_token_ids = [DEVICE_DRAFT] * len(made[1])
        self._device_drafts[request.request_id] = made[1]
        request.draft_behind = False  # the round's first forward took the token before
        return True

    def _advance_grammars(self, step: _StepInFlight) -> list[SequenceOutput]:
        """Feed the step's sampled tokens to their sequences' grammars, once (the grammar
        worker has fed them: its verdicts are read). Should the worker fail, every
        constrained sequence ends with an error output (returned); the others go on."""
        if step.grammars_advanced or not step.masked:
            return []
        step.grammars_advanced = True
        token_ids = step.results.wait()[0]  # sampled: the worker's verdicts follow
        failed = []
        if self.grammars.process is None:
            token_ids = token_ids.tolist()
            refused = [row for row, matcher in step.masked if not matcher.accept(token_ids[row])]
            stopped = [row for row, matcher in step.masked if matcher.terminated]
        else:
            try:
                if step.grammar_failure is not None:
                    raise GrammarWorkerError(step.grammar_failure)
                verdicts = self.grammars.process.verdicts(step.grammar_step, step.masked)
            except GrammarWorkerError as exc:
                return self._fail_constrained(f"{type(exc).__name__}: {exc}")
            refused, failed, stopped = verdicts.refused, verdicts.failed, verdicts.stopped
        if refused:  # masked sampling only picks allowed tokens: a refusal is a bug
            row = refused[0]
            raise RuntimeError(f"sequence {step.seq_ids[row]}: sampled token "
                               f"{int(token_ids[row])} is not allowed by its grammar")
        for seq in self._live(step, [step.seq_ids[row] for row in stopped]):
            seq.request.updates_at_end_only = False  # the step's update ends it ("stop")
        error = "ValueError: structured_outputs: the grammar library could not start on it"
        ended = [step.seq_ids[row] for row in failed]
        return self._end_with_error([seq.request.request_id for seq in self._live(step, ended)],
                                    error)

    def _live(self, step: _StepInFlight, seq_ids: list[str]) -> list[_Sequence]:
        """The sequences of these ids that are still those `step` ran."""
        live = []
        for seq_id in seq_ids:
            seq = self.sequences.get(seq_id)
            if seq is not None and seq.request is step.requests[seq_id]:
                live.append(seq)
        return live

    def _fail_constrained(self, error: str) -> list[SequenceOutput]:
        """End every sequence whose matcher the grammar worker holds (it failed)."""
        log.error("structured output's grammar worker failed (%s): ending its sequences",
                  error)
        failed = [rid for rid, seq in self.sequences.items()
                  if isinstance(seq.grammar, RemoteMatcher)]
        return self._end_with_error(failed, error)

    def _sampling_batch(self, seqs: list[_Sequence], pending: Collection[str] = (),
                        drafted: list[list[int]] | None = None) -> SamplingBatch:
        """`pending`: the sequences with a sampled token not in their output yet (the step
        in flight samples one for each); `drafted[i]`: the drafts before row i's position
        (a verify step's row samples after them: they count for its penalties)."""
        last = self._last_batch
        if (last is not None and not drafted and len(last[0]) == len(seqs)
                and all(map(operator.is_, last[0], seqs))):  # the same rows as before
            batch = _same_rows_again(last[1], last[2], seqs, pending)
            if batch is not None:
                return batch
        outputs = [seq.request.output_token_ids for seq in seqs]
        if drafted:
            outputs = [out + extra if extra else out for out, extra in zip(outputs, drafted)]
        positions = [len(out) + (seq.request.request_id in pending)
                     for out, seq in zip(outputs, seqs)]
        banned = [[*self.eos_token_ids, *seq.params.stop_token_ids]
                  if n_out < seq.params.min_tokens else [] for n_out, seq in zip(positions, seqs)]
        batch = SamplingBatch.build(
            [s.params for s in seqs], [s.request.prompt_token_ids for s in seqs], outputs,
            vocab_size=self.model_config.vocab_size, device=self.device, banned=banned,
            positions=positions,
        )
        self._last_batch = None
        if batch.reusable and not drafted:  # (reusable: nothing banned)
            min_rows = [row for row, seq in enumerate(seqs) if seq.params.min_tokens]
            self._last_batch = (seqs, batch, min_rows)
        return batch

    # -- counters --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if this core started them, and the grammar
        worker."""
        if self.workers is not None:
            self.workers.shutdown()
        self.grammars.close()

    def stats(self) -> dict[str, float]:
        pool = self.kv.pool
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "kv_cache_usage": pool.num_used / pool.num_blocks,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_steps_launched_ahead": self.num_steps_launched_ahead,
            "num_discarded_tokens": self.num_discarded_tokens,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_verified_rows": self.num_verified_rows,
            **{f"spec_draft_tokens_at_{i}": n for i, n in enumerate(self.drafts_at)},
            **{f"spec_accepted_tokens_at_{i}": n for i, n in enumerate(self.accepted_at)},
        }
