"""StreamProcessor: inference chunks in, a dialect's protocol events out, chunk by chunk.

Groups parser output per input chunk and releases it as spec/recipe.md §8.1 and §8.4 say.
"""

from __future__ import annotations

from collections import deque

from deepwell.recipe.encoding.special_tokens import SpecialToken
from deepwell.recipe.options import ParsingOptions
from deepwell.recipe.stream.chunks import (
    ChunkGenerator,
    CompletionUsage,
    InferenceChunk,
    InferenceFinishReason,
    LogprobEntry,
    PromptUsage,
    new_tool_call_id,
)
from deepwell.recipe.stream.json_calls import DSML, JsonCallParser, json_call_markers
from deepwell.recipe.stream.parser import (
    ARGUMENT,
    BRACKET,
    CALL,
    CONTENT,
    DROP,
    MATCHED,
    REASONING,
    STOP,
    STRING_VALUE,
    TO_SPACE,
    Action,
    StreamParser,
    build_stages,
)
from deepwell.recipe.stream.utf8 import DecodedText, TokenBytes, TokenDecoder

_OPEN = 0
_FINISHED = 1
_CLOSED = 2

# `_last_kind` before anything was released, and after an atom an empty chunk cannot echo.
_UNSET = -2
_SILENT = -1

_FINISH_REASONS = {
    InferenceFinishReason.Length: "length",
    InferenceFinishReason.ContentFilter: "content_filter",
}


class _Record:
    """One input chunk as the parser saw it: its span, its atoms, what was released."""

    __slots__ = ("start", "end", "atoms", "released", "decoded", "waiting")

    def __init__(self, start: int, end: int, decoded: DecodedText | None) -> None:
        self.start = start
        self.end = end
        # Atoms are [kind, text, start, end]; runs of one kind merge until released.
        self.atoms: list[list] = []
        self.released = 0
        self.decoded = decoded
        # Ids (by index) not yet attached to any atom.
        self.waiting = list(range(len(decoded.starts))) if decoded is not None else []


