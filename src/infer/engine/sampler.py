"""The batched device-side sampler: one call per step for every row that samples a token.

Per row (all rows at once, per-row parameters held in [B, 1] tensors; no loop over the vocab):

0. logprobs: the returned `logprobs` / `top_logprobs` are log_softmax of the RAW logits
   (before banning, penalties, temperature and filters): the model's own distribution,
   like vLLM's default "raw_logprobs". They describe the model, not the filtered sampler.
   Computed only when some row asks for logprobs.
1. banned ids -> -inf: EOS while fewer than min_tokens were generated, every id outside
   `allowed_token_ids`, the last token of a bad word whose other tokens end the output;
   then `logit_bias` added.
2. penalties, on tokens seen before: repetition (tokens in the prompt or the output; a
   positive logit is divided by the penalty, a negative one multiplied), then frequency
   (minus frequency_penalty * count in the output), then presence (minus presence_penalty
   if the token occurs in the output at all).
3. greedy rows (temperature < 1e-5): argmax of the penalised logits. Done.
4. other rows: divide by temperature; top_k (keep the k largest logits); top_p (keep the
   smallest prefix of the sorted distribution whose mass is >= top_p, the top token always);
   min_p (drop tokens whose probability is < min_p * the top token's); then sample.
   Tokens tied with the last kept one are kept too, so the kept set never depends on how a
   sort orders ties. top_p is measured after top_k; min_p compares with the top token,
   which every filter keeps, so its place in the order does not matter.
   The draw is the exponential race (`_race`); on CUDA one kernel does it, greedy rows of a
   sampled batch included (`_fused_race`), straight from the logits as given when a batch
   has nothing but temperatures.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from infer.engine.structured_output import apply_token_masks
from infer.kernels import triton_available
from infer.sampling_params import SamplingParams
from infer.transfer import to_device

# top_p cut: the float32 cumulative sum may land a hair below top_p where the exact mass is
# exactly top_p; without the tolerance that would keep one extra token at the boundary.
_TOP_P_TOL = 1e-6


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # [B] float32: the sampled token's raw logprob; None when no row asked for logprobs
    # (it costs a log-softmax pass over the whole vocabulary)
    logprobs: torch.Tensor | None
    ranks: torch.Tensor | None = None  # [B] int64: the sampled token's rank, 1 = most likely
    top_logprob_ids: torch.Tensor | None = None  # [B, K] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [B, K] float32, raw, descending


@dataclass
class SamplingBatch:
    """Per-row sampling state for one step, on the device. Row i = one sequence.

    Tensors that no row needs are None, and `sample` skips their work entirely.
    """

    vocab_size: int
    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool; None when no row is greedy
    temperature: torch.Tensor | None  # [B, 1]; 1 on greedy rows; None when all are greedy
    top_k: torch.Tensor | None  # [B, 1] int64 in [1, V]; V where disabled
    max_top_k: int  # largest enabled top_k (< V), 0 if none
    top_p: torch.Tensor | None  # [B, 1]; 1 where disabled
    # How many of the largest logits top_p must sort: max_top_k when every top_p row also
    # has a top_k (a cheap topk instead of a full sort), else V.
    sort_width: int
    min_p: torch.Tensor | None  # [B, 1]; 0 where disabled
    repetition_penalty: torch.Tensor | None  # [B, 1]
    frequency_penalty: torch.Tensor | None  # [B, 1]
    presence_penalty: torch.Tensor | None  # [B, 1]
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far
    prompt_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt
    banned: torch.Tensor | None  # [B, V] bool
    logit_bias: torch.Tensor | None  # [B, V] float32, added after the bans
    # Host side: each non-greedy seeded row's (row, seed, index of the token it generates).
    seeded_rows: list[tuple[int, int, int]]
    any_unseeded_random: bool
    greedy_rows: list[int]  # host side: the greedy rows of a batch that also samples
    num_logprobs: int  # K: max over rows of SamplingParams.logprobs (0: no top-K)
    want_logprobs: bool  # some row set SamplingParams.logprobs (0 included)
    # Nothing in it depends on the rows' outputs (no bans, no penalties): the same rows'
    # next step may take it again, with their new positions (`at_seeded_positions`).
    reusable: bool = False
    # The fused race's per-row (mode, seed, position) on the device, made by its first
    # step; a seeded row's position there plus `position_shift` is its position now.
    modes: torch.Tensor | None = None
    position_shift: int = 0

    def at_seeded_positions(self, positions: list[int]) -> SamplingBatch:
        """This batch for the same rows, its seeded rows generating the tokens at
        `positions` (in `seeded_rows`' order; a reusable batch: nothing else changes; where
        all move by as much, the modes on the device stay, shifted)."""
        assert self.reusable and len(positions) == len(self.seeded_rows)
        if not self.seeded_rows:
            return self
        rows = [(row, seed, now) for (row, seed, _), now in zip(self.seeded_rows, positions)]
        moves = {now - then for now, (_, _, then) in zip(positions, self.seeded_rows)}
        shift = self.position_shift + moves.pop() if len(moves) == 1 else -1
        kept = self.modes is not None and 0 <= shift < 2**31
        return replace(self, seeded_rows=rows, modes=self.modes if kept else None,
                       position_shift=shift if kept else 0)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        banned: list[list[int]] | torch.Tensor | None = None,
        positions: list[int] | None = None,
    ) -> SamplingBatch:
        """`positions[i]`: index of the token row i generates (default: its output length)."""
        b, v = len(params), vocab_size
        if not len(prompt_token_ids) == len(output_token_ids) == b:
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        device = torch.device(device)
        if positions is None:
            positions = [len(out) for out in output_token_ids]
        greedy = [p.greedy for p in params]
        random_params = [p for p in params if not p.greedy]

        def col(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype).view(b, 1), device)

        def per_row(name: str, disabled: float) -> torch.Tensor:
            return col([disabled if g else getattr(p, name) for p, g in zip(params, greedy)])

        temperature = top_k = top_p = min_p = None
        max_top_k, sort_width = 0, v
        if random_params:
            temperature = col([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            ks = [v if g or p.top_k <= 0 else min(p.top_k, v) for p, g in zip(params, greedy)]
            if any(k < v for k in ks):
                top_k = col(ks, torch.int64)
                max_top_k = max(k for k in ks if k < v)
            if any(p.top_p < 1 for p in random_params):
                top_p = per_row("top_p", 1.0)
                if all(0 < p.top_k < v for p in random_params if p.top_p < 1):
                    sort_width = max_top_k
            if any(p.min_p > 0 for p in random_params):
                min_p = per_row("min_p", 0.0)

        rep = freq = pres = counts = prompt_mask = None
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if pen_rows:
            counts = torch.zeros(b, v, device=device)
            flat = to_device(_flat_index(output_token_ids, pen_rows, v), device)
            counts.view(-1).scatter_add_(0, flat, torch.ones(flat.numel(), device=device))
            rep_rows = [i for i in pen_rows if params[i].repetition_penalty != 1]
            if rep_rows:
                rep = col([p.repetition_penalty for p in params])
                prompt_mask = _mask(prompt_token_ids, rep_rows, b, v, device)
            if any(params[i].frequency_penalty != 0 for i in pen_rows):
                freq = col([p.frequency_penalty for p in params])
            if any(params[i].presence_penalty != 0 for i in pen_rows):
                pres = col([p.presence_penalty for p in params])

        banned_mask = None
        if isinstance(banned, torch.Tensor):
            if banned.shape != (b, v):
                raise ValueError(f"banned mask has shape {tuple(banned.shape)}, want {(b, v)}")
            banned_mask = banned.to(device=device, dtype=torch.bool)
        elif banned is not None:
            if len(banned) != b:
                raise ValueError(f"banned has {len(banned)} rows for a batch of {b}")
            rows = [i for i, ids in enumerate(banned) if ids]
            bad = [t for i in rows for t in banned[i] if not 0 <= t < v]
            if bad:
                raise ValueError(f"banned token ids out of range [0, {v}): {bad[:5]}")
            if rows:
                banned_mask = _mask(banned, rows, b, v, device)
        if any(p.allowed_token_ids or p.bad_words_token_ids for p in params):
            more = _allowed_and_bad_word_bans(params, output_token_ids, b, v, device)
            banned_mask = more if banned_mask is None else banned_mask | more

        bias = None
        if any(p.logit_bias for p in params):
            rows = [i for i, p in enumerate(params) for _ in p.logit_bias or ()]
            cols = [t for p in params for t in p.logit_bias or ()]
            values = [x for p in params for x in (p.logit_bias or {}).values()]
            bias = torch.zeros(b, v)
            bias[rows, cols] = torch.tensor(values)
            bias = to_device(bias, device)

        seeded = [
            (i, p.seed, positions[i])
            for i, (p, g) in enumerate(zip(params, greedy))
            if not g and p.seed is not None
        ]
        return cls(
            vocab_size=v,
            all_greedy=not random_params,
            greedy=col(greedy, torch.bool).view(b) if random_params and any(greedy) else None,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            sort_width=sort_width,
            min_p=min_p,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
            output_counts=counts,
            prompt_mask=prompt_mask,
            banned=banned_mask,
            logit_bias=bias,
            seeded_rows=seeded,
            any_unseeded_random=any(p.seed is None for p in random_params),
            greedy_rows=[i for i, g in enumerate(greedy) if g] if random_params else [],
            num_logprobs=min(max((p.logprobs or 0 for p in params), default=0), v),
            want_logprobs=any(p.logprobs is not None for p in params),
            reusable=banned_mask is None and not pen_rows,
        )


def _allowed_and_bad_word_bans(params: list[SamplingParams], outputs: list[list[int]],
                               b: int, v: int, device: torch.device) -> torch.Tensor:
    """[B, V] bool: every id outside a row's allowed_token_ids, and the last token of each
    of its bad words whose other tokens end its output."""
    mask = torch.zeros(b, v, dtype=torch.bool, device=device)
    allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if allowed_rows:
        allowed = _mask([p.allowed_token_ids or [] for p in params], allowed_rows, b, v,
                        device)
        limited = to_device(torch.tensor([bool(p.allowed_token_ids) for p in params]), device)
        mask |= ~allowed & limited[:, None]
    word_ends = [[word[-1] for word in p.bad_words_token_ids or ()
                  if word[-1] < v and _ends_with(out, word[:-1])]
                 for p, out in zip(params, outputs)]
    word_rows = [i for i, ends in enumerate(word_ends) if ends]
    if word_rows:
        mask |= _mask(word_ends, word_rows, b, v, device)
    return mask


def _ends_with(tokens: list[int], tail: list[int]) -> bool:
    return not tail or (len(tokens) >= len(tail) and tokens[len(tokens) - len(tail):] == tail)


def _flat_index(token_lists: list[list[int]], rows: list[int], v: int) -> torch.Tensor:
    """Indices into a flattened [B, V] tensor of every (row, token) pair, rows in `rows`."""
    lengths = [len(token_lists[i]) for i in rows]
    flat = np.fromiter(
        itertools.chain.from_iterable(token_lists[i] for i in rows), np.int64, sum(lengths)
    )
    flat += np.repeat(np.asarray(rows, dtype=np.int64) * v, lengths)
    return torch.from_numpy(flat)


def _mask(
    token_lists: list[list[int]], rows: list[int], b: int, v: int, device: torch.device
) -> torch.Tensor:
    mask = torch.zeros(b, v, dtype=torch.bool, device=device)
    flat = to_device(_flat_index(token_lists, rows, v), device)
    mask.view(-1).scatter_(0, flat, True)
    return mask


def apply_bans_and_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Banned ids -> -inf, then logit_bias added (out of place; no-op when neither)."""
    if batch.banned is not None:
        logits = logits.masked_fill(batch.banned, float("-inf"))
    if batch.logit_bias is not None:
        logits = logits + batch.logit_bias
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency, presence penalties (out of place; no-op when none is set)."""
    counts = batch.output_counts
    if counts is None:
        return logits
    if batch.repetition_penalty is not None:
        seen = batch.prompt_mask | (counts > 0)
        pen = batch.repetition_penalty
        penalised = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(seen, penalised, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then top_k / top_p / min_p as -inf masks (out of place)."""
    neg_inf = float("-inf")
    x = logits / batch.temperature
    if batch.top_p is not None:
        if batch.sort_width < batch.vocab_size:
            sorted_x = x.topk(batch.sort_width, dim=-1).values
        else:
            sorted_x = x.sort(dim=-1, descending=True).values
        # top_k drops by position here, so top_p's mass is always over exactly k logits:
        # counting the ties past the k-th would make it depend on sort_width, i.e. on
        # the other rows of the batch. Ties with the final cut-off are kept below.
        rank = torch.arange(sorted_x.shape[-1], device=x.device).expand_as(sorted_x)
        drop = rank >= (batch.top_k if batch.top_k is not None else batch.vocab_size)
        probs = sorted_x.masked_fill(drop, neg_inf).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        cut = torch.where(batch.top_p >= 1, float("inf"), batch.top_p - _TOP_P_TOL)
        drop |= mass_before >= cut
        drop[:, 0] = False
        # Both drops are suffixes of the sorted order, so the kept set is a prefix and its
        # last logit is the cut-off. Rows with neither filter keep everything (their sorted
        # prefix may be cut short by sort_width).
        n_keep = (~drop).sum(dim=-1, keepdim=True)
        cutoff = sorted_x.gather(1, n_keep - 1)
        if batch.top_k is not None:
            unfiltered = (batch.top_k >= batch.vocab_size) & (batch.top_p >= 1)
            cutoff = torch.where(unfiltered, neg_inf, cutoff)
        x = x.masked_fill(x < cutoff, neg_inf)
    elif batch.top_k is not None:
        top = x.topk(batch.max_top_k, dim=-1).values
        kth = top.gather(1, batch.top_k.clamp(max=batch.max_top_k) - 1)
        kth = torch.where(batch.top_k >= batch.vocab_size, neg_inf, kth)
        x = x.masked_fill(x < kth, neg_inf)
    if batch.min_p is not None:
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p); log(0) = -inf disables it.
        floor = x.amax(dim=-1, keepdim=True) + torch.log(batch.min_p)
        x = x.masked_fill(x < floor, neg_inf)
    return x


