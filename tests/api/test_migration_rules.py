"""The rules migration rests on, stage by stage, without a bus: an engine resumes a request from
the tokens already streamed, a later attempt supersedes an earlier one and a stale one is
refused or dropped everywhere, a lost token batch is noticed where it would have fitted, and
the api judges each delta by what its client already has (services/api/migration.py)."""

from __future__ import annotations

import asyncio

import pytest

from llmbus.bus.messages import (
    CompletionStart,
    FinishReason,
    GenerateRequest,
    RequestTokens,
    ResumedCompletion,
    SamplingParams,
    TextDelta,
    TokenBatch,
)
from llmbus.services.api.migration import Placement, Verdict
from llmbus.services.detokenizer.detokenization import Detokenization
from llmbus.services.scheduler.admission import AdmissionError
from tests.gguf_fixtures import tiny_tokenizer
from tests.scheduler.sim import make, run_step

PROMPT = list(range(10, 15))


def test_an_engine_resumes_a_completion_from_the_tokens_it_streamed():
    s = make()
    s.add_request("r", "api.x", PROMPT, SamplingParams(max_tokens=6), attempt=1,
                  resumed=[ResumedCompletion(0, [7, 8])])
    plan, updates = run_step(s, token=9)
    [new] = plan.new_requests
    assert new.sequence_id == "r~1" and new.output_token_ids == [7, 8]  # its own sequence
    assert plan.scheduled[0].num_tokens == len(PROMPT) + 2  # the prompt and its output again
    [update] = updates
    assert update.new_token_ids == [9] and update.num_before == 2 and update.attempt == 1
    assert update.start.replay_token_ids == [7, 8]  # its new detokenizer decodes them silently
    for _ in range(3):
        *_, [update] = run_step(s, token=9)
    assert update.finish_reason == FinishReason.LENGTH  # max_tokens counts the resumed two
    s.check_invariants()


def test_a_resumed_completion_that_had_ended_ends_at_once():
    """Only the message saying it ended was lost: nothing more is sampled."""
    s = make()
    s.add_request("r", "api.x", PROMPT, SamplingParams(max_tokens=2), attempt=1,
                  resumed=[ResumedCompletion(0, [7, 8])])
    [update] = s.take_ended_updates()
    assert update.finish_reason == FinishReason.LENGTH and update.new_token_ids == []
    assert not s.has_work


def test_a_later_attempt_supersedes_and_a_stale_one_is_refused():
    s = make()
    s.add_request("r", "api.x", PROMPT, SamplingParams(max_tokens=8))
    run_step(s)
    s.add_request("r", "api.x", PROMPT, SamplingParams(max_tokens=8), attempt=1,
                  resumed=[ResumedCompletion(0, [7])])
    [ended] = s.take_ended_updates()
    assert (ended.attempt, ended.finish_reason) == (0, FinishReason.ABORT)
    assert [r.attempt for r in s.table] == [1]
    with pytest.raises(AdmissionError, match="stale"):
        s.add_request("r", "api.x", PROMPT, SamplingParams(max_tokens=8), attempt=0)
    assert not s.abort_request("r", up_to_attempt=0)  # the migration's abort spares attempt 1
    assert s.abort_request("r")  # the client's reaches every attempt
    s.check_invariants()


def _item(ids: list[int], before: int, attempt: int = 0, start: bool = False,
          finish: FinishReason = FinishReason.NONE) -> RequestTokens:
    return RequestTokens(
        request_id="r", new_token_ids=ids, num_before=before, attempt=attempt,
        finish_reason=finish,
        start=CompletionStart(reply_subject="api", replay_token_ids=[]) if start else None)


