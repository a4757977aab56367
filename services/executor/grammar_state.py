"""A constrained request's place in its grammar (structured output), kept between steps.

sampling/constraints.py compiles grammars and masks a step's logits; this is the state of one
request between those two. A grammar may wait for a text before it starts (a thinking model's
`</think>`: the reasoning is free, the answer constrained): until the output has written that
text, sampled tokens go towards it instead of into the matcher, and its rows are not masked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from llmbus.bus.messages import StructuredOutput
    from llmbus.services.executor.sampling.constraints import Grammars


@dataclass
class GrammarState:
    matcher: LLMatcher
    # The text the grammar waits for before it starts (b"" once written), and the output's
    # last bytes, where that text may be half written.
    after: bytes = b""
    tail: bytes = b""

    @classmethod
    def start(cls, grammars: Grammars, structured: StructuredOutput,
              output_token_ids: Sequence[int] = ()) -> GrammarState:
        """A copy of the constraint's compiled matcher (raises where it does not compile),
        taken where `output_token_ids` (a resumed request's output so far) took it."""
        state = cls(grammars.matcher(structured), structured.after.encode())
        for token_id in output_token_ids:
            state.take(token_id, grammars.token_bytes)
        return state

    @property
    def constrained(self) -> bool:
        """Whether the request's next token is masked by its grammar."""
        return not self.after

    def take(self, token_id: int, token_bytes: Callable[[int], bytes]) -> None:
        """A sampled token into the grammar, or towards the text the grammar waits for."""
        if not self.after:
            self.matcher.consume_token(token_id)
            return
        self.tail += token_bytes(token_id)
        if self.after in self.tail:
            self.after = b""  # the grammar takes the tokens from the next one on
        else:
            self.tail = self.tail[-len(self.after):]
