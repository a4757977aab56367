"""Every NATS subject the pipeline uses, in one place.

Subjects carry a version (`v1`) so that a changed wire format can run beside the old one during
a rolling upgrade. The version is per subject: one whose messages change layout takes the next
version in the same place (`llmbus.v2....`), the others keep theirs. Subjects with a `{...}` part
are addressed to one instance (an engine, an api copy); the rest are shared by every copy of a
stage through a queue group.
"""

from __future__ import annotations

PREFIX = "llmbus.v1"
# The detokenizer's token subjects. v2: a completion's constants (reply subject, stop strings,
# ...) come once per detokenizer copy, in RequestTokens.start, not with every update.
TOKENS_PREFIX = "llmbus.v2"

# api -> tokenizer (request/reply, queue group "tokenizer"): admit a request.
TOKENIZER_GENERATE = f"{PREFIX}.tokenizer.generate"
# api -> tokenizer (request/reply, queue group "tokenizer"): encode/decode without generating.
TOKENIZER_ENCODE = f"{PREFIX}.tokenizer.encode"
TOKENIZER_DECODE = f"{PREFIX}.tokenizer.decode"


# tokenizer -> any scheduler (request/reply, queue group "scheduler"): enqueue a tokenized
# request, before any engine has been heard from; after that the router picks one engine
# (engine_submit).
ENGINE_SUBMIT = f"{PREFIX}.engine.submit"

# api -> any scheduler (request/reply, queue group "scheduler"): the served model and its limits.
ENGINE_MODEL = f"{PREFIX}.engine.model"


# anyone -> every scheduler (request, many replies): counters of every engine.
ENGINE_STATS = f"{PREFIX}.engine.stats"


def engine_stats(engine_id: str) -> str:
    """anyone -> one scheduler (request/reply): counters of its engine."""
    return f"{PREFIX}.engine.{engine_id}.stats"




# api -> every api copy (request, many replies): each copy's request metrics, so that a scrape
# of any copy sharing the port sees them all.
API_METRICS = f"{PREFIX}.api.metrics"

# anyone -> every scheduler (publish): abort a request wherever it is.
SCHEDULER_ABORT = f"{PREFIX}.engine.abort"


def executor_info(engine_id: str) -> str:
    """scheduler -> executor (request/reply): model and KV-cache geometry of one engine."""
    return f"{PREFIX}.engine.{engine_id}.executor.info"


def executor_step(engine_id: str) -> str:
    """scheduler -> executor (request/reply): run one batched forward step."""
    return f"{PREFIX}.engine.{engine_id}.executor.step"


def executor_progress(engine_id: str) -> str:
    """executor -> its scheduler (publish, StepProgress): each forward's tokens of a plan of
    several forwards, ahead of the plan's reply."""
    return f"{PREFIX}.engine.{engine_id}.executor.progress"


def executor_shard(engine_id: str, index: int | str, what: str) -> str:
    """lead shard -> layer shard `index` of an engine split by layers (request/reply; `what`:
    info (ShardInfoRequest), setup (ShardSetup), step (ShardStep), fetch (ShardFetch))."""
    return f"{PREFIX}.engine.{engine_id}.executor.shard.{index}.{what}"


# api -> every executor (request, many replies; no queue group): load or unload a LoRA adapter
# (AdapterCommand -> one AdapterReply per engine).
EXECUTOR_ADAPTERS = f"{PREFIX}.executor.adapters"


def executor_adapter(engine_id: str) -> str:
    """scheduler -> its executor (request/reply, AdapterCommand): prepare a request's LoRA
    adapter before the request is scheduled."""
    return f"{PREFIX}.engine.{engine_id}.executor.adapter"


def executor_grammar(engine_id: str) -> str:
    """scheduler -> executor (request/reply): compile a request's output constraint ahead."""
    return f"{PREFIX}.engine.{engine_id}.executor.grammar"


def executor_kv_receive(engine_id: str) -> str:
    """decode scheduler -> its executor (request/reply, KvReceive): open a KV transfer into
    blocks it holds (disaggregated prefill)."""
    return f"{PREFIX}.engine.{engine_id}.executor.kv_receive"


def executor_kv(engine_id: str) -> str:
    """prefill executor -> decode executor (request/reply, KvChunk -> KvReply): KV blocks."""
    return f"{PREFIX}.engine.{engine_id}.executor.kv"


def engine_prefill(engine_id: str) -> str:
    """decode scheduler -> a prefill engine's scheduler (request/reply, PrefillRequest)."""
    return f"{PREFIX}.engine.{engine_id}.prefill"


