"""KV blocks moved between executors (services/executor/kv_gathering.py, kv_transfer.py), on a
tiny random model: a prefill engine's runner gathers a prompt's blocks as its chunks fill them,
a decode engine's receiver writes them into the blocks its scheduler holds (after a prefix it
caches itself), and the decode engine goes on exactly as the prefill engine would have. And
what the receiver refuses: another layout, a transfer not open (or closed), blocks outside it,
a short chunk."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from llmbus.bus.messages import (
    KvChunk,
    KvDestination,
    KvReceive,
    KvReply,
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
)
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.kv_gathering import CHUNK_OVERHEAD_BYTES, Outgoing, gather
from llmbus.services.executor.kv_transfer import KvReceiver, KvSender
from llmbus.services.executor.runner import ModelRunner
from tests.gguf_fixtures import TinySpec, write_tiny_llama

PROMPT = [1, 17, 33, 5, 90, 41, 7, 250, 12, 60, 3, 99, 144, 8]  # 14 tokens: 4 blocks of 4
GREEDY = SamplingParams(temperature=0.0, logprobs=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, TinySpec())
    return path


def runner(path) -> ModelRunner:
    return ModelRunner(path, model_name="tiny", block_size=4, num_blocks=16)


def decode(r: ModelRunner, sequence_id: str, num_tokens: int, steps: int,
           new_block_ids: list[int]) -> list:
    """Greedy decodes of a registered sequence of `num_tokens` tokens, the first step adding
    these blocks: (token, its logprob) each."""
    out = []
    for step in range(steps):
        result = r.step(StepPlan(step_id=100 + step, scheduled=[ScheduledRequest(
            sequence_id, num_tokens + step - 1, 1, new_block_ids if step == 0 else [])]))
        assert result.error == "", result.error
        out.append((result.sampled_token_ids[0], result.logprobs[0].logprob))
    return out


def test_blocks_land_in_the_held_slots_after_a_cached_prefix(model_path):
    prefill, decoder = runner(model_path), runner(model_path)
    # The decode engine caches the prompt's first block: it computed it itself, in a chunk of
    # the shape the prefill engine's first chunk has (9 tokens), then forgot the sequence.
    warm = decoder.step(StepPlan(step_id=0, new_requests=[
        NewRequestData("warm", PROMPT[:9], GREEDY)], scheduled=[
        ScheduledRequest("warm", 0, 9, [3, 8, 10])]))
    assert warm.error == ""
    decoder.step(StepPlan(step_id=1, finished_sequence_ids=["warm"]))
    held = [9, 2, 6]  # for prompt blocks 1, 2, 3
    destination = KvDestination(transfer_id="t1", engine_id="D", first_block=1,
                                block_ids=held)
    receiver = KvReceiver(decoder.kv_cache)
    assert receiver.receive(KvReceive(transfer_id="t1", block_ids=held,
                                      layout=receiver.layout)).error == ""
    # The prefill engine: its own blocks (5, 1, 7, 4), the prompt in chunks of 9 and 5.
    first = prefill.step(StepPlan(step_id=0, new_requests=[
        NewRequestData("p", PROMPT, GREEDY, kv_destination=destination)], scheduled=[
        ScheduledRequest("p", 0, 9, [5, 1, 7], sample=False)]))
    [early], _ = prefill.kv_gathering.take()  # block 1 filled (block 0 is the decoder's own)
    assert not early.final and [c.block_ids for c in early.chunks] == [[9]]
    last = prefill.step(StepPlan(step_id=1, scheduled=[ScheduledRequest("p", 9, 5, [4])]))
    assert first.error == last.error == ""
    [final], dropped = prefill.kv_gathering.take()
    assert dropped == []
    assert final.final and sorted(b for c in final.chunks for b in c.block_ids) == [2, 6]
    for chunk in early.chunks + final.chunks:
        assert receiver.write(chunk).error == ""
    for source, target in zip([1, 7, 4], held, strict=True):  # exact copies
        assert torch.equal(decoder.kv_cache.k[:, target], prefill.kv_cache.k[:, source])
        assert torch.equal(decoder.kv_cache.v[:, target], prefill.kv_cache.v[:, source])
    # The decode engine takes the prefill engine's first token and decodes on; the prefill
    # engine, decoding on itself, is the reference: the same tokens and logprobs, bit for bit.
    token = last.sampled_token_ids[0]
    plan = StepPlan(step_id=2, closed_transfers=["t1"], new_requests=[
        NewRequestData("d", PROMPT, GREEDY, output_token_ids=[token])])
    receiver.close(plan.closed_transfers)  # as the executor's service does, before the step
    decoder.step(plan)
    assert (decode(decoder, "d", len(PROMPT) + 1, 4, [3, *held, 12])
            == decode(prefill, "p", len(PROMPT) + 1, 4, [11]))
    assert receiver.write(early.chunks[0]).error  # closed: no more blocks taken


def test_a_block_too_big_for_one_message_goes_by_layers():
    spec = TinySpec(num_layers=6)
    from llmbus.services.executor.weights.model_config import LlamaConfig

    config = LlamaConfig(num_layers=spec.num_layers, hidden_size=64, intermediate_size=128,
                         num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256,
                         rope_theta=1e4, rms_norm_eps=1e-5, context_length=64,
                         bos_token_id=1, eos_token_ids=(2,), tie_word_embeddings=False)
    source, target = (KVCache(config, 8, 4) for _ in range(2))
    source.k.normal_()
    source.v.normal_()
    layer_bytes = 2 * 4 * 2 * 16 * 4  # K and V of one layer of one block, float32
    destination = KvDestination(transfer_id="t", engine_id="D", first_block=0,
                                block_ids=[5, 6])
    outgoing = gather(source, destination, [1, 2], 0, CHUNK_OVERHEAD_BYTES + 4 * layer_bytes,
                      final=True)
    assert [(c.block_ids, c.first_layer, c.num_layers) for c in outgoing.chunks] == [
        ([5], 0, 4), ([5], 4, 2), ([6], 0, 4), ([6], 4, 2)]
    assert all(len(c.k) + len(c.v) <= 4 * layer_bytes for c in outgoing.chunks)
    receiver = KvReceiver(target)
    receiver.receive(KvReceive(transfer_id="t", block_ids=[5, 6], layout=receiver.layout))
    for chunk in outgoing.chunks:
        assert receiver.write(chunk).error == ""
    assert torch.equal(target.k[:, [5, 6]], source.k[:, [1, 2]])
    assert torch.equal(target.v[:, [5, 6]], source.v[:, [1, 2]])
    assert target.k[:, [0, 1, 2, 3, 4, 7]].abs().sum() == 0  # nothing else written


def test_what_the_receiver_refuses(model_path):
    decoder = runner(model_path)
    receiver = KvReceiver(decoder.kv_cache)
    other = msgspec.structs.replace(receiver.layout, dtype="float16")
    refused = receiver.receive(KvReceive(transfer_id="t", block_ids=[3], layout=other))
    assert refused.error.startswith("KV layout mismatch") and "float16" in refused.error
    assert receiver.receive(KvReceive(transfer_id="t", block_ids=[0, 3],
                                      layout=receiver.layout)).error  # the null block
    assert receiver.receive(KvReceive(transfer_id="t", block_ids=[3, 4],
                                      layout=receiver.layout)).error == ""
    destination = KvDestination(transfer_id="t", engine_id="D", first_block=0,
                                block_ids=[3, 5])
    one_block = CHUNK_OVERHEAD_BYTES + 2 * decoder.kv_cache.k[:, 0].numel() * 4
    [inside, outside] = gather(decoder.kv_cache, destination, [1, 2], 0, one_block,
                               True).chunks
    assert "outside" in receiver.write(outside).error
    short = msgspec.structs.replace(inside, k=bytes(len(inside.k) - 4))
    assert "expected" in receiver.write(short).error
    assert "not open" in receiver.write(msgspec.structs.replace(inside, transfer_id="u")).error
    assert receiver.write(inside).error == ""


def test_an_opening_after_its_close_and_a_given_up_transfer_on_the_same_blocks(model_path):
    receiver = KvReceiver(runner(model_path).kv_cache)
    layout = receiver.layout
    assert receiver.receive(KvReceive(transfer_id="old", block_ids=[3, 4], layout=layout)) \
        .error == ""
    # The scheduler gave blocks 4 and 5 to a new transfer: the old one may write no more.
    assert receiver.receive(KvReceive(transfer_id="new", block_ids=[4, 5], layout=layout)) \
        .error == ""
    assert set(receiver.open) == {"new"}
    receiver.close(["new"])
    late = receiver.receive(KvReceive(transfer_id="new", block_ids=[4, 5], layout=layout))
    assert "was closed" in late.error and not receiver.open


async def test_a_cancelled_transfer_sends_no_more():
    sent: list[list[int]] = []
    release = asyncio.Event()

    async def send(subject: str, chunk) -> KvReply:
        sent.append(chunk.block_ids)
        await release.wait()
        return KvReply()

    destination = KvDestination(transfer_id="t", engine_id="D", first_block=0,
                                block_ids=[1, 2, 3, 4, 5, 6])
    chunks = [KvChunk(transfer_id="t", block_ids=[b], first_layer=0, num_layers=1, k=b"k",
                      v=b"v") for b in destination.block_ids]
    sender = KvSender(send, lambda engine: f"kv.{engine}", in_flight=2)
    assert await sender.send_all([Outgoing(destination, chunks, final=False)]) == []
    await asyncio.sleep(0)  # two in flight, the others wait for a slot
    assert sent == [[1], [2]]
    await sender.send_all([], dropped=["t"])  # its request ended on the prefill engine
    release.set()
    await asyncio.sleep(0.01)
    assert sent == [[1], [2]]  # nothing more went out
    assert (await sender.finish("t")).num_bytes == 0  # and it is forgotten