def _row_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seeded_draws(seed: int, position: int, shape: tuple[int, ...], device: torch.device,
                 kind: str = "exponential") -> torch.Tensor:
    """Random draws of a seeded request at one output position: Exp(1) noise (what the
    sampler races with) or, with `kind="uniform"`, [0, 1) numbers from a stream of their
    own; the same whatever else the batch holds. (`fill_seeded`'s way off CUDA.)"""
    gen = torch.Generator(device=device)
    gen.manual_seed(_row_seed(seed, position) ^ (kind == "uniform"))
    out = torch.empty(shape, device=device)
    return out.exponential_(generator=gen) if kind == "exponential" else out.uniform_(
        generator=gen)


def _seed_word(seed: int) -> int:
    """A seed as the int64 whose bits are the seed's low 64 (two's complement): the Philox
    kernels' key."""
    return (seed + 2**63) % 2**64 - 2**63


def fill_seeded(out: torch.Tensor, rows: list[int], seeds: list[int], positions: list[int],
                kind: str = "exponential") -> None:
    """out[rows[i]] := the draws of seeded request seeds[i] at output position
    positions[i] (`seeded_draws`' kinds). On CUDA one kernel for every row (a counter-based
    stream per row: `kernels/seeded_noise.py`); elsewhere a generator per row, whose
    set-up is cheap on a CPU. A seed's draws are the same within one kind of device."""
    if not rows:
        return
    if out.is_cuda and triton_available():
        from infer.kernels.seeded_noise import seeded_noise

        words = [[_seed_word(seed) for seed in seeds], positions, rows]
        meta = to_device(torch.tensor(words, dtype=torch.int64), out.device)
        seeded_noise(out, meta[2], meta[0], meta[1], exponential=kind == "exponential",
                     stream=int(kind == "uniform"))
        return
    for row, seed, position in zip(rows, seeds, positions):
        out[row] = seeded_draws(seed, position, out.shape[1:], out.device, kind)