def engine_prefill_cancel(engine_id: str) -> str:
    """decode scheduler -> the prefill engine (publish, AbortRequest by transfer id): the
    decode engine gave the prefill up (aborted, timed out, prefilled it itself)."""
    return f"{PREFIX}.engine.{engine_id}.prefill_cancel"


def engine_prefilled(engine_id: str) -> str:
    """prefill scheduler -> the decode scheduler (publish, PrefillDone): the KV is there."""
    return f"{PREFIX}.engine.{engine_id}.prefilled"


# scheduler -> detokenizer (publish): new tokens of one step. The detokenizer keeps per-request
# decode state, so each completion is sent to one copy's own subject (detokenizer_tokens, see
# services/scheduler/detokenizer_routing.py); this shared subject, a queue group, is only used
# before any copy has been heard from.
DETOKENIZER_TOKENS = f"{TOKENS_PREFIX}.detokenizer.tokens"


def api_deltas(api_id: str) -> str:
    """detokenizer -> the api copy that owns the requests (publish): text deltas."""
    return f"{PREFIX}.api.{api_id}.deltas"


def ping(service: str) -> str:
    """launcher/health -> any copy of a service (request/reply): readiness probe."""
    return f"{PREFIX}.ping.{service}"


def heartbeat(service: str) -> str:
    """every copy of a service -> anyone watching (publish, periodic): alive, and how busy."""
    return f"{PREFIX}.heartbeat.{service}"


# engines -> routers (publish): prefix-cache blocks stored or evicted.
ENGINE_CACHE_EVENTS = f"{PREFIX}.engine.cache_events"


def engine_submit(engine_id: str) -> str:
    """router (tokenizer) -> one chosen scheduler (request/reply): enqueue a request there."""
    return f"{PREFIX}.engine.{engine_id}.submit"


def engine_withdraw(engine_id: str) -> str:
    """router (tokenizer) -> one scheduler (publish): a request it did not admit in time went
    to another engine; drop it silently, now or when its submit arrives."""
    return f"{PREFIX}.engine.{engine_id}.withdraw"


def engine_unknown_completion(engine_id: str) -> str:
    """detokenizer -> the scheduler whose tokens it cannot decode (publish): it holds nothing of
    that completion and got no start with them (UnknownCompletion)."""
    return f"{PREFIX}.engine.{engine_id}.unknown_completion"


def detokenizer_tokens(instance_id: str) -> str:
    """scheduler -> the detokenizer copy a request is assigned to (publish)."""
    return f"{TOKENS_PREFIX}.detokenizer.{instance_id}.tokens"


# The queue group of a stateless stage is simply the stage name.
def queue_group(service: str) -> str:
    return service


# Replies to a user's requests (a service's bus user, when the bus has users): inboxes under a
# prefix that only this user may subscribe to (services/nats_auth.py), not the shared `_INBOX`.
def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


# The api's stored responses (services/api/response_store_bus.py) live in a JetStream key-value
# bucket: a stream KV_<bucket> holding subjects $KV.<bucket>.<key>, which the client manages
# through the server's JetStream API ($JS.API.<verb>...). These names are JetStream's own, so
# they carry no llmbus version; the bucket's name is ours.
RESPONSES_BUCKET = "llmbus_responses"
RESPONSES_STREAM = f"KV_{RESPONSES_BUCKET}"
JS_API = "$JS.API"

# LoRA adapters (services/adapter_store_bus.py) live in a JetStream object store: a stream
# OBJ_<bucket> holding each adapter's chunks ($O.<bucket>.C.<nuid>) and its metadata
# ($O.<bucket>.M.<name, base64>). Every engine on any host reads an adapter from there.
ADAPTERS_BUCKET = "llmbus_adapters"
ADAPTERS_STREAM = f"OBJ_{ADAPTERS_BUCKET}"


def js_stream_api(verb: str, stream: str) -> str:
    """client -> JetStream (request/reply): a verb (`STREAM.INFO`, `STREAM.CREATE`,
    `STREAM.MSG.GET`, `DIRECT.GET`, ...) on one stream."""
    return f"{JS_API}.{verb}.{stream}"


def kv_key(bucket: str, key: str) -> str:
    """client -> JetStream (publish, acknowledged): the value of `key` in a key-value bucket
    (the same subject with a KV-Operation header deletes it)."""
    return f"$KV.{bucket}.{key}"


def object_chunks(bucket: str, nuid: str) -> str:
    """client -> JetStream (publish, acknowledged): one object's chunks in an object store."""
    return f"$O.{bucket}.C.{nuid}"


def object_meta(bucket: str, name_b64: str) -> str:
    """client -> JetStream (publish, acknowledged): an object's metadata (its name, size,
    digest, chunks' nuid; a deleted object's marker), the name in URL-safe base64."""
    return f"$O.{bucket}.M.{name_b64}"

