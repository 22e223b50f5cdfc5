"""Prompt-lookup speculation: draft the next tokens from text the conversation already holds.

A reply often repeats what came before it: code being edited, a quoted
source, JSON filled from the prompt, a small model's own loops. The drafter
looks the last n tokens (n = 3, 2, 1) up in the request's ``prediction``
(OpenAI's Predicted Outputs), then in the prompt and the reply so far, most
recent occurrence first, and proposes the tokens that followed. The decode
loop checks them with one ``Runner.verify`` and keeps those its sampler
would have chosen anyway, so speculation changes speed, never text.

How many to draft is a bet: a verify over r rows costs ``Costs.relative``
one-token steps (measured on this machine, ``measure``), and each draft is
accepted with a probability the drafter estimates from its recent hits.
It drafts the length with the most expected tokens per unit of cost, which
is none at all where nothing matches or acceptance has fallen too low,
except from an explicit prediction: that is drafted from the first token of
the reply, and at least one token of it whenever the reply matches it, so
that evidence keeps coming and a low estimate can rise again.
"""
import time
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

MAX_DRAFT = 7  # a verify of 8 rows: 1.8 one-row steps at 1B with the block kernels (AMX path), more with AVX2
NGRAMS = (3, 2, 1)
# A draft's kind: 0 where the reply still follows the previous draft's source, else 1 + NGRAMS.index(n) for
# a match of the last n tokens. Longer matches are right more often; each kind keeps its own evidence,
# starting from PRIOR_ACCEPTANCE as if PRIOR_WEIGHT drafts had been seen.
PRIOR_ACCEPTANCE = (0.7, 0.6, 0.4, 0.25)
PRIOR_WEIGHT = 2.0
DECAY = 0.98  # per token: evidence fades back to the prior, so after a run of misses a kind is tried again
# A draft must promise this many times a plain step's tokens per unit of cost: the costs are measured at a
# short context (attention, which rows pay one by one, grows with it) and a verify has overheads of its own.
MIN_GAIN = 1.1
AUTO_ACCEPTANCE = 0.5  # --speculate auto turns speculation on where a draft pays at this acceptance
# A measurement is steady where each verify size's two fastest timings agree within STEADY and a larger verify
# never took less than a smaller one by more than that. A busy machine gives neither: on a 2-core Zen 5, a first
# start beside other work remembered a verify of 8 rows at 1.0 one-row steps (quiet: 1.63-1.75), and from then
# on four streams drafted every step, 2,046 tokens for 408 accepted, at 0.76x the tokens/s of no drafts.
# Until steady the rounds go on, up to MAX_ROUNDS or UNSTEADY_BUDGET times the budget; a measurement that never
# settles is not remembered, and under --speculate auto turns no drafts on (build.speculation).
STEADY = 0.1
MAX_ROUNDS = 20
UNSTEADY_BUDGET = 10
# The prompt a verify's costs are measured after (``measure``; build.sample_ids renders it).
SAMPLE_CHAT = [
    {"role": "user", "content": "Explain in a few sentences why the sky is blue, and why sunsets are red."},
    {"role": "assistant", "content": (
        "Sunlight holds every color. As it crosses the atmosphere, molecules of nitrogen and oxygen scatter "
        "short wavelengths, blue and violet, far more strongly than long ones: this is Rayleigh scattering. "
        "The scattered blue light reaches our eyes from every direction, so the whole sky looks blue. At sunset "
        "the light travels through much more air before it reaches us, most of the blue is scattered away on "
        "the way, and the reds and oranges that remain color the sky near the sun.")},
]


@dataclass(frozen=True)
class Costs:
    """relative[r - 1]: seconds of a verify over r rows divided by those of a one-token decode step.
    ``steady``: whether the timings agreed (STEADY); a measurement that did not is not remembered."""

    relative: tuple[float, ...]
    steady: bool = True

    def __post_init__(self):
        # A verify of more rows reads the same weights and does more work: never cheaper than fewer rows, nor
        # than one step. A timing that says otherwise is noise (a start on a busy machine); kept, it would make
        # every draft look free.
        object.__setattr__(self, "relative", tuple(float(r) for r in np.maximum.accumulate(np.maximum(self.relative, 1.0))))

    def best_draft(self, acceptance: float, available: int, generations: int = 1) -> int:
        """The draft length with the most tokens per unit of cost, if that beats a plain step by MIN_GAIN: a
        verify of k drafts yields 1 + a + ... + a^k tokens on average when each is accepted with probability a.

        In a step shared by ``generations`` generations (scheduler.py), one row each, k drafts add rows
        generations + 1 .. generations + k to it, at what those rows add to a forward (``rows``), against this
        generation's share of the step, rows(generations) / generations: a draft must promise more there, the
        more so where a lone step's extra rows came nearly free (memory-bound) and a shared step's do not."""
        share = self.rows(generations) / generations
        best, best_rate = 0, MIN_GAIN
        for k in range(1, min(available, len(self.relative) - 1) + 1):
            added = self.rows(generations + k) - self.rows(generations)
            rate = sum(acceptance**i for i in range(k + 1)) / (1 + added / share)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def rows(self, count: int) -> float:
        """One-row steps a forward of ``count`` one-token rows costs: relative[count - 1], past the table its
        last row's cost again for each further row."""
        if count <= len(self.relative):
            return self.relative[count - 1]
        last = self.relative[-1] - self.relative[-2] if len(self.relative) > 1 else self.relative[-1]
        return self.relative[-1] + (count - len(self.relative)) * last

    def pays(self) -> bool:
        """Whether some draft length beats plain steps at AUTO_ACCEPTANCE (``--speculate auto``)."""
        return self.best_draft(AUTO_ACCEPTANCE, MAX_DRAFT) > 0


