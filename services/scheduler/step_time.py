"""Steps sized by time: a model of a step's forward time, learnt online from the executor's
answers, that caps each step's prompt tokens so that running decodes keep their cadence
("stall-free batching", Sarathi-Serve, OSDI '24).

A token budget costs the same tokens on every model and CPU, but 256 tokens take ~0.15 s of
the default model and ~2 s of a 1B one on 2 Zen 4 cores, and every decode in the step waits for
them. So each step's time is predicted from its shape,

    seconds ≈ c0 + c_rows · rows + c_tokens · tokens + c_keys · kilo_keys

(rows: sequences in the step; tokens: rows of its matmuls; kilo_keys: thousands of
query-key pairs attended, which grow with context), and while anything decodes, prompt chunks
take only what fits in `--max-step-ms`. A step that only prefills (nothing decodes) takes the
whole token budget: an idle engine's first token does not wait for the cap. Where the decodes
alone take most of the target or more (a 1B model's 8 decodes take ~150 ms against 60), a fixed
target would leave prompts a sliver, or nothing, of each step, and every step would read all the
weights for a few tokens of work; so the target is relative there: a step may take
`RELATIVE_STEP` x its decodes' own time (step_seconds), and prompt chunks keep a share of each
step in proportion to what it already costs. Whatever the prediction, a step with decodes takes
at least `PREFILL_FLOOR_TOKENS` of prompt, so new requests are admitted before the model has
learnt anything.

The fit is non-negative least squares over the last `WINDOW` steps with a prompt chunk and
the last `WINDOW` steps of decodes only, each weighted by its age in steps (`DECAY` a step,
never below `STALE_WEIGHT`), so the model follows a change (a bigger model, a busier machine)
within a few steps. Two windows, and a weight that never reaches 0, because during a long run
of decodes tokens and rows are the same numbers: only the old prompt steps then tell what a
prompt token costs apart from a decode row. For the same reason the widest prompt step seen
(the most prompt tokens beyond its rows) is kept beside the windows until one about as wide
replaces it: a long run of decodes with small chunks (a few tokens beyond the rows, within the
times' noise) fits a prompt token at ~0 as well as at its cost, and the next big chunk then
took 5x its target (issue 43: a 228-token chunk beside 7 decodes, predicted 40 ms, took 189).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from llmbus.bus.messages import StepPlan

WINDOW = 16  # observations kept per kind (steps with prompt tokens, steps of decodes only)
DECAY = 0.8  # an observation's weight is multiplied by this with every step observed after it
STALE_WEIGHT = 0.01  # ... but never below this
PREFILL_FLOOR_TOKENS = 32  # prompt tokens a step with decodes always takes, if any wait
# A step with decodes and prompt chunks may take this many times the decodes' own time, when
# that is over the target: the prompts get as much of such a step as the decodes.
RELATIVE_STEP = 2.0
# An embedding's prompt beside decodes may make their step at most this much longer than the
# decodes alone: no one streams an embedding, the streams' tokens should not wait for it.
YIELD_STRETCH = 1.4
NUM_FEATURES = 4
# The widest prompt step is replaced by a newer one at least this wide (a fresher measure of
# about the same leverage).
WIDEST_KEPT = 0.75
WIDEST_WEIGHT = 0.25  # its weight never falls below this: it is the one measure of its kind


@dataclass
class StepShape:
    """What a step's forward time depends on: rows, tokens and attended keys."""

    rows: int = 0
    tokens: int = 0
    kilo_keys: float = 0.0

    def add(self, start: int, num_tokens: int, new_row: bool = True) -> None:
        """A sequence whose tokens start..start+num_tokens are computed (each query attends
        to the keys before it and itself); `new_row=False`: more tokens of a counted one."""
        self.rows += new_row
        self.tokens += num_tokens
        self.kilo_keys += num_tokens * (start + (num_tokens + 1) / 2) / 1000

    def plus(self, start: int, num_tokens: int) -> StepShape:
        shape = StepShape(self.rows, self.tokens, self.kilo_keys)
        shape.add(start, num_tokens)
        return shape

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.rows), float(self.tokens), self.kilo_keys)

    @classmethod
    def of(cls, plan: StepPlan) -> StepShape:
        shape = cls()
        for item in plan.scheduled:
            shape.add(item.start, item.num_tokens)
        return shape


