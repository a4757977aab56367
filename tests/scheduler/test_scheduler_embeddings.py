"""Embedding requests in the scheduler: their prompt in chunks beside decodes, never sampled,
never speculated on or stepped several times, no prefix reuse (pooling needs every row), and
they end when the executor's vector arrives, with their blocks freed; an error or abort ends
them toward their api copy, not a detokenizer."""

from __future__ import annotations

from llmbus.bus.messages import FinishReason, PooledEmbedding, StepResult
from llmbus.services.scheduler.outputs import embedding_answer
from tests.scheduler.sim import add, make, make_speculative

VECTOR = b"\x00\x00\x80?"  # float32 1.0


def _result(plan, vectors=()) -> StepResult:
    """The step's answer: token 7 for every sampler, the given pooled vectors."""
    return StepResult(step_id=plan.step_id,
                      sampled_token_ids=[7] * sum(i.sample for i in plan.scheduled),
                      embeddings=[PooledEmbedding(sequence_id, VECTOR) for sequence_id in vectors])


def test_an_embedding_prompt_goes_in_chunks_beside_a_decode_and_ends_with_its_vector():
    s = make(num_blocks=16, max_num_batched_tokens=6, prefix_caching=True)
    add(s, "gen", 3, max_tokens=8)
    s.update(plan := s.schedule(), _result(plan))  # gen prefilled: it decodes from now on
    add(s, "emb", 12, max_tokens=1, pooling="mean")
    chunks = []
    while True:
        plan = s.schedule()
        items = {i.sequence_id: i for i in plan.scheduled}
        assert items["gen"].sample and items["gen"].num_tokens == 1  # the decode keeps going
        emb = items.get("emb")
        if emb is None:
            break
        assert not emb.sample and emb.num_steps == 1 and not emb.draft_token_ids
        chunks.append((emb.start, emb.num_tokens))
        done = emb.start + emb.num_tokens == 12
        s.update(plan, _result(plan, ["emb"] if done else []))
        if done:
            break
    assert chunks[0][0] == 0 and sum(n for _, n in chunks) == 12 and len(chunks) > 1
    [ended] = s.take_embedded()
    assert ended.request.request_id == "emb" and ended.vector == VECTOR
    assert ended.request.finish_reason is FinishReason.STOP and s.table.get("emb") is None
    answer = embedding_answer(ended)
    assert (answer.embedding, answer.finish_reason, answer.num_prompt_tokens) == (
        VECTOR, FinishReason.STOP, 12)
    s.check_invariants()  # its blocks are back (the decode still holds its own)


def test_a_chat_goes_ahead_of_embedding_inputs_still_waiting():
    """Generations keep their order among themselves; embeddings wait behind all of them,
    in their own order, whether they arrived before or after."""
    s = make(num_blocks=64, max_num_batched_tokens=4)
    add(s, "gen0", 3, max_tokens=4)
    for name in ("emb0", "emb1"):
        add(s, name, 12, max_tokens=1, pooling="mean")
    add(s, "gen1", 3, max_tokens=4)
    add(s, "emb2", 12, max_tokens=1, pooling="mean")
    add(s, "gen2", 3, max_tokens=4)
    assert [r.request_id for r in s.waiting] == ["gen0", "gen1", "gen2", "emb0", "emb1", "emb2"]
    first = s.schedule()  # 4 tokens: gen0's prompt and the first of gen1's
    assert [(i.sequence_id, i.num_tokens) for i in first.scheduled] == [("gen0", 3), ("gen1", 1)]


def test_an_embedding_prompt_reuses_no_cached_prefix():
    s = make(num_blocks=16, prefix_caching=True)
    add(s, "first", 12, max_tokens=1)
    s.update(plan := s.schedule(), _result(plan))  # its prompt's full blocks are cached
    add(s, "emb", 12, max_tokens=1, pooling="mean")  # the same prompt
    [item] = [i for i in s.schedule().scheduled if i.sequence_id == "emb"]
    assert item.start == 0 and item.num_tokens == 12


def test_no_drafts_for_an_embedding_prompt():
    s = make_speculative(k=4)
    add(s, "emb", 9, max_tokens=1, pooling="last")
    for _ in range(3):
        plan = s.schedule()
        for item in plan.scheduled:
            assert not item.draft_token_ids and not item.sample and item.num_steps == 1
        s.update(plan, _result(plan))


def test_an_aborted_or_failed_embedding_answers_its_api_not_a_detokenizer():
    s = make(num_blocks=16)
    add(s, "emb", 8, max_tokens=1, pooling="mean")
    add(s, "gen", 3, max_tokens=4)
    s.schedule()
    s.abort_request("emb")
    updates = s.fail_all("the executor failed")
    assert [u.request_id for u in updates] == ["gen"]  # only generation goes downstream
    aborted, = [e for e in s.take_embedded() if e.request.request_id == "emb"]
    answer = embedding_answer(aborted)
    assert answer.finish_reason is FinishReason.ERROR and answer.embedding == b""
    s.check_invariants()
