"""Admitting a constrained request: its executor compiles the constraint first (GrammarRequest),
so that the request is scheduled only once its grammar is ready and a constraint that does not
compile is refused (a 400) before any token is generated.

Compiling can take a while (a big schema); the submit handler runs it as a task of its own, so
the requests that arrive meanwhile are admitted without waiting for it. An abort that comes
while a request compiles is remembered here, and the request is refused once it has compiled.
"""

from __future__ import annotations

import nats.errors

from llmbus.bus import subjects
from llmbus.bus.messages import (
    Admission,
    ErrorCode,
    GrammarReply,
    GrammarRequest,
    StructuredOutput,
    SubmitRequest,
)
from llmbus.bus.runtime import ServiceRuntime

# Below the tokenizer's admission timeout (3 s), which would otherwise send the request to
# another engine to compile it all over again.
COMPILE_TIMEOUT = 2.5


class GrammarAdmission:
    def __init__(self, runtime: ServiceRuntime, engine_id: str) -> None:
        self.runtime, self.engine_id = runtime, engine_id
        self.compiling: dict[tuple[str, int], bool] = {}  # (request id, attempt) -> aborted

    async def compile(self, submit: SubmitRequest) -> Admission | None:
        """None once the executor holds the submit's compiled constraint; else the refusal to
        send (its client went away meanwhile: refused, not to be tried elsewhere)."""
        assert submit.params.structured is not None
        key = (submit.request_id, submit.attempt)
        self.compiling[key] = False
        try:
            refused = await compile_constraint(self.runtime, self.engine_id,
                                               submit.params.structured)
        finally:
            aborted = self.compiling.pop(key)
        if refused is not None:
            return refused
        if aborted:
            return Admission(error_code=ErrorCode.INVALID_REQUEST,
                             error_message="aborted while its constraint compiled")
        return None

    def abort(self, request_id: str, up_to_attempt: int | None) -> None:
        """The request (its attempts up to `up_to_attempt`: a migration's older ones) is
        refused once it has compiled."""
        for key in self.compiling:
            if key[0] == request_id and (up_to_attempt is None or key[1] <= up_to_attempt):
                self.compiling[key] = True


async def compile_constraint(runtime: ServiceRuntime, engine_id: str,
                             structured: StructuredOutput,
                             timeout: float = COMPILE_TIMEOUT) -> Admission | None:
    """None once the executor holds the compiled constraint; else the refusal to send."""
    try:
        reply = await runtime.request(subjects.executor_grammar(engine_id),
                                      GrammarRequest(structured=structured), GrammarReply,
                                      timeout=timeout)
    except nats.errors.NoRespondersError:
        return Admission(error_code=ErrorCode.OVERLOADED,
                         error_message="this engine's executor is not reachable; retry shortly")
    except (TimeoutError, nats.errors.TimeoutError):
        # Busy compiling others, or a grammar this slow: either way, not the client's fault
        # for sure, so a retryable refusal (503) rather than a 400.
        return Admission(error_code=ErrorCode.OVERLOADED,
                         error_message=f"the constraint did not compile within {timeout:g} s "
                                       "(the engine may be compiling others; a schema that "
                                       "slow to compile is too complex)")
    if reply.error:
        return Admission(error_code=ErrorCode.INVALID_REQUEST, error_message=reply.error,
                         error_param=structured.param)
    return None