class StepTimeModel:
    """Predicts one forward's seconds from its shape, from the steps observed so far."""

    def __init__(self) -> None:
        # (features, seconds of one forward, when: the number of steps observed before it)
        self.prefill_steps: deque[tuple[tuple[float, ...], float, int]] = deque(maxlen=WINDOW)
        self.decode_steps: deque[tuple[tuple[float, ...], float, int]] = deque(maxlen=WINDOW)
        self.widest: tuple[tuple[float, ...], float, int] | None = None  # see the docstring
        self.num_observed = 0
        self.longest_context = 0  # the most keys one query of an observed step attended to
        self._coefficients: tuple[float, ...] | None = None
        self._stale = False

    def observe(self, plan: StepPlan, forward_seconds: float) -> None:
        """Learn from a step's answer. A plan of several forwards (multi-step decoding) counts
        as one forward of its decodes, its time divided by its steps; one that mixes a
        prompt chunk into several forwards is not a single shape and is skipped."""
        items = plan.scheduled
        if not items or forward_seconds <= 0:
            return
        steps = max(i.num_steps for i in items)
        if steps > 1 and any(i.num_tokens != 1 for i in items):
            return
        shape = StepShape.of(plan)
        self.longest_context = max(self.longest_context,
                                   max(i.start + i.num_tokens for i in items))
        window = self.decode_steps if shape.tokens == shape.rows else self.prefill_steps
        observation = (shape.features(), forward_seconds / steps, self.num_observed)
        window.append(observation)
        if window is self.prefill_steps and (
                self.widest is None or _width(observation) >= WIDEST_KEPT * _width(self.widest)):
            self.widest = observation
        self.num_observed += 1
        self._stale = True

    @property
    def ready(self) -> bool:
        """Whether it has seen what a prompt token costs, and a step besides."""
        return bool(self.prefill_steps) and len(self.prefill_steps) + len(self.decode_steps) >= 2

    def predict(self, shape: StepShape) -> float | None:
        """Seconds of one forward of this shape; None until `ready`."""
        if not self.ready:
            return None
        if self._stale or self._coefficients is None:
            self._coefficients = fit_non_negative(self._weighted())
            self._stale = False
        return sum(c * x for c, x in zip(self._coefficients, shape.features(), strict=True))

    def knows_context(self, context: int) -> bool:
        """Whether steps attending this far have been seen (about): beyond, the cost of the
        keys is extrapolated from shorter contexts, which the fit may have got near zero (a
        decode engine whose long prompts another engine prefilled has seen none)."""
        return context <= 1.25 * self.longest_context + 64

    def coefficients(self) -> tuple[float, ...] | None:
        """(c0, c_rows, c_tokens, c_keys) in seconds, for logs and tests; None until ready."""
        return self._coefficients if self.predict(StepShape()) is not None else None

    def _weighted(self) -> list[tuple[tuple[float, ...], float, float]]:
        weighted = [(features, seconds, max(DECAY ** (self.num_observed - 1 - when), STALE_WEIGHT))
                    for window in (self.prefill_steps, self.decode_steps)
                    for features, seconds, when in window]
        if self.widest is not None and self.widest not in self.prefill_steps:
            features, seconds, when = self.widest
            weighted.append((features, seconds,
                             max(DECAY ** (self.num_observed - 1 - when), WIDEST_WEIGHT)))
        return weighted

    def most_tokens(self, shape: StepShape, start: int, limit: int, seconds: float) -> int:
        """The most tokens, up to `limit`, of a sequence at `start` that this step can add and
        still be predicted within `seconds` (0 if none; `limit` before the model is ready)."""
        if self.predict(shape.plus(start, limit)) is None:
            return limit
        low, high = 0, limit  # predictions grow with tokens: the coefficients are >= 0
        while low < high:
            middle = (low + high + 1) // 2
            if self.predict(shape.plus(start, middle)) <= seconds:  # type: ignore[operator]
                low = middle
            else:
                high = middle - 1
        return low


