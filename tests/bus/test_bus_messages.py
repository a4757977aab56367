# Over 300 lines: an example of every bus message and its pinned bytes, one table each.
"""The wire format is the field order of each message: every struct's bytes are pinned."""

from __future__ import annotations

import msgspec
import pytest

from llmbus.bus import messages as m
from llmbus.bus.codec import decode, encode

PARAMS = m.SamplingParams(
    temperature=0.5, top_p=0.9, top_k=40, max_tokens=8, seed=7, ignore_eos=True,
    stop_token_ids=[2], stop=["\n"], include_stop_str_in_output=True, min_p=0.05,
    presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1, min_tokens=1,
    logprobs=2, logit_bias={5: -1.0},
    structured=m.StructuredOutput(kind="regex", spec="[0-9]+", param="guided_regex"),
    pooling="mean", adapter="a1")
LOGPROBS = m.TokenLogprobs(logprob=-0.5, top_token_ids=[42, 7], top_logprobs=[-0.5, -1.5])
CHAT = m.ChatMessage(role="user", content="hi", tool_calls_json="[]", tool_call_id="c1")
START = m.CompletionStart(reply_subject="api.x", num_prompt_tokens=2, stop=["x"],
                          include_stop_str_in_output=True, traceparent="00-t-s-01",
                          replay_token_ids=[41], num_cached_tokens=3)
TOKENS = m.RequestTokens(
    request_id="r1", index=1, new_token_ids=[42], finish_reason=m.FinishReason.STOP,
    error="e", step_id=3, logprobs=[LOGPROBS], queue_seconds=0.25, start=START, attempt=1,
    num_before=4, resumable=True)
TEXT_LOGPROB = m.TextLogprob(token="h", logprob=-0.5, top_tokens=["h", "y"],
                             top_logprobs=[-0.5, -1.5], token_bytes=b"h",
                             top_token_bytes=[b"h", b"y"])
DELTA = m.TextDelta(request_id="r1", text="hé", num_new_tokens=1,
                    finish_reason=m.FinishReason.LENGTH, num_prompt_tokens=2,
                    num_output_tokens=3, error="e", step_id=3, index=1, logprobs=[TEXT_LOGPROB],
                    queue_seconds=0.25, token_ids=[42], attempt=1, resumable=True,
                    detokenizer_id="d1", embedding=b"\x00\x00\x80?", num_cached_tokens=5)
