"""A grammar worker: one of the processes that hold the constrained sequences' grammar
matchers (a matcher lives in worker `id % workers`), feed them the tokens each step samples
and fill the next step's token bitmasks, so that none of that work (nor its GIL) sits on
the engine's step loop (`grammar_process.py` is the loop's side; docs/architecture.md,
"Structured output", says why processes, and why more than one).

They share one block of memory (`SharedLayout`), registered with CUDA by the loop's side:

- counters of the loop and the device: `tokens_stamp` (the last step whose sampled ids
  are in `tokens`; the device writes it after the ids) and `fills` (the last step whose
  fill the loop asked for); and each worker's own, in its lane: `masks_ready` (the last
  step whose masks of its rows are filled; the device waits on every lane's), `fed` (the
  last step whose ids its matchers have taken; `verdicts` then holds its rows), `noted`,
  by step parity like the verdicts (the last step of that parity with a verdict of its
  rows other than "took it": the loop reads the rows only then) and `fills_taken` (the
  last step whose fill it took);
- `requests` [FILL_SLOTS, 3] int64 and `request_ids` / `request_rows` [FILL_SLOTS, rows]
  int64: a step's fill in slot step % FILL_SLOTS (its rows, how many are masked, the last
  published step; the masked rows' matcher ids and rows);
- `tokens` [rows] int64, `verdicts` [2, rows] uint8 (by step parity), `masks` [rows, words]
  int32 in the grammar library's layout.

A step costs the loop no message: it writes the fill into its slot and then `fills`,
which the workers watch, taking the steps in order. A filled step's ids are taken, for the
rows it named, once `tokens_stamp` reaches it. Messages, on each worker's own pipe and in
order, come from the thread that compiles grammars, ("make", id, grammar) (no answer: a
matcher the library refuses gets the verdict FAILED), and from the loop, ("drop", ids); a
worker reads every message sent before a fill before it takes the fill, so a fill never
names a matcher it has not made. A step's rows that are not masked allow every token
(worker 0 writes them).
`published` is the last step whose ids the loop has had the device publish: a step filled
but never published (its launch failed) is past it when the next fill comes, and is
dropped.

Each area has one writer at a time: the loop writes slot s % FILL_SLOTS only once every
worker has taken step s - FILL_SLOTS; a worker fills its rows' masks of step s only after
it took step s-1's ids, which the device publishes after copying step s-1's masks; and it
takes step s's ids only after the device published them, which it does after waiting for
every worker's masks of step s. So one slot of the tokens and masks is enough (two of the
verdicts and of `noted`: the loop reads step s's while a worker may have fed step s+1),
and the workers' rows of a step are apart.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection

import numpy as np

# verdicts: took the token / took it and finished / refused it / has no matcher (the
# library refused its grammar)
TAKEN, STOPPED, REFUSED, FAILED = 0, 1, 2, 3
# int64 slots of the counters, each on a cache line of its own: the header's, then each
# worker's lane's (`noted`: two, by parity)
TOKENS_STAMP, FILLS = 0, 8
HEADER_WORDS = 16
MASKS_READY, FED, NOTED, FILLS_TAKEN = 0, 8, 16, 24
LANE_WORDS = 32
# Fills the loop may ask for ahead of the worker's taking them.
FILL_SLOTS = 4
# How long the worker waits for a step's ids to be published before giving up on it.
TOKENS_WAIT_S = 30.0
# How often the worker looks for a fill or a stamp, and how often once nothing has come
# for IDLE_S (the first fill after a pause waits up to IDLE_POLL_S).
POLL_S, IDLE_POLL_S, IDLE_S = 50e-6, 2e-3, 0.1
# Rows from which a step's tokens go to the matchers on the executor's threads: JSON
# matchers took 5-7 µs a token on the 2-core CPU machine (256 rows: 1.67 ms serially, 1.12
# on two threads; 32 rows: 0.16 ms either way), and waking threads costs what a few take.
FEED_PAR_ROWS = 64


class SharedLayout:
    """Views of the shared block for `rows` rows of `words` mask words each and `workers`
    workers, every area starting on a cache line."""

    header: np.ndarray  # [HEADER_WORDS] int64: the loop's and the device's counters
    lanes: np.ndarray  # [workers, LANE_WORDS] int64: each worker's counters
    requests: np.ndarray  # [FILL_SLOTS, 3] int64: rows, masked rows, published
    request_ids: np.ndarray  # [FILL_SLOTS, rows] int64: the masked rows' matcher ids
    request_rows: np.ndarray  # [FILL_SLOTS, rows] int64: the masked rows
    tokens: np.ndarray  # [rows] int64
    verdicts: np.ndarray  # [2, rows] uint8
    masks: np.ndarray  # [rows, words] int32

    def __init__(self, buf: memoryview, rows: int, words: int, workers: int = 1) -> None:
        self.rows, self.words, self.workers = rows, words, workers
        for name, dtype, shape, offset in self._areas(rows, words, workers)[0]:
            view = np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=offset)
            setattr(self, name, view.reshape(shape))

    @staticmethod
    def size(rows: int, words: int, workers: int = 1) -> int:
        return SharedLayout._areas(rows, words, workers)[1]

    @staticmethod
    def _areas(rows: int, words: int, workers: int
               ) -> tuple[list[tuple[str, type, tuple[int, ...], int]], int]:
        """(name, dtype, shape, byte offset) of each area, and the block's size."""
        areas, at = [], 0
        for name, dtype, shape in (("header", np.int64, (HEADER_WORDS,)),
                                   ("lanes", np.int64, (workers, LANE_WORDS)),
                                   ("requests", np.int64, (FILL_SLOTS, 3)),
                                   ("request_ids", np.int64, (FILL_SLOTS, rows)),
                                   ("request_rows", np.int64, (FILL_SLOTS, rows)),
                                   ("tokens", np.int64, (rows,)),
                                   ("verdicts", np.uint8, (2, rows)),
                                   ("masks", np.int32, (rows, words))):
            areas.append((name, dtype, shape, at))
            at += (int(np.prod(shape)) * np.dtype(dtype).itemsize + 63) // 64 * 64
        return areas, at