def _race(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Sample each row from softmax(x) by the exponential race: argmax_i p_i / E_i.

    With E_i ~ Exp(1) i.i.d., P(argmax = i) = p_i, and a row's result depends only on its
    own logits and its own noise. Seeded rows draw their noise from a generator seeded by
    (seed, position), so they give the same token whatever else is in the batch and
    wherever the row sits. Computed in log space (x_i - log E_i): no softmax, no underflow.
    Greedy rows of the batch are left to the caller.
    """
    noise = torch.empty_like(x).exponential_() if batch.any_unseeded_random else torch.ones_like(x)
    if batch.seeded_rows:
        rows, seeds, positions = (list(c) for c in zip(*batch.seeded_rows))
        fill_seeded(noise, rows, seeds, positions)
    # E = 0 would make log E = -inf and lift a -inf (filtered) token to NaN.
    noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (x - noise.log()).argmax(dim=-1)


def _fused_race(x: torch.Tensor, batch: SamplingBatch,
                temperature: torch.Tensor | None = None,
                masks: torch.Tensor | None = None) -> torch.Tensor:
    """`_race` on CUDA in one pass over x (`kernels/race_sample.py`), greedy rows included:
    a seeded row's noise is `fill_seeded`'s, an unseeded row's comes from a key drawn from
    torch's generator each step. `temperature`: x is not divided by it yet; `masks`: the
    grammars' token bitmasks, applied in the same pass."""
    from infer.kernels.race_sample import GREEDY, SEEDED, UNSEEDED, race_sample

    step_key = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))
    if (batch.seeded_rows or batch.greedy_rows) and batch.modes is None:
        n = len(x)
        mode, seed, position = [UNSEEDED.value] * n, [0] * n, list(range(n))
        for row in batch.greedy_rows:
            mode[row] = GREEDY.value
        for row, row_seed, row_position in batch.seeded_rows:
            mode[row], seed[row] = SEEDED.value, _seed_word(row_seed)
            position[row] = row_position
        batch.modes = to_device(torch.tensor([mode, seed, position], dtype=torch.int64),
                                x.device)
        batch.position_shift = 0
    return race_sample(x, step_key, temperature, batch.modes, masks=masks,
                       position_shift=batch.position_shift)


