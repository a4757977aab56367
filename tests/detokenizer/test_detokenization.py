"""The detokenizer's pure core, directly: no bus, no model file (a tiny byte-level vocabulary
stands in)."""

from __future__ import annotations

from llmbus.bus.messages import (
    CompletionStart,
    FinishReason,
    RequestTokens,
    TokenBatch,
    TokenLogprobs,
)
from llmbus.services.detokenizer.detokenization import Detokenization
from tests.gguf_fixtures import tiny_tokenizer


def _tokens(text_ids: list[int], *, index: int = 0, finish=FinishReason.NONE,
            reply: str | None = "api", stop: tuple[str, ...] = (), traceparent: str = "",
            logprobs: list[TokenLogprobs] = (), replay: list[int] = (),
            error: str = "", before: int | None = None) -> RequestTokens:
    """A completion's tokens; with its start (its constants) unless `reply` is None. `before`:
    its tokens before these (default: those replayed)."""
    start = None if reply is None else CompletionStart(
        reply_subject=reply, stop=list(stop), traceparent=traceparent,
        replay_token_ids=list(replay))
    return RequestTokens(request_id="r", index=index, new_token_ids=text_ids,
                         finish_reason=finish, logprobs=list(logprobs), start=start,
                         error=error, num_before=len(replay) if before is None else before)


def test_detokenization_streams_each_completion_to_its_api():
    tok = tiny_tokenizer()
    detok = Detokenization(tok)
    ids = tok.encode("hello wörld")
    first = detok.process(TokenBatch(engine_id="e", items=[
        _tokens(ids[:3], index=0, reply="api.a", traceparent="00-t-s-01"),
        _tokens(ids[:2], index=1, reply="api.b")]), now_ns=10)
    assert [d.index for d in first.deltas["api.a"]] == [0]
    assert [d.index for d in first.deltas["api.b"]] == [1]  # n > 1: decoded apart
    assert first.ended == [] and first.newly_stopped == []
    last = detok.process(TokenBatch(engine_id="e", items=[
        _tokens(ids[3:], index=0, reply=None, finish=FinishReason.LENGTH, before=3)]),
        now_ns=25)
    text = "".join(d.text for d in first.deltas["api.a"] + last.deltas["api.a"])
    assert text == "hello wörld"
    [ended] = last.ended
    assert (ended.key, ended.started_ns, ended.ended_ns, ended.traceparent, ended.reason) == \
        (("r", 0), 10, 25, "00-t-s-01", FinishReason.LENGTH)
    assert ended.num_tokens == len(ids)
    assert set(detok.completions) == {("r", 1)}  # the other completion goes on


def test_a_stop_string_ends_the_completion_and_later_tokens_are_dropped():
    tok = tiny_tokenizer()
    detok = Detokenization(tok)
    ids = tok.encode("hello, world")
    out = detok.process(TokenBatch(engine_id="e", items=[_tokens(ids, stop=(", w",))]))
    [delta] = out.deltas["api"]
    assert (delta.text, delta.finish_reason) == ("hello", FinishReason.STOP)
    assert out.newly_stopped == [(("r", 0), 0)] and out.ended[0].reason == FinishReason.STOP
    late = detok.process(TokenBatch(engine_id="e", items=[_tokens(tok.encode("more"),
                                                                  reply=None)]))
    assert late.deltas == {} and late.unknown == []  # in flight when the stop was found
    confirmed = detok.process(TokenBatch(engine_id="e", items=[
        _tokens([], finish=FinishReason.ABORT, reply=None)]))
    assert confirmed.deltas == {} and ("r", 0) not in detok.stopped


def test_logprobs_carry_each_tokens_text_and_bytes():
    tok = tiny_tokenizer()
    detok = Detokenization(tok)
    [hello] = tok.encode("hello")
    smile = tok.encode("😀")
    out = detok.process(TokenBatch(engine_id="e", items=[_tokens(
        [hello, smile[0]], logprobs=[TokenLogprobs(logprob=-0.5, top_token_ids=[hello],
                                                   top_logprobs=[-0.5]),
                                     TokenLogprobs(logprob=-1.0)])]))
    first, second = out.deltas["api"][0].logprobs
    assert (first.token, first.token_bytes, first.top_tokens) == ("hello", b"hello", ["hello"])
    assert second.token_bytes == "😀".encode()[:1] and second.token == "\ufffd"


def test_tokens_of_a_completion_without_its_start_give_no_text_and_are_reported_once():
    """The batch with the start was lost: text decoded from the later tokens alone would
    miss its beginning, so none goes out; the completion is reported (once) and its end, an
    error sent with the start, reaches its api as such."""
    tok = tiny_tokenizer()
    detok = Detokenization(tok)
    ids = tok.encode("hello world")
    lost = detok.process(TokenBatch(engine_id="e", items=[_tokens(ids[2:4], reply=None)]))
    assert (lost.deltas, lost.unknown, lost.ended) == ({}, [("r", 0)], [])
    later = detok.process(TokenBatch(engine_id="e", items=[
        _tokens(ids[4:], reply=None), _tokens(ids[:1], index=1)]))
    assert later.unknown == []  # reported already
    assert [d.index for d in later.deltas["api"]] == [1]  # the other completion goes on
    failed = detok.process(TokenBatch(engine_id="e", items=[
        _tokens([], finish=FinishReason.ERROR, error="lost its start")]))
    [delta] = failed.deltas["api"]
    assert (delta.text, delta.finish_reason, delta.error) == ("", FinishReason.ERROR,
                                                              "lost its start")
    assert [e.reason for e in failed.ended] == [FinishReason.ERROR]
    assert ("r", 0) not in detok.reported and set(detok.completions) == {("r", 1)}


def test_a_start_sets_a_completion_up_afresh():
    """A copy that had the completion before it moved away (and back) holds stale state; the
    start that comes with it now, with every token so far to replay, replaces that state."""
    tok = tiny_tokenizer()
    detok = Detokenization(tok)
    ids = tok.encode("hello, world")
    first = detok.process(TokenBatch(engine_id="e", items=[_tokens(ids[:1], stop=(", w",))]))
    # ... then another copy had ids[1:3] ...
    back = detok.process(TokenBatch(engine_id="e", items=[
        _tokens(ids[3:], stop=(", w",), replay=ids[:3], finish=FinishReason.LENGTH)]))
    text = "".join(d.text for d in first.deltas["api"] + back.deltas["api"])
    assert ids[:3] == tok.encode("hello, ") and text == "hello"
    assert back.deltas["api"][-1].finish_reason == FinishReason.STOP
    assert back.ended[0].num_tokens == len(ids)
