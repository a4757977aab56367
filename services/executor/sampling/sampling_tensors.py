"""One step's sampling parameters: each request's normalized once (`RequestSampling`), the
step's rows packed into device tensors with host-side flags (`SamplingTensors`) that let the
sampler skip the rungs no row needs (sampler.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llmbus.bus.messages import SamplingParams
from llmbus.services.executor.sampling.penalties import Penalties

_GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class RequestSampling:
    """One request's sampling parameters, normalized once when it arrives."""

    temperature: float  # 0 = greedy
    top_p: float  # 1 = off
    min_p: float  # 0 = off
    top_k: int  # 0 = off
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float  # 1 = off
    min_tokens: int
    min_tokens_banned_ids: tuple[int, ...]  # eos ids and stop ids, until min_tokens
    bias_token_ids: tuple[int, ...]
    bias_values: tuple[float, ...]
    num_logprobs: int | None

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Sequence[int] = (),
                    vocab_size: int | None = None) -> RequestSampling:
        """Out-of-range values mean "off"; token ids outside the vocabulary are dropped.

        Like vLLM, min_tokens bans the model's eos ids even with ignore_eos.
        """
        def in_vocab(token_id: int) -> bool:
            return token_id >= 0 and (vocab_size is None or token_id < vocab_size)

        temperature = params.temperature if params.temperature >= _GREEDY_BELOW else 0.0
        bias = {t: b for t, b in params.logit_bias.items() if in_vocab(t) and b != 0.0}
        banned = sorted({t for t in (*eos_token_ids, *params.stop_token_ids) if in_vocab(t)})
        repetition = params.repetition_penalty if params.repetition_penalty > 0 else 1.0
        return cls(
            temperature=temperature, top_p=min(1.0, max(0.0, params.top_p)),
            min_p=min(1.0, max(0.0, params.min_p)), top_k=max(0, params.top_k),
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, repetition_penalty=repetition,
            min_tokens=max(0, params.min_tokens),
            min_tokens_banned_ids=tuple(banned) if params.min_tokens > 0 else (),
            bias_token_ids=tuple(bias), bias_values=tuple(bias.values()),
            num_logprobs=params.logprobs)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass
class SamplingTensors:
    """One step's per-row sampling parameters as device tensors; rows are sequences that sample.

    The optional index tensors list only the rows (and token ids) a rung touches.
    """

    temperature: torch.Tensor  # [S] float32; 0 = greedy
    top_k: torch.Tensor  # [S] int64; 0 = off
    top_p: torch.Tensor  # [S] float32; 1 = off
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # `build` fills the fields below; made by hand (the kernel benchmark does), an instance
    # derives them from the ones above in __post_init__, reading the tensors once.
    min_p: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [S]; 0 = off
    any_min_p: bool = False
    max_top_k: int = -1
    greedy: list[bool] = field(default_factory=list)  # [S] on the host, like the flags
    truncated: list[bool] = field(default_factory=list)  # [S] sampled with top-k/p or min-p
    top_p_only_rows: list[int] = field(default_factory=list)  # sampled, top-p and no top-k
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids (min_tokens)
    penalties: Penalties | None = None

    def __post_init__(self) -> None:
        if self.max_top_k >= 0:
            return
        if self.min_p.numel() != self.top_p.numel():
            self.min_p = torch.zeros_like(self.top_p)
        self._set_host_rows(self.temperature.tolist(), self.top_k.tolist(),
                            self.top_p.tolist(), self.min_p.tolist())

    def _set_host_rows(self, temperature: list[float], top_k: list[int], top_p: list[float],
                       min_p: list[float]) -> None:
        rows = list(zip(temperature, top_k, top_p, min_p, strict=True))
        self.max_top_k = max(top_k, default=0)
        self.any_min_p = any(m > 0.0 for m in min_p)
        self.greedy = [t == 0.0 for t in temperature]
        self.truncated = [t > 0.0 and (k > 0 or p < 1.0 or m > 0.0) for t, k, p, m in rows]
        self.top_p_only_rows = [i for i, (t, k, p, _) in enumerate(rows)
                                if t > 0.0 and k == 0 and p < 1.0]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu",
                    *, eos_token_ids: Sequence[int] = (), vocab_size: int | None = None,
                    num_output_tokens: Sequence[int] | None = None,
                    penalty_counts: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> SamplingTensors:
        requests = [RequestSampling.from_params(p, eos_token_ids, vocab_size) for p in params]
        return cls.build(requests, device, num_output_tokens=num_output_tokens,
                         penalty_counts=penalty_counts)

    @classmethod
    def build(cls, requests: Sequence[RequestSampling], device: torch.device | str = "cpu",
              *, num_output_tokens: Sequence[int] | None = None,
              penalty_counts: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> SamplingTensors:
        """Pack one step's rows. num_output_tokens[i]: tokens row i sampled so far (default 0).

        penalty_counts: (token_ids [P, L], output_counts [P, L]) from TokenCounts.gather for
        the rows with penalties, in row order; required when any row has one.
        """
        num_output_tokens = num_output_tokens or [0] * len(requests)
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        penalty_rows: list[int] = []
        for row, (r, num_output) in enumerate(zip(requests, num_output_tokens, strict=True)):
            if r.bias_token_ids:
                bias_rows += [row] * len(r.bias_token_ids)
                bias_ids += r.bias_token_ids
                bias_values += r.bias_values
            if num_output < r.min_tokens and r.min_tokens_banned_ids:
                banned_rows += [row] * len(r.min_tokens_banned_ids)
                banned_ids += r.min_tokens_banned_ids
            if r.has_penalties:
                penalty_rows.append(row)
        values = torch.tensor(  # [S, 7], one host-to-device copy
            [(r.temperature, r.top_p, r.min_p, r.top_k, r.presence_penalty,
              r.frequency_penalty, r.repetition_penalty) for r in requests],
            dtype=torch.float32, device=device).reshape(-1, 7)
        temperature, top_p, min_p, top_k, presence, frequency, repetition = values.unbind(1)

        def ids(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        penalties = None
        if penalty_rows:
            if penalty_counts is None:
                raise ValueError("rows with penalties need their penalty_counts")
            rows = ids(penalty_rows)
            penalties = Penalties(rows, presence[rows], frequency[rows], repetition[rows],
                                  *penalty_counts)
        tensors = cls(
            temperature=temperature, top_k=top_k.long(), top_p=top_p, min_p=min_p,
            all_greedy=all(r.temperature == 0.0 for r in requests),
            any_top_k=any(r.top_k > 0 for r in requests),
            any_top_p=any(r.top_p < 1.0 for r in requests), max_top_k=0,
            bias=(ids(bias_rows), ids(bias_ids), torch.tensor(
                bias_values, dtype=torch.float32, device=device)) if bias_rows else None,
            banned=(ids(banned_rows), ids(banned_ids)) if banned_rows else None,
            penalties=penalties)
        tensors._set_host_rows([r.temperature for r in requests], [r.top_k for r in requests],
                               [r.top_p for r in requests], [r.min_p for r in requests])
        return tensors