def argmax(x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
    """Row-wise argmax of `[B, V]`: on CUDA two short launches (`kernels/argmax.py`)
    instead of torch's one thread block per row; `masks` only on CUDA (see `sample`)."""
    if x.is_cuda and triton_available():
        from infer.kernels.argmax import argmax_rows

        return argmax_rows(x, masks)
    assert masks is None, "token bitmasks are fused on CUDA only"
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch,
           masks: torch.Tensor | None = None) -> SamplerOutput:
    """Sample one token per row of `logits` [B, V]; never modifies `logits`, unless
    `masks` is given and the step needs more than one pass over them.

    `masks` [B, words] int32 on the logits' device: the grammars' token bitmasks
    (`kernels/token_bitmask.py`'s layout; an unconstrained row allows every token). A
    token they do not allow is never sampled. Where one kernel reads the logits (greedy or
    temperature-only rows, no logprobs, on CUDA) it applies them in the same pass; else
    they are applied to `logits` in place first, and logprobs see them.

    Reads nothing back to the host: the caller syncs once, on `token_ids`.
    """
    if logits.dim() != 2 or logits.shape[1] != batch.vocab_size:
        raise ValueError(f"logits shape {tuple(logits.shape)}, want [B, {batch.vocab_size}]")
    fused = logits.is_cuda and triton_available()
    plain = batch.banned is None and batch.logit_bias is None and batch.output_counts is None
    temperature_only = (not batch.all_greedy and batch.top_k is None and batch.top_p is None
                        and batch.min_p is None)
    if masks is not None and not (fused and plain and not batch.want_logprobs
                                  and (batch.all_greedy or temperature_only)):
        apply_token_masks(logits, masks)
        masks = None
    if batch.all_greedy and not batch.want_logprobs and plain:
        return SamplerOutput(argmax(logits, masks), None)  # the model's dtype ranks as float32
    if fused and plain and temperature_only:  # read the logits once
        tokens = _fused_race(logits, batch, batch.temperature, masks)
        if not batch.want_logprobs:
            return SamplerOutput(tokens, None)
        return SamplerOutput(tokens, *raw_logprobs(logits.float(), tokens, batch.num_logprobs))
    logits = logits.float()
    x = logits
    x = apply_penalties(apply_bans_and_bias(x, batch), batch)
    if batch.all_greedy:
        tokens = argmax(x)
    elif fused:
        tokens = _fused_race(filter_logits(x, batch), batch)
    else:
        tokens = _race(filter_logits(x, batch), batch)
        if batch.greedy is not None:
            tokens = torch.where(batch.greedy, argmax(x), tokens)
    if not batch.want_logprobs:
        return SamplerOutput(tokens, None)
    return SamplerOutput(tokens, *raw_logprobs(logits, tokens, batch.num_logprobs))