class StreamProcessor:
    """Drives one response: `push` each inference chunk, then `finish` (or a finish chunk).

    Each call returns the protocol events (the generator's chunk/event objects) that are
    ready; text that may still be a marker is held until it is settled.
    """

    __slots__ = (
        "_generator",
        "_parser",
        "_text_stages",
        "_token_stages",
        "_decoder",
        "_records",
        "_state",
        "_started",
        "_last_kind",
        "_calls",
        "_completion_tokens",
        "_reasoning_text",
        "_thinking",
        "_json",
        "_token_mode",
        "_reasoned",
        "_prompt_usage",
    )

    def __init__(
        self,
        generator: ChunkGenerator,
        parsing_options: ParsingOptions,
        tokenizer: TokenBytes | None = None,
    ) -> None:
        options = parsing_options
        self._generator = generator
        self._decoder = TokenDecoder(tokenizer) if tokenizer is not None else None
        self._text_stages = _stages(options, str)
        self._token_stages = None
        if self._decoder is not None:
            self._token_stages = _stages(options, self._decoder.symbol)
        if options.tool_call_format == DSML:
            self._parser = StreamParser(options, self._text_stages)
        else:
            self._parser = JsonCallParser(options, self._text_stages)
        self._records: deque[_Record] = deque()
        self._state = _OPEN
        self._started = False
        self._last_kind = _UNSET
        self._calls = 0
        self._completion_tokens = 0
        # All reasoning text, from text and token chunks alike: it is encoded again at the end.
        self._reasoning_text: list[str] = []
        stage = options.thinking_initial_stage
        self._thinking = stage is not None
        self._json = options.parse_json_output
        self._token_mode = False
        self._reasoned = False
        self._prompt_usage = PromptUsage()

    @property
    def finished(self) -> bool:
        return self._state == _FINISHED

    def push(self, chunk: InferenceChunk) -> list:
        if self._state != _OPEN:
            raise RuntimeError(
                "stream processor has finished"
                if self._state == _FINISHED
                else "stream processor is closed"
            )
        out: list = []
        kind = chunk.kind
        # Token ids that decode to nothing yet do not start the stream.
        if not self._started and kind != "tokens":
            self._start(chunk, out)
        if kind == "text":
            self._completion_tokens += chunk.token_count
            if self._token_mode:
                self._switch(False)
            self._feed(chunk.content, None, out)
        elif kind == "tokens":
            self._push_tokens(chunk, out)
        elif kind == "finish":
            reason = chunk.finish_reason
            if reason is InferenceFinishReason.Stop:
                self._end("tool_calls" if self._calls else "stop", out)
            else:
                self._end(_FINISH_REASONS[reason], out)
        return out

    def finish(self) -> list:
        if self._state == _CLOSED:
            raise RuntimeError("stream processor is closed")
        if self._state == _FINISHED:
            return []
        out: list = []
        if not self._started:
            self._start(None, out)
        # Without a finish chunk the reason is `stop`, tool calls or not (spec/recipe.md §8.4).
        self._end("stop", out)
        return out

    def close(self) -> None:
        self._state = _CLOSED
        self._records.clear()

    def _start(self, chunk: InferenceChunk | None, out: list) -> None:
        self._started = True
        fingerprint = None
        if chunk is not None and chunk.kind == "ready":
            self._prompt_usage = chunk.prompt_usage
            fingerprint = chunk.system_fingerprint
        self._generator.start(self._prompt_usage, fingerprint, out)

    def _push_tokens(self, chunk: InferenceChunk, out: list) -> None:
        if self._decoder is None:
            self.close()
            raise RuntimeError("token chunk received without a tokenizer")
        try:
            segments = self._decoder.push(chunk.token_ids, chunk.logprobs)
        except RuntimeError:
            self.close()
            raise
        if not segments:
            return
        if not self._started:
            self._start(chunk, out)
        if not self._token_mode:
            self._switch(True)
        for decoded in segments:
            self._completion_tokens += decoded.id_count
            self._feed(decoded.text, decoded, out)
            if self._state != _OPEN:
                return

    def _switch(self, token_mode: bool) -> None:
        """Text and token chunks spell markers differently (see utf8.py); re-match pending text."""
        self._token_mode = token_mode
        actions: list[Action] = []
        self._parser.use_stages(self._token_stages if token_mode else self._text_stages, actions)
        self._place(actions)

    def _feed(self, text: str, decoded: DecodedText | None, out: list) -> None:
        parser = self._parser
        if not self._records and (decoded is None or decoded.logprobs is None):
            # Hot path: nothing held back and no character of `text` can begin a marker, so
            # the whole chunk settles as one run and is released at once (with no log
            # probabilities to hand out, which ids went where does not matter).
            kind = parser.settle(text)
            if kind >= 0:
                self._emit_run(kind, text, decoded, None, out)
                return
        record = _Record(parser.end, parser.end + len(text), decoded)
        self._records.append(record)
        actions: list[Action] = []
        parser.feed(text, actions)
        self._place(actions)
        self._release(out, False)

    def _end(self, reason: str, out: list) -> None:
        actions: list[Action] = []
        self._parser.flush(actions)
        self._place(actions)
        if self._release(out, True):
            return
        self._conclude(reason, None, out)

    def _conclude(self, reason: str, stop_sequence: str | None, out: list) -> None:
        self._state = _FINISHED
        self._records.clear()
        usage = self._prompt_usage
        reasoning = None
        if self._thinking and self._decoder is not None:
            # The reference counts reasoning tokens by encoding all reasoning text again (text
            # chunks' included), not by the ids it saw; it needs only a tokenizer, no token
            # chunk (docs/recipe.md, "Stream usage and accumulation").
            reasoning = len(self._decoder.encode("".join(self._reasoning_text)))
        self._generator.finish(
            reason,
            stop_sequence,
            CompletionUsage(
                usage.prompt_tokens,
                usage.prompt_cache_hit_tokens,
                self._completion_tokens,
                reasoning,
            ),
            out,
        )

    def _place(self, actions: list[Action]) -> None:
        """Attribute each action to the chunk(s) holding its characters."""
        records = self._records
        last = records[-1] if records else None
        for kind, start, end, text in actions:
            if kind <= MATCHED:
                if last is not None and start >= last.start:
                    _add(last, kind, text, start, end)
                    continue
                for record in records:
                    if record.end <= start or record.start == record.end:
                        continue
                    if record.start >= end:
                        break
                    a = max(start, record.start)
                    b = min(end, record.end)
                    _add(record, kind, text[a - start : b - start], a, b)
            else:
                for record in reversed(records):
                    if record.start <= start < record.end:
                        record.atoms.append([kind, text, start, end])
                        break

    def _release(self, out: list, everything: bool) -> bool:
        """Emit what is settled, oldest chunk first; True if a stop sequence ended the stream."""
        records = self._records
        pending_start = self._parser.pending_start
        while records:
            record = records[0]
            if record.start == record.end:
                kind = self._last_kind
                if kind == _UNSET:
                    kind = _first_atom_kind(records)
                    if kind == _UNSET:
                        if not everything:
                            break
                        kind = _SILENT
                if kind >= 0:
                    self._emit_run(kind, "", record.decoded, None, out)
                records.popleft()
                continue
            complete = everything or record.end <= pending_start
            atoms = record.atoms
            n = len(atoms)
            if not complete and n:
                # The chunk's last atom waits until every character of the chunk is settled.
                n -= 1
            for k in range(record.released, n):
                kind, text, start, end = atoms[k]
                if kind == STOP:
                    self._conclude("stop", text, out)
                    return True
                logprobs = None
                if record.decoded is not None:
                    logprobs = self._take_ids(record, k)
                if kind <= MATCHED:
                    self._emit_run(kind, text, record.decoded, logprobs, out)
                else:
                    self._emit_atom(kind, text, record, logprobs, out)
            record.released = n
            if not complete:
                break
            records.popleft()
        return False

    def _emit_run(
        self,
        kind: int,
        text: str,
        decoded: DecodedText | None,
        logprobs: list | None,
        out: list,
    ) -> None:
        if kind >= DROP:
            self._last_kind = _SILENT
            return
        self._last_kind = kind
        generator = self._generator
        if decoded is not None:
            text = text.translate(self._decoder.spelling_of)
        if kind == CONTENT:
            generator.content(text, logprobs, out)
        elif kind == REASONING:
            if text:
                self._reasoned = True
                self._reasoning_text.append(text)
            generator.reasoning(text, logprobs, out)
        elif kind == TO_SPACE:
            generator.content(" ", logprobs, out)
        else:
            generator.arguments(self._calls - 1, text, kind == STRING_VALUE, out)

    def _emit_atom(
        self, kind: int, text: str, record: _Record, logprobs: list | None, out: list
    ) -> None:
        self._last_kind = _SILENT
        generator = self._generator
        if kind == CALL:
            if self._decoder is not None:
                # A name may have begun in a token chunk and ended in a text chunk.
                text = text.translate(self._decoder.spelling_of)
            # spec/recipe.md §15.2: `ET_` marks calls of a thinking request's stream with no
            # reasoning yet; the request's mode, whatever stage the parsing options start in.
            thinking = self._generator.thinking_mode
            call_id = new_tool_call_id(self._calls, thinking and not self._reasoned)
            generator.tool_call(self._calls, call_id, text, out)
            self._calls += 1
        elif kind == ARGUMENT:
            generator.arguments(self._calls - 1, text, False, out)
        elif kind == BRACKET:
            generator.content(text, logprobs, out)

    def _take_ids(self, record: _Record, k: int) -> list[LogprobEntry] | None:
        """The ids that go with atom k of a token chunk (spec/recipe.md §8.2).

        A text atom is released once the next atom began, so it carries every waiting id whose
        text was read by then (up to the end of the next atom). A marker swallows the ids lying
        wholly inside it; ids of other dropped text (leading newlines, markup) wait for the
        next text atom.
        """
        kind, _, start, end = record.atoms[k]
        decoded = record.decoded
        offset = record.start
        starts = decoded.starts
        ends = decoded.ends
        waiting = record.waiting
        if kind == MATCHED:
            record.waiting = [
                i for i in waiting if not (start <= starts[i] + offset and ends[i] + offset <= end)
            ]
            return None
        if kind > TO_SPACE and kind != BRACKET:
            return None
        atoms = record.atoms
        frontier = atoms[k + 1][3] if k + 1 < len(atoms) else record.end
        if any(atom[0] == STOP for atom in atoms[k + 1 :]):
            # A stop sequence ends the stream: the text before it takes the rest of the chunk.
            frontier = record.end
        taken = [i for i in waiting if ends[i] + offset <= frontier]
        if taken:
            record.waiting = [i for i in waiting if ends[i] + offset > frontier]
        entries = decoded.logprobs
        if entries is None:
            return None
        if self._json and kind != REASONING:
            # JSON mode rewrites the answer's events; the reference then gives each of them
            # every log probability of the chunk.
            return [entry for entry in entries if entry is not None]
        return [entries[i] for i in taken if entries[i] is not None]


def _stages(options: ParsingOptions, spell):
    """The parser's markers, spelled by `spell` (text as is, or token-chunk symbols)."""
    if options.tool_call_format == DSML:
        think_end = options.special_tokens.token(SpecialToken.ThinkingEnd)
        dsml = options.special_tokens.token(SpecialToken.Dsml)
        return build_stages(options, spell(think_end), spell(dsml))
    return json_call_markers(options, spell)


def _add(record: _Record, kind: int, text: str, start: int, end: int) -> None:
    atoms = record.atoms
    if atoms and len(atoms) > record.released:
        last = atoms[-1]
        if last[0] == kind:
            last[1] += text
            last[3] = end
            return
    atoms.append([kind, text, start, end])


def _first_atom_kind(records: deque[_Record]) -> int:
    """The kind of the first classified atom after the head: what a waiting empty chunk takes."""
    for record in records:
        if record.atoms:
            kind = record.atoms[0][0]
            return kind if kind < DROP else _SILENT
    return _UNSET