RESUMED = m.ResumedCompletion(index=1, output_token_ids=[42])
LAYOUT = m.KvLayout(dtype="float16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
DESTINATION = m.KvDestination(transfer_id="r1>1", engine_id="d0", first_block=1,
                              block_ids=[7, 8])

# One example of every message, every field set away from its default.
RECENT = m.RecentRequest(request_id="chatcmpl-1", replica="a1", created=1.5, status="finished",
                         finish_reason="stop", num_prompt_tokens=2, num_output_tokens=3,
                         ttft_seconds=0.25, seconds=0.5, trace_id="ab")
EXAMPLES = [
    PARAMS, LOGPROBS, CHAT,
    m.GenerateRequest(request_id="r1", reply_subject="api.x", model="m", params=PARAMS,
                      messages=[CHAT], prompt="p", prompt_token_ids=[1],
                      add_generation_prompt=False, n=2, tools_json="[]", attempt=1,
                      resumed=[RESUMED], avoid_instance_id="s1",
                      chat_template_kwargs_json='{"enable_thinking":false}',
                      avoid_detokenizer_ids=["d2"], continue_final_message=True),
    m.Admission(num_prompt_tokens=3, error_code=m.ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                error_message="too long", error_param="messages", scheduler_instance_id="s1",
                scheduler_reconnects=2, reasoning=True, reasoning_open=True),
    m.EncodeRequest(messages=[CHAT], prompt="p", add_generation_prompt=False,
                    add_special_tokens=False, chat_template_kwargs_json="{}", tools_json="[]",
                    continue_final_message=True),
    m.EncodeResult(token_ids=[1, 2], error_message="e"),
    m.DecodeRequest(token_ids=[1, 2]),
    m.DecodeResult(text="t", error_message="e"),
    m.CacheEvent(engine_id="e0", stored=[11], removed=[12], cleared=True, instance_id="s1"),
    m.SubmitRequest(request_id="r1", reply_subject="api.x", prompt_token_ids=[1, 2],
                    params=PARAMS, arrival_time=1.5, n=2, attempt=1, resumed=[RESUMED],
                    avoid_detokenizer_ids=["d2"]),
    RESUMED,
    m.AbortRequest(request_id="r1", index=1, up_to_attempt=2),
    m.UnknownCompletion(request_id="r1", index=1, instance_id="d1"),
    m.EngineStatsRequest(),
    m.EngineStats(engine_id="e0", num_steps=1, num_running=2, num_waiting=3, num_free_blocks=4,
                  num_total_blocks=5, max_batch_size=6, num_preemptions=7, num_finished=8,
                  num_cached_blocks=9, num_prefix_query_tokens=10, num_prefix_hit_tokens=11,
                  executor_busy_seconds=1.5, executor_idle_seconds=0.5,
                  num_evictable_blocks=12, num_draft_tokens=13, num_accepted_tokens=14,
                  num_remote_prefills=15, num_remote_fallbacks=16, kv_bytes_received=17,
                  kv_transfer_seconds=0.25, handoff_seconds=0.125, num_prefilled_for_others=18,
                  num_prefill_engines=19, kv_wait_seconds=0.75, num_generated_tokens=20),
    m.ModelInfoRequest(),
    m.ModelInfo(model_name="m", max_model_len=8192, engine_id="e0"),
    m.ExecutorInfoRequest(),
    m.ExecutorInfo(model_name="m", max_model_len=8192, num_blocks=100, block_size=16,
                   eos_token_ids=[2], vocab_size=49152, layout=LAYOUT, whole_prompts=True,
                   embed_only=True, num_shards=2, max_adapters=4),
    LAYOUT, DESTINATION,
    m.KvReceive(transfer_id="r1>1", block_ids=[7, 8], layout=LAYOUT),
    m.KvChunk(transfer_id="r1>1", block_ids=[7], first_layer=2, num_layers=3, k=b"k", v=b"v"),
    m.KvReply(error="e"),
    m.KvTransferReport(transfer_id="r1>1", num_bytes=4, seconds=0.5, error="e",
                       wait_seconds=0.25),
    m.PrefillRequest(request_id="r1", attempt=1, prompt_token_ids=[1, 2], params=PARAMS,
                     destination=DESTINATION, layout=LAYOUT, reply_subject="e.d0.prefilled",
                     traceparent="00-t-s-01"),
    m.PrefillReply(error="e"),
    m.PrefillDone(transfer_id="r1>1", token_id=42, logprobs=LOGPROBS, error="e", num_bytes=4,
                  transfer_seconds=0.5, prefill_seconds=1.5, sampled_at=2.5, wait_seconds=0.25),
    m.StructuredOutput(kind="choice", spec='["a"]', param="guided_choice", after="</think>"),
    m.GrammarRequest(structured=m.StructuredOutput(kind="json_object")),
    m.GrammarReply(error="e"),
    m.NewRequestData(sequence_id="r1", prompt_token_ids=[1, 2], params=PARAMS,
                     traceparent="00-t-s-01", output_token_ids=[3], kv_destination=DESTINATION),
    m.ScheduledRequest(sequence_id="r1", start=0, num_tokens=2, new_block_ids=[5],
                       sample=False, draft_token_ids=[9], num_steps=3),
    m.BlockCopy(src=1, dst=2),
    m.StepPlan(step_id=3, new_requests=[m.NewRequestData(sequence_id="r1",
                                                         prompt_token_ids=[1], params=PARAMS)],
               scheduled=[m.ScheduledRequest(sequence_id="r1", start=0, num_tokens=1)],
               finished_sequence_ids=["r0"], preempted_sequence_ids=["r9"],
               copy_blocks=[m.BlockCopy(src=1, dst=2)], closed_transfers=["r2>1"]),
    m.StepResult(step_id=3, sampled_token_ids=[42], forward_seconds=0.01, batch_size=1,
                 num_tokens=2, error="e", idle_seconds=0.5, logprobs=[LOGPROBS, None],
                 num_sampled=[1], transfers=[m.KvTransferReport(transfer_id="r1>1")],
                 embeddings=[m.PooledEmbedding(sequence_id="r1", vector=b"\x00\x00\x80?")]),
    m.StepProgress(step_id=3, forward=1, num_forwards=2, sampled_token_ids=[42, 7],
                   logprobs=[LOGPROBS, None]),
    m.PooledEmbedding(sequence_id="r1", vector=b"\x00\x00\x80?"),
    START, TOKENS,
    m.TokenBatch(engine_id="e0", items=[TOKENS]),
    TEXT_LOGPROB, DELTA,
    m.DeltaBatch(items=[DELTA]),
    m.ApiMetricsRequest(),
    RECENT,
    m.ApiMetricsSnapshot(replica="a1", exposition="x 1\n", recent_requests=[RECENT]),
    m.Heartbeat(service="scheduler", instance_id="s1", engine_id="e0", num_running=1,
                num_waiting=2, num_free_blocks=3, num_total_blocks=4, block_size=16,
                num_handled=5, num_reconnects=6, role="decode", num_queued_tokens=7,
                num_evictable_blocks=8, shard="1/2", adapters=["a1"], incarnation="i9"),
    m.AdapterCommand(name="a1", action="load"),
    m.AdapterReply(engine_id="e0", error="e", enabled=False),
    m.ShardSetup(num_blocks=64, block_size=16, max_model_len=1024),
    m.ShardInfoRequest(),
    m.ShardInfo(model_name="m", model_bytes=9, num_model_layers=30, first_layer=15,
                end_layer=30, backend="b", kv_dtype="float16", kv_budget_bytes=99,
                kv_token_bytes=6, weight_bytes=7, kv_bytes=8, error="e"),
    m.ShardStep(step_id=3, part=1, num_parts=2, hidden=b"\x00\x00\x80?", dtype="bfloat16",
                num_tokens=1, query_lens=[1], context_lens=[5], block_tables=[[1]],
                copy_blocks=[m.BlockCopy(src=1, dst=2)]),
    m.ShardFetch(step_id=3, part=1),
    m.ShardHidden(part=1, num_parts=2, hidden=b"\x00\x00\x80?", error="e"),
    m.Ping(),
    m.Pong(service="api", instance_id="a1", ready=False),
]

# encode(example).hex() for each example above, as first written. A message whose bytes change
# breaks every running peer of the other version: append fields with defaults instead, and add
# the new field's value to its example and its bytes here.
GOLDEN = {
    "SamplingParams": (
        "dc0013cb3fe0000000000000cb3feccccccccccccd280807c3910291a10ac3cb3fa999999999999acb3f"
        "e0000000000000cb3fd0000000000000cb3ff199999999999a01028105cbbff000000000000094a57265"
        "676578a65b302d395d2bac6775696465645f7265676578a0a46d65616ea26131"),
    "TokenLogprobs": "93cbbfe0000000000000922a0792cbbfe0000000000000cbbff8000000000000",
    "ChatMessage": "94a475736572a26869a25b5da26331",
    "GenerateRequest": (
        "dc0010a27231a56170692e78a16ddc0013cb3fe0000000000000cb3feccccccccccccd280807c3910291"
        "a10ac3cb3fa999999999999acb3fe0000000000000cb3fd0000000000000cb3ff199999999999a010281"
        "05cbbff000000000000094a57265676578a65b302d395d2bac6775696465645f7265676578a0a46d6561"
        "6ea261319194a475736572a26869a25b5da26331a1709101c202a25b5d01919201912aa27331b97b2265"
        "6e61626c655f7468696e6b696e67223a66616c73657d91a26432c3"),
    "Admission": "980302a8746f6f206c6f6e67a86d65737361676573a2733102c3c3",
    "EncodeRequest": "979194a475736572a26869a25b5da26331a170c2c2a27b7da25b5dc3",
    "EncodeResult": "92920102a165",
    "DecodeRequest": "91920102",
    "DecodeResult": "92a174a165",
    "CacheEvent": "95a26530910b910cc3a27331",
    "SubmitRequest": (
        "99a27231a56170692e78920102dc0013cb3fe0000000000000cb3feccccccccccccd280807c3910291a1"
        "0ac3cb3fa999999999999acb3fe0000000000000cb3fd0000000000000cb3ff199999999999a01028105"
        "cbbff000000000000094a57265676578a65b302d395d2bac6775696465645f7265676578a0a46d65616e"
        "a26131cb3ff80000000000000201919201912a91a26432"),
    "ResumedCompletion": "9201912a",
    "AbortRequest": "93a272310102",
    "UnknownCompletion": "93a2723101a26431",
    "EngineStatsRequest": "90",
    "EngineStats": (
        "dc001aa265300102030405060708090a0bcb3ff8000000000000cb3fe00000000000000c0d0e0f1011cb"
        "3fd0000000000000cb3fc00000000000001213cb3fe800000000000014"),
    "ModelInfoRequest": "90",
    "ModelInfo": "93a16dcd2000a26530",
    "ExecutorInfoRequest": "90",
    "ExecutorInfo": "9ba16dcd200064109102cdc00095a7666c6f61743136101e0340c3c30204",
    "KvLayout": "95a7666c6f61743136101e0340",
    "KvDestination": "94a472313e31a2643001920708",
    "KvReceive": "93a472313e3192070895a7666c6f61743136101e0340",
    "KvChunk": "96a472313e3191070203c4016bc40176",
    "KvReply": "91a165",
    "KvTransferReport": "95a472313e3104cb3fe0000000000000a165cb3fd0000000000000",
    "PrefillRequest": (
        "98a2723101920102dc0013cb3fe0000000000000cb3feccccccccccccd280807c3910291a10ac3cb3fa9"
        "99999999999acb3fe0000000000000cb3fd0000000000000cb3ff199999999999a01028105cbbff00000"
        "0000000094a57265676578a65b302d395d2bac6775696465645f7265676578a0a46d65616ea2613194a4"
        "72313e31a264300192070895a7666c6f61743136101e0340ae652e64302e70726566696c6c6564a93030"
        "2d742d732d3031"),
    "PrefillReply": "91a165",
    "PrefillDone": (
        "99a472313e312a93cbbfe0000000000000922a0792cbbfe0000000000000cbbff8000000000000a16504"
        "cb3fe0000000000000cb3ff8000000000000cb4004000000000000cb3fd0000000000000"),
    "StructuredOutput": (
        "94a663686f696365a55b2261225dad6775696465645f63686f696365a83c2f7468696e6b3e"),
    "GrammarRequest": "9194ab6a736f6e5f6f626a656374a0af726573706f6e73655f666f726d6174a0",
    "GrammarReply": "91a165",
    "NewRequestData": (
        "96a27231920102dc0013cb3fe0000000000000cb3feccccccccccccd280807c3910291a10ac3cb3fa999"
        "999999999acb3fe0000000000000cb3fd0000000000000cb3ff199999999999a01028105cbbff0000000"
        "00000094a57265676578a65b302d395d2bac6775696465645f7265676578a0a46d65616ea26131a93030"
        "2d742d732d3031910394a472313e31a2643001920708"),
    "ScheduledRequest": "97a2723100029105c2910903",
    "BlockCopy": "920102",
    "StepPlan": (
        "97039196a272319101dc0013cb3fe0000000000000cb3feccccccccccccd280807c3910291a10ac3cb3f"
        "a999999999999acb3fe0000000000000cb3fd0000000000000cb3ff199999999999a01028105cbbff000"
        "000000000094a57265676578a65b302d395d2bac6775696465645f7265676578a0a46d65616ea26131a0"
        "90c09197a27231000190c3900191a2723091a272399192010291a472323e31"),
    "StepResult": (
        "9b03912acb3f847ae147ae147b0102a165cb3fe00000000000009293cbbfe0000000000000922a0792cb"
        "bfe0000000000000cbbff8000000000000c091019195a472313e3100cb0000000000000000a0cb000000"
        "00000000009192a27231c4040000803f"),
    "StepProgress": (
        "95030102922a079293cbbfe0000000000000922a0792cbbfe0000000000000cbbff8000000000000c0"),
    "PooledEmbedding": "92a27231c4040000803f",
    "CompletionStart": "97a56170692e780291a178c3a930302d742d732d3031912903",
    "RequestTokens": (
        "9ca2723101912a01a165039193cbbfe0000000000000922a0792cbbfe0000000000000cbbff800000000"
        "0000cb3fd000000000000097a56170692e780291a178c3a930302d742d732d30319129030104c3"),
    "TokenBatch": (
        "92a26530919ca2723101912a01a165039193cbbfe0000000000000922a0792cbbfe0000000000000cbbf"
        "f8000000000000cb3fd000000000000097a56170692e780291a178c3a930302d742d732d303191290301"
        "04c3"),
    "TextLogprob": (
        "96a168cbbfe000000000000092a168a17992cbbfe0000000000000cbbff8000000000000c4016892c401"
        "68c40179"),
    "TextDelta": (
        "dc0011a27231a368c3a901020203a16503019196a168cbbfe000000000000092a168a17992cbbfe00000"
        "00000000cbbff8000000000000c4016892c40168c40179cb3fd0000000000000912a01c3a26431c40400"
        "00803f05"),
    "DeltaBatch": (
        "9191dc0011a27231a368c3a901020203a16503019196a168cbbfe000000000000092a168a17992cbbfe0"
        "000000000000cbbff8000000000000c4016892c40168c40179cb3fd0000000000000912a01c3a26431c4"
        "040000803f05"),
    "ApiMetricsRequest": "90",
    "RecentRequest": (
        "9aaa63686174636d706c2d31a26131cb3ff8000000000000a866696e6973686564a473746f700203cb3f"
        "d0000000000000cb3fe0000000000000a26162"),
    "ApiMetricsSnapshot": (
        "93a26131a47820310a919aaa63686174636d706c2d31a26131cb3ff8000000000000a866696e69736865"
        "64a473746f700203cb3fd0000000000000cb3fe0000000000000a26162"),
    "Heartbeat": (
        "dc0010a97363686564756c6572a27331a2653001020304100506a66465636f64650708a3312f3291a2"
        "6131a26939"),
    "AdapterCommand": "92a26131a46c6f6164",
    "AdapterReply": "93a26530a165c2",
    "ShardSetup": "934010cd0400",
    "ShardInfoRequest": "90",
    "ShardInfo": "9ca16d091e0f1ea162a7666c6f6174313663060708a165",
    "ShardStep": "9a030102c4040000803fa862666c6f61743136019101910591910191920102",
    "ShardFetch": "920301",
    "ShardHidden": "940102c4040000803fa165",
    "Ping": "90",
    "Pong": "93a3617069a26131c2",
}


def _structs() -> list[str]:
    return [name for name in m.__all__
            if isinstance(getattr(m, name), type) and issubclass(getattr(m, name), msgspec.Struct)]


def test_every_message_has_pinned_bytes():
    assert sorted(type(e).__name__ for e in EXAMPLES) == sorted(_structs()) == sorted(GOLDEN)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: type(x).__name__)