def warm_up_sampler(vocab_size: int, device: torch.device) -> None:
    """Compile the sampler's Triton kernels before a request waits for them (on CUDA: on a
    machine without Triton's disk cache, each variant took 0.4-0.6 s inside the first
    step that needed it): argmax, the fused race with and without temperatures and
    per-row modes (greedy and seeded rows beside unseeded ones), each with and without
    grammar masks, and the masks' own kernel."""
    if device.type != "cuda" or not triton_available():
        return
    logits = torch.zeros(2, vocab_size, device=device)
    masks = torch.full((2, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
    hot, cold = SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)
    seeded, top_p = SamplingParams(temperature=0.7, seed=1), SamplingParams(top_p=0.9)
    state = torch.get_rng_state()  # the unseeded rows' step keys come from it
    for params in ([cold, cold], [hot, hot], [cold, hot], [top_p, top_p], [seeded, top_p]):
        batch = SamplingBatch.build(params, [[0], [0]], [[], []], vocab_size, device)
        sample(logits, batch).token_ids.cpu()
        sample(logits, batch, masks).token_ids.cpu()
    torch.set_rng_state(state)


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                            torch.Tensor | None]:
    """From float32 `logits [N, V]` as the model gave them: the log-softmax at `tokens
    [N]` (an id < 0 reads id 0), the rank of each (1 + how many tokens are more likely),
    and the ids and log-softmax of the `num_logprobs` most likely tokens, most likely
    first (None, None if 0)."""
    lse = logits.logsumexp(dim=-1, keepdim=True)
    token_logits = logits.gather(1, tokens.clamp(min=0)[:, None])
    chosen = (token_logits - lse).squeeze(1)
    ranks = (logits > token_logits).sum(dim=-1) + 1
    if not num_logprobs:
        return chosen, ranks, None, None
    values, top_ids = logits.topk(num_logprobs, dim=-1)
    return chosen, ranks, top_ids, values - lse
