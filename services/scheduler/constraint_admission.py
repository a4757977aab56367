"""Admitting a constrained request: its executor compiles the constraint first (GrammarRequest),
so that the request is scheduled only once its grammar is ready and a constraint that does not
compile is refused (a 400) before any token is generated.

Compiling can take a while (a big schema); the submit handler runs it as a task of its own, so
the requests that arrive meanwhile are admitted without waiting for it.
"""

from __future__ import annotations

import nats.errors

from llmbus.bus import subjects
from llmbus.bus.messages import Admission, ErrorCode, GrammarReply, GrammarRequest, StructuredOutput
from llmbus.bus.runtime import ServiceRuntime

# Below the tokenizer's admission timeout (3 s), which would otherwise send the request to
# another engine to compile it all over again.
COMPILE_TIMEOUT = 2.5


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