class StepBudget:
    """One step's prompt tokens under the time target, filled in as the scheduler plans it.
    It starts from the step's decodes; `seconds` 0 is no target (the token budget alone)."""

    def __init__(self, model: StepTimeModel, decodes: StepShape, seconds: float) -> None:
        self.model, self.shape, self.target = model, decodes, seconds
        self.decodes = StepShape(decodes.rows, decodes.tokens, decodes.kilo_keys)  # as it began
        self.decoding = decodes.rows > 0
        # The decodes' own time (None: not known yet), and the step's time it allows.
        self.decodes_seconds = model.predict(decodes) if self.decoding and seconds else None
        self.seconds = step_seconds(seconds, self.decodes_seconds)
        self.prompt_tokens = 0  # taken so far

    def prompt_chunk(self, start: int, wanted: int, yielding: bool = False) -> int:
        """How many of `wanted` prompt tokens of a sequence at `start` this step may take.
        `yielding` (an embedding's prompt, which no one streams): only what keeps the step
        within the target and within YIELD_STRETCH of the decodes' own time, with the floor
        only where the decodes alone take the target (else it would wait for them forever)."""
        if not (self.seconds and self.decoding):
            return wanted
        decodes = self.decodes_seconds
        if yielding and decodes is not None:
            if decodes >= self.target:  # the floor only: no one streams an embedding
                return min(wanted, max(PREFILL_FLOOR_TOKENS - self.prompt_tokens, 0))
            seconds = min(self.target, YIELD_STRETCH * decodes)
            return self.model.most_tokens(self.shape, start, wanted, seconds)
        fit = self.model.most_tokens(self.shape, start, wanted, self.seconds)
        return max(fit, min(wanted, PREFILL_FLOOR_TOKENS - self.prompt_tokens))

    def take(self, start: int, num_tokens: int) -> None:
        """A prompt chunk was scheduled."""
        self.shape.add(start, num_tokens)
        self.prompt_tokens += num_tokens

    def add_drafts(self, start: int, num_drafts: int) -> None:
        """A decode (counted at the start as one token) verifies drafts too."""
        self.shape.add(start + 1, num_drafts, new_row=False)


def step_seconds(target: float, decodes_seconds: float | None) -> float:
    """The time a step with decodes may take: the target (`--max-step-ms`; 0 is none), or,
    when its decodes alone take 1 / RELATIVE_STEP of it or more, RELATIVE_STEP x their time.
    Continuous in the decodes' time, so a model near the target does not flip between two
    policies from one step to the next."""
    if not target or decodes_seconds is None:
        return target
    return max(target, RELATIVE_STEP * decodes_seconds)


def _width(observation: tuple[tuple[float, ...], float, int]) -> float:
    """Prompt tokens beyond the rows: what tells a prompt token's cost from a row's."""
    _, rows, tokens, _ = observation[0]
    return tokens - rows


def fit_non_negative(rows: list[tuple[tuple[float, ...], float, float]]) -> tuple[float, ...]:
    """Weighted least squares with every coefficient >= 0: the best of the solutions on each
    subset of the features (16 subsets of 4; the residual from the normal equations, so no
    pass over the rows per subset). Collinear subsets (decodes only: rows = tokens) are
    skipped."""
    n = NUM_FEATURES
    gram = [[0.0] * n for _ in range(n)]
    moment = [0.0] * n
    total = 0.0
    for x, y, w in rows:
        for i in range(n):
            moment[i] += w * x[i] * y
            for j in range(n):
                gram[i][j] += w * x[i] * x[j]
        total += w * y * y
    best: tuple[float, tuple[float, ...]] = (total, (0.0,) * n)  # all zero: residual y'Wy
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            solution = _solve([[gram[i][j] for j in subset] for i in subset],
                              [moment[i] for i in subset])
            if solution is None or min(solution) < 0:
                continue
            # y'Wy - 2 b'm + b'Gb, with G b = m at the solution: y'Wy - b'm
            residual = total - sum(b * moment[i] for b, i in zip(solution, subset, strict=True))
            if residual < best[0] - 1e-15:
                coefficients = [0.0] * n
                for b, i in zip(solution, subset, strict=True):
                    coefficients[i] = b
                best = (residual, tuple(coefficients))
    return best[1]


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(vector)
    a = [row[:] + [vector[i]] for i, row in enumerate(matrix)]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for column in range(n):
        pivot = max(range(column, n), key=lambda r: abs(a[r][column]))
        if abs(a[pivot][column]) <= 1e-9 * scale:
            return None
        a[column], a[pivot] = a[pivot], a[column]
        for r in range(column + 1, n):
            factor = a[r][column] / a[column][column]
            for c in range(column, n + 1):
                a[r][c] -= factor * a[column][c]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        solution[r] = (a[r][n] - sum(a[r][c] * solution[c] for c in range(r + 1, n))) / a[r][r]
    return solution
