"""GrammarCompiler: grammars compiled off the step loop, in a thread pool, cached by grammar.

A thread pool, not a process pool: llguidance drops the GIL while it builds a matcher
(measured: a 300-property pattern schema compiles in 29 ms and a Python thread keeps
running meanwhile), its fuel limits bound pathological grammars, and a compiled matcher
cannot cross a process boundary, so a process pool could only validate, not compile.
"""

import concurrent.futures
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import llguidance

from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.structured.matcher import GrammarMatcher
from deepwell.engine.structured.spec import StructuredOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Longest accepted schema / regex / grammar text.
DEFAULT_MAX_SPEC_BYTES = 1024 * 1024
_CACHE_SIZE = 256
# Compile threads run this much nicer than the step loop: where cores are short, the step
# loop wins the CPU and a compile waits (DeepInfer pins its compile pool to idle CPUs).
_COMPILE_NICENESS = 10


class GrammarError(InvalidRequestError):
    """A grammar is invalid, too large, or took too long to compile; only its request fails."""


@dataclass
class PendingGrammar:
    """One request's compile: poll it from the step loop until it is ready or fails."""

    spec: StructuredOutput
    future: concurrent.futures.Future
    deadline: float
    timeout_s: float

    def matcher(self, stop_token_ids: frozenset[int]) -> GrammarMatcher | None:
        """The request's own matcher once compiled, None while compiling; raises GrammarError."""
        if not self.future.done():
            if time.monotonic() > self.deadline:
                raise GrammarError(
                    f"compiling the {self.spec.kind} grammar took longer than {self.timeout_s:g} s"
                )
            return None
        template = self.future.result()  # raises the compile's GrammarError
        return GrammarMatcher(
            template.deep_copy(),
            self.spec.trigger_token_ids,
            self.spec.bound_token_id,
            stop_token_ids,
        )


class GrammarCompiler:
    """Compiles `StructuredOutput`s into llguidance matchers for one model's vocabulary.

    `make_tokenizer` builds the vocabulary (~0.5 s); it runs in the pool on first use, so
    an engine that never sees a constrained request never pays for it.
    """

    def __init__(
        self,
        make_tokenizer: Callable[[], llguidance.LLTokenizer],
        *,
        workers: int = 1,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES,
    ) -> None:
        self._make_tokenizer = make_tokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, "deepwell-grammar", initializer=_lower_priority
        )
        self._tokenizer: concurrent.futures.Future | None = None
        self._cache: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self.timeout_s = timeout_s
        self.max_spec_bytes = max_spec_bytes
        self.num_compiles = 0

    def submit(self, spec: StructuredOutput) -> PendingGrammar:
        """Start (or reuse) the compile of `spec`'s grammar; raises GrammarError at once when
        the spec is too large or malformed."""
        size = len(spec.spec.encode())
        if size > self.max_spec_bytes:
            raise GrammarError(
                f"the {spec.kind} constraint is {size} bytes; the limit is {self.max_spec_bytes}"
            )
        try:
            grammar = spec.grammar()
        except InvalidRequestError as error:
            raise GrammarError(str(error)) from None
        if self._tokenizer is None:
            self._tokenizer = self._pool.submit(self._make_tokenizer)
        future = self._cache.get(grammar)
        if future is None:
            future = self._pool.submit(self._compile, grammar, spec.kind)
            self.num_compiles += 1
            self._cache[grammar] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(grammar)
        return PendingGrammar(spec, future, time.monotonic() + self.timeout_s, self.timeout_s)

    def wait(self, pending: list[PendingGrammar], timeout_s: float) -> None:
        """Block until one compile finishes or `timeout_s` passes (an idle step loop)."""
        concurrent.futures.wait(
            [p.future for p in pending], timeout_s, concurrent.futures.FIRST_COMPLETED
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, grammar: str, kind: str) -> llguidance.LLMatcher:
        tokenizer = self._tokenizer.result()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            # The first mask builds the lexer's start state: do it here, not in a step.
            matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(f"invalid {kind} constraint: {matcher.get_error()}")
        return matcher


def _lower_priority() -> None:
    # On Linux a thread id names one thread here, so only the compile thread is reniced.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_NICENESS)