MEASURED_ROWS = (1, 2, 4, MAX_DRAFT + 1)  # verify sizes timed; the others interpolated


def measure(runner, ids: list[int], repeats: int = 5, budget_s: float = 0.25) -> Costs:
    """Verify times over 1..MAX_DRAFT + 1 rows after a prompt of ids, relative to one row's: the sizes in
    MEASURED_ROWS timed, those between interpolated (a verify's cost grows about linearly with its rows).
    ``measuring`` does the work, a round at a time; this runs it through.

    The sizes take turns, ``repeats`` rounds (fewer, but two, once the rounds have taken ``budget_s``: a large
    model's timings vary less), and each keeps its fastest time: on a shared machine a neighbour only ever
    adds time, and a slow moment falls on every size alike instead of on one. So does a first call's cold
    start (a CUDA graph's capture, say): the fastest of two needs no warm-up round of its own, and the runner
    has had one before (``build.warm_up``). Where the timings are not ``steady`` after those rounds (a neighbour
    busy through all of them), more rounds follow until they are, or until UNSTEADY_BUDGET times the budget
    or MAX_ROUNDS rounds have passed. Every later start drafts by what was measured steadily
    (``build.speculation`` remembers it), and a median of two timings per size, one size after another, put
    a 2-row verify at 1.12 to 1.36 steps on one machine. (A round of the 1B's four sizes takes about 0.19 s
    on two AMD Zen 3 cores; across first starts there, its costs varied as much with a warm-up round as
    without one.)"""
    rounds = measuring(runner, ids, repeats, budget_s)
    while True:
        try:
            next(rounds)
        except StopIteration as done:
            return done.value


def measuring(runner, ids: list[int], repeats: int = 5, budget_s: float = 0.25) -> Generator[None, None, Costs]:
    """``measure``'s work in pieces: it yields before each round (after the prompt's prefill), so that its
    caller may do other work between them (the engine serves requests), and returns the costs."""
    cache = runner.new_cache()
    runner.forward(ids, cache)
    start = len(ids)  # what the cache now holds: a Runner's caches need not say (transformers' do not)
    timings: list[list[float]] = [[] for _ in MEASURED_ROWS]
    spent = 0.0  # in the rounds themselves, not in what the caller did between them
    for round_ in range(1, MAX_ROUNDS + 1):
        yield
        began = time.perf_counter()
        for i, rows in enumerate(MEASURED_ROWS):
            runner.truncate(cache, start)
            timed = time.perf_counter()
            float(runner.verify(ids[:rows], cache)[-1, 0])  # read back, as the loop does: CUDA runs asynchronously
            timings[i].append(time.perf_counter() - timed)
        spent += time.perf_counter() - began
        enough = round_ >= repeats or (round_ >= 2 and spent > budget_s)
        if enough and (steady(timings) or spent > UNSTEADY_BUDGET * budget_s):
            break
    fastest = [min(t) for t in timings]
    relative = np.interp(np.arange(1, MAX_DRAFT + 2), MEASURED_ROWS, fastest) / fastest[0]
    return Costs(tuple(round(float(r), 3) for r in relative), steady(timings))


def steady(timings: list[list[float]]) -> bool:
    """Whether each size's two fastest timings agree within STEADY, and no larger verify's fastest is below a
    smaller one's by more than that (``timings[i]``: those of MEASURED_ROWS[i] rows)."""
    pairs = [sorted(t)[:2] for t in timings]
    agree = all(len(p) == 2 and p[1] <= p[0] * (1 + STEADY) for p in pairs)
    return agree and all(later[0] >= earlier[0] * (1 - STEADY) for earlier, later in zip(pairs, pairs[1:]))


