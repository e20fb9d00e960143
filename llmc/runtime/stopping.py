"""When a sequence stops, and which of its text may be streamed yet."""

from __future__ import annotations

from collections.abc import Iterable

from llmc.runtime.request import FinishReason, SamplingParams


class StopChecker:
    """Stop conditions of one sequence, fed one token (and its newly decoded text) at a time.

    Stops on an EOS id (any of several, unless `ignore_eos`), on a `stop_token_ids` id, on a stop
    string found in the text (also across tokens), and with `FinishReason.LENGTH` at `max_tokens`.
    No stop applies to the first `min_tokens` tokens. Neither a stop string nor the text of a stop
    token is part of the output (as OpenAI does). Text that could still begin a stop string is held
    back until it is clearly not one, so a stream never shows part of a stop string. It keeps only that held
    tail: the sequence owns its tokens, its text and its finish reason.
    """

    def __init__(self, params: SamplingParams, eos_ids: Iterable[int]) -> None:
        self.params = params
        self.eos_ids = frozenset() if params.ignore_eos else frozenset(int(t) for t in eos_ids)
        self.stop_ids = frozenset(int(t) for t in params.stop_token_ids)
        self.stops = tuple(s for s in params.stop if s)
        self._held = ""  # a tail that may be the start of a stop string

    def on_token(self, token_id: int, new_text: str, generated: int) -> tuple[str, FinishReason | None]:
        """Account for a generated token (the `generated`-th); return the text that may be emitted now and, if the
        sequence ends here, why. After a finish, the held-back text has been emitted too."""
        stopping_allowed = generated > self.params.min_tokens
        if stopping_allowed and (int(token_id) in self.eos_ids or int(token_id) in self.stop_ids):
            return self._take_held(), FinishReason.STOP
        text, reason = self._scan(self._held + new_text, stopping_allowed)
        if reason is None and generated >= self.params.max_tokens:
            return text + self._take_held(), FinishReason.LENGTH
        return text, reason

    def flush(self) -> str:
        """Release the held-back tail (for a sequence ended from outside, e.g. aborted)."""
        return self._take_held()

    def _scan(self, buffer: str, stopping_allowed: bool) -> tuple[str, FinishReason | None]:
        """Split `buffer` into text to emit now and a held tail; cut it at the first stop string."""
        if not self.stops or not stopping_allowed:
            return buffer, None
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buffer[:cut], FinishReason.STOP
        keep = self._partial_stop_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _take_held(self) -> str:
        text, self._held = self._held, ""
        return text
