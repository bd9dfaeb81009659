"""LLMEngine: requests in, one step at a time, RequestOutputs out.

A user request with `n` completions becomes `n` scheduler requests ("sequences") that share
the prompt's KV blocks. Each step: schedule -> run the model -> sample -> account ->
detokenize and check stops -> emit outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.attention import set_attention_backend
from infer.cache.kv_manager import KVCacheManager
from infer.engine.config import EngineConfig
from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.memory import plan_kv_cache
from infer.engine.model_runner import ModelRunner, StepInputs
from infer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from infer.engine.request import Request
from infer.engine.sampler import SamplingBatch, sample
from infer.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from infer.engine.setup import load_model_and_tokenizer, pick_backend, pick_device_and_dtype
from infer.models.layers import set_kernel_backend
from infer.sampling_params import SamplingParams
from infer.transfer import HostCopy, to_device

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    group_id: str
    request: Request
    params: SamplingParams
    detok: IncrementalDetokenizer
    stop_token_ids: frozenset[int]
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    # Final output only and no stop strings: the text is decoded once, at the end.
    text_at_end: bool = False


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    arrival_time: float
    # Only the finished output is wanted (LLM.generate): no RequestOutput per step.
    final_only: bool = False
    first_token_time: float | None = None


@dataclass
class _StepInFlight:
    """A launched step not yet accounted: the scheduler and sequences do not show it."""

    out: SchedulerOutput
    seqs: list[_Sequence]  # the sequences that sample, in row order
    token_ids: torch.Tensor | None  # [rows] sampled ids on the device
    results: HostCopy | None  # token ids, logprobs, top logprobs on their way to the host


class RequestRejected(ValueError):
    """A request that can never be served; `param` names the request field to change."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        self.device, self.dtype = pick_device_and_dtype(config.device, config.dtype)
        self.model, self.model_config, self.tokenizer, self.model_name = (
            load_model_and_tokenizer(config.model, self.dtype, self.device)
        )
        torch.manual_seed(config.seed)
        mc = self.model_config
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, 8192)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's context length "
                f"({mc.max_position_embeddings})"
            )
        if not config.chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"chunked_prefill=False needs max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) >= max_model_len ({self.max_model_len})"
            )
        self.attention_backend = pick_backend("attention_backend", config.attention_backend,
                                              self.device)
        self.kernel_backend = pick_backend("kernel_backend", config.kernel_backend, self.device)
        # Bound before sizing the pool, so the warm-up forward measures the backends in use.
        set_attention_backend(self.model, self.attention_backend)
        set_kernel_backend(self.model, self.kernel_backend)
        self.block_size, num_blocks = plan_kv_cache(
            config, mc, self.max_model_len, self.model, self.device, self.dtype
        )
        self.kv = KVCacheManager(num_blocks, self.block_size, config.prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens,
            batching=config.batching_mode, chunked_prefill=config.chunked_prefill,
            max_prefill_chunk=config.prefill_chunk_size,
        )
        self.runner = ModelRunner(
            self.model, mc, num_blocks, self.block_size, self.device, self.dtype,
            self.attention_backend, self.kernel_backend,
        )
        self.graph_capture_seconds = 0.0
        if config.cuda_graphs and self.device.type == "cuda":
            if self.attention_backend != "triton":
                log.warning("cuda_graphs needs attention_backend='triton'; running eagerly")
            else:
                graphs = self.runner.enable_decode_graphs(config.max_num_seqs,
                                                          self.max_model_len)
                self.graph_capture_seconds = graphs.capture_seconds
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or mc.eos_token_ids
        self.groups: dict[str, _Group] = {}
        self.sequences: dict[str, _Sequence] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._next_id = 0
        self._in_flight: _StepInFlight | None = None
        self.num_steps = 0
        self.num_steps_launched_ahead = 0
        self.num_discarded_tokens = 0  # sampled for a sequence that stopped or was aborted
        self.num_requests_failed = 0  # charged with a failure of their own (`error` set)
        # Called once a step is scheduled, before it runs (a server refreshes its gauges:
        # a long step would otherwise show the state from before it).
        self.on_step_start: Callable[[], None] | None = None

    # -- requests --------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        final_only: bool = False,
    ) -> str:
        """Queue a request; raises ValueError (and queues nothing) if it cannot be served.
        With `final_only`, step() returns this request's output only once it has finished
        (building a cumulative output every step costs O(output length) per sequence)."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, ids = self._tokenize(prompt)
        max_new = self._check_fits(ids, params)
        self._check_token_ids(params)
        now = time.monotonic()
        sequences = []
        for i in range(params.n):
            child = Request(
                f"{request_id}#{i}" if params.n > 1 else request_id, ids, max_new, now,
                share_prefix_with=f"{request_id}#0" if i > 0 else None,
            )
            seq_params = params
            if params.seed is not None and i > 0:
                seq_params = dataclasses.replace(params, seed=params.seed + i)
            sequences.append(_Sequence(
                request_id, child, seq_params,
                IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                       params.stop, params.include_stop_str_in_output),
                frozenset(params.stop_token_ids),
                logprobs=[] if params.logprobs is not None else None,
                text_at_end=final_only and not params.stop,
            ))
        self.groups[request_id] = _Group(request_id, text, ids, sequences, now, final_only)
        for seq in sequences:
            self.sequences[seq.request.request_id] = seq
            self.scheduler.add(seq.request)
        self.prompt_tokens_total += len(ids)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids, text = list(prompt), None
        else:
            raise RequestRejected("prompt must be a string or a list of token ids")
        if not ids:
            raise RequestRejected("the prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return text, ids

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Every token id a request names must be a row of the logits: one that is not
        would fail the sampler for every request in the batch."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise RequestRejected(
                f"stop_token_ids out of range [0, {vocab}): {bad[:5]}", "stop_token_ids")

    def _check_fits(self, ids: list[int], params: SamplingParams) -> int:
        n = len(ids)
        if n >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {n} tokens; this model serves at most "
                f"{self.max_model_len} tokens in all (prompt + output), so at most "
                f"{self.max_model_len - 1} prompt tokens"
            )
        pool = self.kv.pool.num_blocks
        capacity = pool * self.block_size  # tokens one sequence can hold if it has every block
        if n >= capacity:
            raise RequestRejected(
                f"the prompt has {n} tokens but the KV cache pool holds {capacity} tokens "
                f"({pool} blocks of {self.block_size}), and the prompt needs room for at least "
                "one output token; send a shorter prompt or start the engine with more blocks"
            )
        room = self.max_model_len - n
        if params.max_tokens is None:
            return min(room, capacity - n)  # "as many as fit"
        max_new = min(params.max_tokens, room)
        if n + max_new > capacity:
            raise RequestRejected(
                f"the request needs {self.kv.blocks_needed(n + max_new)} KV blocks ({n} prompt "
                f"+ {max_new} new tokens) but the pool has {pool} blocks of "
                f"{self.block_size} tokens; lower max_tokens to at most {capacity - n}",
                "max_tokens",
            )
        return max_new

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.sequences:
            self.scheduler.abort(seq.request.request_id)
            self.sequences.pop(seq.request.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that changed.

        With async scheduling the next decode step may already be launched on the device
        (`_launch_ahead`) before this step's tokens are read back and accounted, so the GPU
        never waits for the host's bookkeeping.

        A failure is charged to the request that caused it whenever that can be told: that
        request is aborted (its blocks freed) and gets a finished output with `error` set,
        and the rest of the step goes on. Host-side preparation that fails is re-run one
        request at a time to find the culprit; then nothing of the step has been accounted,
        so the others are simply scheduled again. Accounting (logprobs, detokenizing, stop
        checks, outputs) runs per request. A failure that no single request explains
        (e.g. the model forward) aborts every request the step had scheduled, freeing their
        blocks, and propagates; requests outside the step keep going.
        """
        step, self._in_flight = self._in_flight, None
        out = step.out if step is not None else self.scheduler.schedule()
        if out.empty:
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
        except BaseException:
            self._abort_scheduled(out)
            if self._in_flight is not None:
                self._abort_scheduled(self._in_flight.out)
                self._in_flight = None
            raise

    def _fail_launch(self, out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        culprits = self._culprits(out)
        if not culprits:
            raise exc
        log.warning("step preparation failed (%r); failing %d request(s): %s", exc,
                    len(culprits), ", ".join(culprits))
        return [self._fail_group(self.groups[gid], exc) for gid in culprits]

    def _culprits(self, out: SchedulerOutput) -> list[str]:
        """The groups whose host-side step preparation fails when run on its own."""
        culprits: dict[str, None] = {}
        for item in out.scheduled:
            seq = self.sequences.get(item.request.request_id)
            if seq is None or seq.group_id in culprits:
                continue
            try:
                inputs = self.runner.prepare(SchedulerOutput([item]), self.kv.tables)
                if inputs.sample_request_ids:
                    self._sampling_batch([seq])
            except Exception:
                culprits[seq.group_id] = None
        return list(culprits)

    def _try_launch_ahead(self, prev: _StepInFlight) -> _StepInFlight | None:
        """A launch ahead that fails is dropped: nothing of it was accounted, and the next
        step prepares the same work again the ordinary way, where a failure is charged."""
        try:
            return self._launch_ahead(prev)
        except Exception as exc:
            log.debug("launch ahead failed (%r); planning the next step after this one", exc)
            return None

    def _abort_scheduled(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            seq = self.sequences.get(item.request.request_id)
            if seq is not None and seq.request is item.request:
                self.abort_request(seq.group_id)

    def _launch(self, out: SchedulerOutput, inputs: StepInputs,
                device_input_ids: torch.Tensor | None = None, ahead: int = 0) -> _StepInFlight:
        """Queue the step's forward and sampling on the device; nothing waits for them."""
        seqs = [self.sequences[rid] for rid in inputs.sample_request_ids]
        logits = self.runner.execute(inputs, device_input_ids)
        self.num_steps += 1
        self.num_steps_launched_ahead += ahead
        if not seqs:
            return _StepInFlight(out, [], None, None)
        result = sample(logits, self._sampling_batch(seqs, ahead))
        results = HostCopy(result.token_ids, result.logprobs, result.top_logprob_ids,
                           result.top_logprobs)
        return _StepInFlight(out, seqs, result.token_ids, results)

    def _launch_ahead(self, prev: _StepInFlight) -> _StepInFlight | None:
        """Launch the step after `prev` before prev's tokens reach the host, when that
        step is sure to be prev's sampling sequences each decoding one more token: nothing
        waits, nothing is mid-prefill, and no sequence's sampling depends on prev's token
        values (penalties). Sequences that prev ends by length are left out; one that prev
        ends by a stop token or string computes one token in vain, dropped when accounted.
        None: the scheduler plans the next step once prev is accounted."""
        if not self.config.async_scheduling or self.scheduler.waiting or not prev.seqs:
            return None
        live = [(row, seq) for row, seq in enumerate(prev.seqs) if not seq.request.finished]
        if len(live) != len(self.scheduler.running):
            return None
        if any(seq.params.has_penalties for _, seq in live):
            return None
        plan = self._plan_ahead(prev, live)
        if plan is None:
            return None
        inputs, rows, seqs = plan
        ids = prev.token_ids
        if rows != list(range(len(prev.seqs))):
            ids = ids[to_device(torch.tensor(rows), self.device)]
        out = SchedulerOutput([ScheduledRequest(seq.request, 1) for seq in seqs])
        return self._launch(out, inputs, ids, ahead=1)

    def _plan_ahead(self, prev: _StepInFlight, live: list[tuple[int, _Sequence]]
                    ) -> tuple[StepInputs, list[int], list[_Sequence]] | None:
        """Inputs of the step after `prev` for its `live` (row, sequence) pairs, their
        blocks allocated; None if the pool is short."""
        next_pos = {id(i.request): i.start + i.num_new_tokens for i in prev.out.scheduled}
        rows: list[int] = []
        seqs: list[_Sequence] = []
        inputs = StepInputs([], [], [], [], [], [], [])
        for row, seq in live:
            request = seq.request
            if len(request.output_token_ids) + 1 >= request.max_new_tokens:
                continue  # prev samples its last token
            pos = next_pos[id(request)]
            if not self.kv.allocate(request.request_id, pos + 1):
                return None
            inputs.positions.append(pos)
            inputs.query_lens.append(1)
            inputs.seq_lens.append(pos + 1)
            inputs.block_tables.append(self.kv.tables[request.request_id])
            inputs.sample_rows.append(len(rows))
            inputs.sample_request_ids.append(request.request_id)
            rows.append(row)
            seqs.append(seq)
        return (inputs, rows, seqs) if rows else None

    def _finish(self, step: _StepInFlight) -> list[RequestOutput]:
        """Wait for the step's tokens, account them, check stops, build outputs."""
        sampled: dict[str, int] = {}
        rows: dict[str, int] = {}
        chosen_lp = tops = None
        if step.seqs:
            token_ids, chosen_lp, top_ids, top_lps = (
                None if t is None else t.tolist() for t in step.results.wait())
            tops = None if top_ids is None else (top_ids, top_lps)
            for row, seq in enumerate(step.seqs):
                if seq.request.finished:
                    self.num_discarded_tokens += 1
                    continue
                sampled[seq.request.request_id] = token_ids[row]
                rows[seq.request.request_id] = row
        produced: dict[str, list[_Sequence]] = {}  # group id -> sequences with a new token
        for request in self.scheduler.update(step.out, sampled):
            seq = self.sequences[request.request_id]
            produced.setdefault(seq.group_id, []).append(seq)
            self.generation_tokens_total += 1
        now = time.monotonic()
        outputs = []
        for gid, seqs in produced.items():
            group = self.groups[gid]
            try:
                for seq in seqs:
                    if seq.logprobs is not None:  # then the batch computed chosen_lp
                        row = rows[seq.request.request_id]
                        token = seq.request.output_token_ids[-1]
                        seq.cumulative_logprob += chosen_lp[row]
                        seq.logprobs.append(self._logprob_entry(
                            token, chosen_lp[row], tops, row, seq.params.logprobs or 0))
                    self._check_stop(seq)
                if group.first_token_time is None:
                    group.first_token_time = now
                if group.final_only and not all(s.request.finished for s in group.sequences):
                    continue
                output = self._output(group, now)
            except Exception as exc:
                log.exception("request %s failed while its output was built", gid)
                outputs.append(self._fail_group(group, exc))
                continue
            outputs.append(output)
            if output.finished:
                for seq in self.groups.pop(gid).sequences:
                    del self.sequences[seq.request.request_id]
        return outputs

    def _fail_group(self, group: _Group, exc: Exception) -> RequestOutput:
        """Abort `group` (freeing its blocks) and return its final, failed output."""
        self.abort_request(group.request_id)
        self.num_requests_failed += 1
        outputs = [CompletionOutput(i, seq.detok.text[:seq.detok.emitted],
                                    list(seq.request.output_token_ids), finish_reason="error")
                   for i, seq in enumerate(group.sequences)]
        now = time.monotonic()
        metrics = {"arrival_time": group.arrival_time, "first_token_time": group.first_token_time,
                   "last_token_time": now, "finished_time": now}
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                             True, metrics=metrics, error=f"{type(exc).__name__}: {exc}")

    def _sampling_batch(self, seqs: list[_Sequence], ahead: int = 0) -> SamplingBatch:
        """`ahead`: tokens each sequence has sampled that are not in its output yet."""
        banned, positions = [], []
        for seq in seqs:
            n_out = len(seq.request.output_token_ids) + ahead
            positions.append(n_out)
            if n_out < seq.params.min_tokens:
                banned.append(list(self.eos_token_ids) + list(seq.params.stop_token_ids or []))
            else:
                banned.append([])
        return SamplingBatch.build(
            [s.params for s in seqs],
            [s.request.prompt_token_ids for s in seqs],
            [s.request.output_token_ids for s in seqs],
            vocab_size=self.model_config.vocab_size, device=self.device, banned=banned,
            positions=positions,
        )

    def _logprob_entry(self, token, lp, tops, row, k) -> dict[int, Logprob]:
        entry = {token: Logprob(lp, None, self.tokenizer.decode([token], False))}
        if tops is not None:
            for rank, (tid, tlp) in enumerate(zip(tops[0][row][:k], tops[1][row][:k]), 1):
                if tid == token:
                    entry[token] = Logprob(lp, rank, entry[token].decoded_token)
                else:
                    entry[tid] = Logprob(tlp, rank, self.tokenizer.decode([tid], False))
        return entry

    def _check_stop(self, seq: _Sequence) -> None:
        request, params = seq.request, seq.params
        token = request.output_token_ids[-1]
        n_out = len(request.output_token_ids)
        if seq.text_at_end:
            seq.detok.append(token)
            stop_string = None
        else:
            stop_string = seq.detok.push(token)
        if n_out >= params.min_tokens:
            if token in seq.stop_token_ids:
                return self.scheduler.finish(request, "stop", token)
            if not params.ignore_eos and token in self.eos_token_ids:
                return self.scheduler.finish(request, "stop", None)
            if stop_string is not None:
                return self.scheduler.finish(request, "stop", stop_string)
        if n_out >= request.max_new_tokens:
            self.scheduler.finish(request, "length")

    def _output(self, group: _Group, now: float) -> RequestOutput:
        outputs = []
        for i, seq in enumerate(group.sequences):
            r = seq.request
            if r.finished:
                seq.detok.flush()
            seq.detok.new_text(r.finished)
            outputs.append(CompletionOutput(
                index=i, text=seq.detok.text[:seq.detok.emitted],
                token_ids=list(r.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=seq.logprobs, finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
            ))
        finished = all(s.request.finished for s in group.sequences)
        metrics = {"arrival_time": group.arrival_time, "first_token_time": group.first_token_time,
                   "last_token_time": now}
        if finished:
            metrics["finished_time"] = now
        return RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
            num_cached_tokens=group.sequences[0].request.num_cached_tokens, metrics=metrics,
        )

    # -- counters --------------------------------------------------------------------
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
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_steps": self.num_steps,
            "num_steps_launched_ahead": self.num_steps_launched_ahead,
            "num_discarded_tokens": self.num_discarded_tokens,
            "num_requests_failed": self.num_requests_failed,
        }