class Drafter:
    """Proposes drafts for one request and learns how often they are accepted.

    ``context``: the prompt's ids; ``append`` adds each token of the reply.
    ``prediction``: ids of text the reply is expected to repeat.

    Each source keeps, per n-gram length, where each n-gram's latest occurrence that some token follows
    ends, updated as tokens come: a lookup costs the same at the 2,000th token of a chat as at the first.
    """

    def __init__(self, costs: Costs, context: list[int], prediction: list[int]):
        self.costs = costs
        self.tokens = list(context)  # prompt then reply
        self.prompt_length = len(context)
        self.prediction = list(prediction)
        self.in_context = [_latest_ends(self.tokens, n) for n in NGRAMS]
        self.in_prediction = [_latest_ends(self.prediction, n) for n in NGRAMS]
        self.accepted = np.zeros(len(PRIOR_ACCEPTANCE))  # evidence per kind, decayed
        self.missed = np.zeros(len(PRIOR_ACCEPTANCE))
        self.follow: tuple[bool, int] | None = None  # (from the prediction?, end) of the last draft, to continue it
        self.kind = 0  # of the last draft

    def append(self, token: int) -> None:
        end = len(self.tokens)
        for n, latest in zip(NGRAMS, self.in_context):  # the n-grams ending here now have a follower
            if end >= n:
                latest[tuple(self.tokens[end - n :])] = end
        self.tokens.append(token)
        self.accepted *= DECAY
        self.missed *= DECAY

    def observe(self, accepted: int, drafted: int) -> None:
        """The last draft's verify kept ``accepted`` of its ``drafted`` tokens (the first rejection ends it)."""
        self.accepted[self.kind] += accepted
        self.missed[self.kind] += accepted < drafted

    def acceptance(self, kind: int) -> float:
        """Estimated probability that each token of a draft of this kind is accepted."""
        prior = PRIOR_ACCEPTANCE[kind] * PRIOR_WEIGHT
        return (self.accepted[kind] + prior) / (self.accepted[kind] + self.missed[kind] + PRIOR_WEIGHT)

    def propose(self, limit: int, generations: int = 1) -> list[int]:
        """Up to ``limit`` tokens to verify after the last one; none when nothing matches or drafting
        would not pay at the acceptance estimated for the match found, in a step of this many generations."""
        found = self._continuation() or self._lookup()
        self.follow = None
        if found is None:
            return []
        self.kind, predicted, end = found
        source = self.prediction if predicted else self.tokens
        available = min(limit, len(source) - end)
        k = self.costs.best_draft(self.acceptance(self.kind), available, generations)
        if predicted:  # what the client said the reply holds: always worth a token's test
            k = max(k, min(1, available))
        if k == 0:
            return []
        self.follow = (predicted, end + k)
        return source[end : end + k]

    def _continuation(self) -> tuple[int, bool, int] | None:
        """Where the previous draft left off, if the reply has followed its source up to there: repeated
        n-grams (every "return" in a function) would otherwise send the draft to the wrong copy. Before any
        draft, the prediction itself while the reply so far is its beginning."""
        if self.follow is None:
            replied = len(self.tokens) - self.prompt_length
            if 0 < replied < len(self.prediction) and self.prediction[:replied] == self.tokens[self.prompt_length :]:
                return 0, True, replied
            return None
        predicted, end = self.follow
        source = self.prediction if predicted else self.tokens
        n = min(NGRAMS[0], end)
        if end < len(source) and source[end - n : end] == self.tokens[-n:]:
            return 0, predicted, end
        return None

    def _lookup(self) -> tuple[int, bool, int] | None:
        """(kind, from the prediction?, end) of the latest occurrence of the reply's last n tokens, longest n
        first, in the prediction before the context."""
        for kind, (n, in_prediction, in_context) in enumerate(zip(NGRAMS, self.in_prediction, self.in_context), start=1):
            if len(self.tokens) < n:
                continue
            pattern = tuple(self.tokens[-n:])
            for predicted, latest in ((True, in_prediction), (False, in_context)):
                if (end := latest.get(pattern)) is not None:
                    return kind, predicted, end
        return None


def _latest_ends(tokens: list[int], n: int) -> dict[tuple[int, ...], int]:
    """Each n-gram of tokens -> the end of its last occurrence that some token follows (an occurrence at the
    very end has nothing to propose)."""
    followed = len(tokens) - n  # occurrences starting before this have a follower
    if followed <= 0:
        return {}
    grams = zip(*(tokens[j : j + followed] for j in range(n)))
    return dict(zip(grams, range(n, len(tokens))))  # a later occurrence overwrites an earlier one