def make_shared(name: str, size: int) -> tuple[mmap.mmap, shared_memory.SharedMemory]:
    """A new shared block `name` of `size` bytes: a mapping that no SharedMemory object
    holds (that one refuses to close while views of it exist), and the closed object, whose
    `unlink()` the maker calls once done (its resource tracker does, should it die first)."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    block = mmap.mmap(shm._fd, shm.size)  # type: ignore[attr-defined]
    shm.close()
    return block, shm


def map_shared(name: str) -> mmap.mmap:
    """A mapping of the existing block `name`, whose name stays the maker's to unlink: this
    process's resource tracker is told to forget it (before Python 3.13 opening a block
    registers it, and the tracker would unlink it when this process ends)."""
    if sys.version_info >= (3, 13):
        shm = shared_memory.SharedMemory(name=name, track=False)
    else:
        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    block = mmap.mmap(shm._fd, shm.size)  # type: ignore[attr-defined]
    shm.close()
    return block


def main(fd: int) -> None:
    """The worker process's main: its set-up, then the steps, from the pipe's read end
    `fd`, until the pipe closes."""
    steps = Connection(fd, writable=False)
    try:
        setup = steps.recv()
    except EOFError:
        return
    serve(*setup, steps)


def serve(shm_name: str, rows: int, words: int, workers: int, index: int,
          tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], spin: bool,
          threads: int, cpus: list[int] | None, steps: Connection) -> None:
    """Serve `steps` as worker `index` of `workers` for the shared block `shm_name` until
    they close. `spin`: look at the counters without sleeping while steps come (a core for
    the device's wait). `threads`: the grammar library's (0: its default). `cpus`: where
    this process and the threads it starts may run (None: anywhere)."""
    import llguidance

    if cpus:  # every thread so far (numpy's start some), and the library's: they inherit it
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), cpus)

    layout = SharedLayout(memoryview(map_shared(shm_name)), rows, words, workers)
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                       eos_token=eos_token_ids)
    Worker(layout, tokenizer, llguidance.LLExecutor(threads or None), steps, spin,
           index).run()


class Worker:
    """Worker `index` of the layout's: the matchers whose id is `index` modulo their
    number, and their rows of each step."""

    def __init__(self, layout: SharedLayout, tokenizer: object, executor: object,
                 steps: Connection, spin: bool = False, index: int = 0) -> None:
        self.layout, self.tokenizer, self.executor = layout, tokenizer, executor
        self.steps, self.spin, self.index = steps, spin, index
        self.lane = layout.lanes[index]
        self.matchers: dict[int, object] = {}
        self.failed: set[int] = set()  # matchers the library refused to make
        self.taken = 0  # the last step whose fill was taken
        self.messages = 0  # messages acted on: each may make or drop a matcher
        # The last filled step whose ids are not taken yet: (step, ids, rows, and the
        # fill's live matchers with their rows, as of `messages` then)
        self.pending: tuple[int, np.ndarray, np.ndarray, list, int] | None = None
        # What the last feed left: its ids and rows, the matchers that took their token
        # and go on (with their rows), as of `messages` then. The next fill of the same
        # rows masks those without asking every matcher again (the asking, row by row in
        # Python, was ~0.3 of the ~1.4 ms a 256-row JSON step's fill and feed took on an
        # H200's host).
        self.live: tuple[np.ndarray, np.ndarray, list, int] | None = None

    def run(self) -> None:
        """One thread: a second would wait for the GIL behind the watch on the counters (up
        to the interpreter's 5 ms switch interval a turn)."""
        header, active = self.layout.header, time.monotonic()
        while True:
            pending = self.pending
            if pending is not None and header[TOKENS_STAMP] >= pending[0]:
                self.feed(*pending)
            elif header[FILLS] > self.taken:
                while self.steps.poll(0):  # the messages sent before the fill
                    if not self.receive():
                        return
                self.fill(self.taken + 1)
            else:
                idle = time.monotonic() - active > IDLE_S
                if self.spin and not idle:
                    time.sleep(0)
                    wait = 0.0
                else:
                    wait = IDLE_POLL_S if idle else POLL_S
                if self.steps.poll(wait) and not self.receive():
                    return
                continue
            active = time.monotonic()

    def receive(self) -> bool:
        """Act on one message; False once the pipe is closed."""
        try:
            kind, *args = self.steps.recv()
        except EOFError:
            return False
        self.messages += 1
        if kind == "make":
            self.make(*args)
        elif kind == "drop":
            for matcher_id in args[0]:
                self.matchers.pop(matcher_id, None)
                self.failed.discard(matcher_id)
        return True

    def make(self, matcher_id: int, grammar: str) -> None:
        """A matcher (0.2-1.3 ms, more for a large grammar) for a checked grammar."""
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        except Exception:
            matcher = None
        if matcher is None or matcher.is_error():
            self.failed.add(matcher_id)
        else:
            self.matchers[matcher_id] = matcher

    def fill(self, step: int) -> None:
        """Masks of this worker's rows of `step` as its request says: the masked rows by
        their matchers, a finished or failed matcher's (whose token is discarded with its
        sequence) allowing every token, and (worker 0) the step's rows no matcher masks
        allowing every token. The step before is fed first if it was published (its ids
        may still be on their way), else dropped."""
        layout = self.layout
        slot = step % FILL_SLOTS
        rows, count, published = (int(v) for v in layout.requests[slot])
        ids = layout.request_ids[slot, :count]
        masked = layout.request_rows[slot, :count]
        free = np.zeros(rows, dtype=bool)
        if self.index == 0:
            free[:] = True
            free[masked] = False
        mine = ids % layout.workers == self.index  # copies: the loop may rewrite the slot
        ids, masked = ids[mine], masked[mine]
        self.taken = step
        self.lane[FILLS_TAKEN] = step  # the slot is free again (once every lane took it)
        pending = self.pending
        if pending is not None:
            if pending[0] > published or not self._await_stamp(pending[0]):
                self.pending = None
            else:
                self.feed(*pending)
        pairs = self._live_pairs(ids, masked)
        if len(pairs) < len(masked):
            free[masked] = True
            free[[row for _, row in pairs]] = False
        layout.masks[:rows][free] = -1
        if pairs:
            self.executor.unsafe_compute_mask_ptr(
                pairs, layout.masks.__array_interface__["data"][0], 4 * layout.words,
                layout.rows)
        self.lane[MASKS_READY] = step
        self.pending = (step, ids, masked, pairs, self.messages)

    def _live_pairs(self, ids: np.ndarray, rows: np.ndarray) -> list[tuple[object, int]]:
        """The matchers of `ids` that go on (neither finished nor failed), with their rows."""
        live = self.live
        if (live is not None and live[3] == self.messages and np.array_equal(live[0], ids)
                and np.array_equal(live[1], rows)):
            return live[2]
        pairs = []
        for matcher_id, row in zip(ids.tolist(), rows.tolist()):
            matcher = self.matchers.get(matcher_id)
            if matcher is not None and not matcher.is_stopped() and not matcher.is_error():
                pairs.append((matcher, row))
        return pairs

    def _await_stamp(self, step: int) -> bool:
        """Whether the device published `step`'s ids within TOKENS_WAIT_S (if not, `fed`
        stays behind: the loop gives up on this worker)."""
        deadline = time.monotonic() + TOKENS_WAIT_S
        while self.layout.header[TOKENS_STAMP] < step:
            if time.monotonic() > deadline:
                return False
            time.sleep(0)
        return True

    def feed(self, step: int, ids: np.ndarray, rows: np.ndarray,
             pairs: list[tuple[object, int]] | None = None, messages: int = -1) -> None:
        """Each of this worker's rows' sampled id (published) to its matcher. `pairs`: the
        step's fill's live matchers and rows, as of `messages` (when every row had one and
        no message came since, they are the matchers to feed)."""
        self.pending = None
        layout = self.layout
        tokens = layout.tokens
        verdicts = layout.verdicts[step % 2]
        ids, rows = np.asarray(ids, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        if not (pairs is not None and messages == self.messages and len(pairs) == len(ids)):
            pairs = []  # the matchers to feed, with their rows
            for matcher_id, row in zip(ids.tolist(), rows.tolist()):
                matcher = self.matchers.get(matcher_id)
                if matcher is None:
                    verdicts[row] = FAILED if matcher_id in self.failed else TAKEN
                elif matcher.is_stopped():  # finished a step before: its row was not masked
                    verdicts[row] = STOPPED
                else:
                    pairs.append((matcher, row))
        fed_rows = [row for _, row in pairs]
        feeding = [(matcher, token) for (matcher, _), token
                   in zip(pairs, tokens[fed_rows].tolist())]
        if len(feeding) >= FEED_PAR_ROWS:
            taken = self.executor.consume_token_par(feeding)
        else:
            taken = [matcher.consume_token(token) for matcher, token in feeding]
        said = [REFUSED if not took else STOPPED if matcher.is_stopped() else TAKEN
                for (matcher, _), took in zip(pairs, taken)]
        verdicts[fed_rows] = said
        self.live = (ids, rows, [pair for pair, v in zip(pairs, said) if v == TAKEN],
                     self.messages)
        if (verdicts[rows] != TAKEN).any():
            self.lane[NOTED + step % 2] = step
        self.lane[FED] = step