def test_bytes_are_pinned(message):
    assert encode(message).hex() == GOLDEN[type(message).__name__]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(message):
    assert decode(encode(message), type(message)) == message


def test_every_field_of_the_examples_is_set():
    """A field left at its default could move without changing the bytes of a default-heavy
    example; every field set pins every position."""
    for example in EXAMPLES:
        for field in msgspec.structs.fields(example):
            if field.default is not msgspec.NODEFAULT:
                assert getattr(example, field.name) != field.default, (example, field.name)


def test_enums_arrive_as_enums():
    delta = decode(encode(m.TextDelta(request_id="r", text="", finish_reason=2)), m.TextDelta)
    assert delta.finish_reason is m.FinishReason.LENGTH
    with pytest.raises(msgspec.ValidationError):  # not a finish reason
        decode(encode(m.TextDelta(request_id="r", text="", finish_reason=9)), m.TextDelta)


def test_field_order_is_the_wire_format():
    # Array-like: positional, in declaration order. Changing this breaks running peers.
    assert msgspec.msgpack.decode(encode(m.ScheduledRequest(sequence_id="r1", start=4,
                                                            num_tokens=1))) == [
        "r1", 4, 1, [], True, [], 1]
    assert encode(m.AbortRequest(request_id="r1")).hex() == "93a27231c0c0"


def test_schema_mismatch_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        decode(encode(m.AbortRequest(request_id="r1")), m.StepResult)