def test_the_detokenizer_drops_stale_attempts_and_ends_a_completion_missing_a_batch():
    tok = tiny_tokenizer()
    detok = Detokenization(tok, "d1")
    ids = tok.encode("hello world again")
    first = detok.process(TokenBatch(engine_id="e", items=[_item(ids[:1], 0, start=True)]))
    assert first.deltas["api"][0].detokenizer_id == "d1"
    # ids[1:2] was lost on the way: the next batch does not follow what the copy holds.
    gap = detok.process(TokenBatch(engine_id="e", items=[_item(ids[2:3], 2)]))
    [delta] = gap.deltas["api"]
    assert (delta.finish_reason, delta.resumable) == (FinishReason.ERROR, True)
    assert delta.num_output_tokens == 1  # what the api may resume from
    late = detok.process(TokenBatch(engine_id="e", items=[_item(ids[3:], 3)]))
    assert late.deltas == {} and late.unknown == []  # that attempt is over here
    # The api resumed it as attempt 1 (a start that replays the one token it has) ...
    resumed = _item(ids[1:2], 1, attempt=1)
    resumed.start = CompletionStart(reply_subject="api", replay_token_ids=ids[:1])
    out = detok.process(TokenBatch(engine_id="e", items=[resumed]))
    assert [d.attempt for d in out.deltas["api"]] == [1]
    # ... and attempt 0's engine, back from a partition, flushes what it had: dropped.
    stale = detok.process(TokenBatch(engine_id="e", items=[_item(ids[4:], 4)]))
    assert stale.deltas == {} and stale.unknown == []


def _placement(n: int = 1, adapter: str = "") -> Placement:
    request = GenerateRequest(request_id="r", reply_subject="api", model="m",
                              params=SamplingParams(max_tokens=8, adapter=adapter), prompt="p",
                              n=n)
    return Placement(request, asyncio.Queue())


def _delta(ids: list[int], total: int, attempt: int = 0, index: int = 0,
           finish: FinishReason = FinishReason.NONE, resumable: bool = False) -> TextDelta:
    return TextDelta(request_id="r", text="x", token_ids=ids, num_output_tokens=total,
                     attempt=attempt, index=index, finish_reason=finish,
                     error="e" if resumable else "", resumable=resumable)


def test_the_api_forwards_what_follows_and_resumes_from_what_its_client_has():
    placement = _placement(adapter="tuned")
    assert placement.judge(_delta([1, 2], 2)) is Verdict.FORWARD
    assert placement.judge(_delta([5], 5)) is Verdict.RESUME  # tokens 3 and 4 were lost
    request = placement.next_attempt(avoid_instance_id="s1")
    assert (request.attempt, request.avoid_instance_id) == (1, "s1")
    assert request.resumed == [ResumedCompletion(0, [1, 2])]
    assert request.params.adapter == "tuned"  # the other engine runs the same LoRA adapter
    assert placement.judge(_delta([3], 3)) is Verdict.STALE  # attempt 0, flushed late
    assert placement.judge(_delta([3], 3, attempt=1)) is Verdict.FORWARD
    error = _delta([], 3, attempt=1, finish=FinishReason.ERROR, resumable=True)
    assert placement.judge(error) is Verdict.RESUME  # an engine failed it: resume again
    assert placement.next_attempt().resumed == [ResumedCompletion(0, [1, 2, 3])]
    assert placement.judge(_delta([4], 4, attempt=2, finish=FinishReason.LENGTH)) \
        is Verdict.FORWARD
    assert placement.judge(_delta([4], 4, attempt=2)) is Verdict.DUPLICATE  # it ended


def test_a_request_of_n_completions_resumes_only_those_not_finished():
    placement = _placement(n=2)
    assert placement.judge(_delta([1], 1, index=0, finish=FinishReason.STOP)) \
        is Verdict.FORWARD
    assert placement.judge(_delta([2, 3], 2, index=1)) is Verdict.FORWARD
    assert placement.next_attempt().resumed == [ResumedCompletion(1, [2, 3])]
    nothing_yet = _placement(n=2)
    assert nothing_yet.next_attempt().resumed == []  # both start afresh, as one prompt
