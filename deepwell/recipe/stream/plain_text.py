"""Raw completions' side of the stream: generated ids to text, ended by the first stop string.

No stages and no markers (that is `StreamProcessor`'s job); the same `TokenDecoder` and the
same cross-chunk `Matcher` as the dialects' stream, so text and stops agree between them.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepwell.recipe.stream.matcher import Matcher, Pattern, PatternSet
from deepwell.recipe.stream.utf8 import TokenBytes, TokenDecoder


class PlainTextStream:
    """Text of one completion so far; `settled` says how much of it no stop string can take back.

    A stop string ends the text where it starts (it is not part of the text), as soon as
    it is complete, whichever pattern completes first; ids after it are ignored.
    """

    __slots__ = ("_decoder", "_matcher", "_pending", "text", "stop_string")

    def __init__(self, tokenizer: TokenBytes, stop: Sequence[str] = ()) -> None:
        self._decoder = TokenDecoder(tokenizer)
        self._matcher = Matcher(PatternSet([Pattern(s) for s in stop])) if stop else None
        # Characters at the end of `text` that may be the start of a stop string.
        self._pending = 0
        self.text = ""
        self.stop_string: str | None = None

    @property
    def settled(self) -> int:
        """How much of `text` is final: all of it once stopped, else short of a partial stop."""
        return len(self.text) - self._pending

    def push(self, token_ids: Sequence[int]) -> None:
        """Add the text of `token_ids`; an unfinished character waits for the next ids."""
        if self.stop_string is not None:
            return
        for segment in self._decoder.push(token_ids, None):
            self._append(segment.text)
            if self.stop_string is not None:
                return

    def finish(self) -> None:
        """The stream has ended: held bytes become text, and nothing is pending any more."""
        if self.stop_string is None:
            self._append(self._decoder.flush())
        self._pending = 0

    def _append(self, text: str) -> None:
        start = len(self.text)
        self.text += text.translate(self._decoder.spelling_of)
        if self._matcher is None:
            return
        step = self._matcher.step
        for at in range(start, len(self.text)):
            index, length = step(self.text[at])
            if index >= 0:
                self.text = self.text[: at + 1 - length]
                self.stop_string = self._matcher.patterns[index].text
                self._pending = 0
                return
            self._pending = length
