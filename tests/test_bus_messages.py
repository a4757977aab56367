"""The wire format is the field order of each message: pin it."""

from __future__ import annotations

import msgspec
import pytest

from bus import messages as m
from bus.codec import decode, encode

PARAMS = m.SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"])

EXAMPLES = [
    PARAMS,
    m.GenerateRequest(request_id="r1", reply_subject="api.x", model="m", params=PARAMS,
                      messages=[m.ChatMessage(role="user", content="hi")]),
    m.Admission(num_prompt_tokens=3),
    m.Admission(error_code=m.ErrorCode.CONTEXT_LENGTH_EXCEEDED, error_message="too long",
                error_param="messages"),
    m.SubmitRequest(request_id="r1", reply_subject="api.x", prompt_token_ids=[1, 2],
                    params=PARAMS, arrival_time=1.5),
    m.StepPlan(step_id=3, new_requests=[m.NewRequestData("r1", [1, 2], PARAMS)],
               scheduled=[m.ScheduledRequest("r1", 0, 2, [5], True)],
               finished_request_ids=["r0"], preempted_request_ids=["r9"]),
    m.StepResult(step_id=3, sampled_token_ids=[42], forward_seconds=0.01, batch_size=1,
                 num_tokens=2),
    m.TokenBatch(engine_id="e0", items=[m.RequestTokens(
        request_id="r1", reply_subject="api.x", new_token_ids=[42],
        finish_reason=m.FinishReason.STOP, num_prompt_tokens=2, stop=["x"])]),
    m.DeltaBatch(items=[m.TextDelta(request_id="r1", text="hé", num_new_tokens=1)]),
    m.ExecutorInfo(model_name="m", max_model_len=8192, num_blocks=100, block_size=16,
                   eos_token_ids=[2], vocab_size=49152),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(message):
    assert decode(encode(message), type(message)) == message


def test_field_order_is_the_wire_format():
    # Array-like: positional, in declaration order. Changing this breaks running peers.
    assert msgspec.msgpack.decode(encode(m.ScheduledRequest("r1", 4, 1))) == [
        "r1", 4, 1, [], True]
    assert msgspec.msgpack.decode(encode(m.Admission(num_prompt_tokens=7))) == [
        7, 0, "", None, ""]
    assert encode(m.AbortRequest("r1")).hex() == "92a27231c0"


def test_schema_mismatch_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        decode(encode(m.AbortRequest("r1")), m.StepResult)
