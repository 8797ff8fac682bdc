"""DraftCadence: when the step loop stops overlapping steps to look for drafts.

With speculation and asynchronous scheduling both on, a step in flight hides its requests'
last tokens from the drafter, and a verify step must finish before the next is planned:
drafting wins, overlap takes the lulls.
"""

# The loop stays synchronous while drafts keep coming (they come and go: on repetitive text
# a hit every other step is common, and overlapping after 8 misses cost a fifth of batch-1
# decode speed). After this many proposals in a row find none, steps overlap...
_PROPOSALS_BEFORE_OVERLAP = 32
# ...and every this many overlapped steps the loop drains once to look for drafts again.
_DRAFT_PROBE_INTERVAL = 8


class DraftCadence:
    def __init__(self, every_step: bool = False) -> None:
        # Batch-invariant mode looks every step: skipping a look would give a request a
        # verify length of 0 because of how the batch's other requests drafted.
        self.every_step = every_step
        self._steps_to_probe = 0
        self._proposals_without_drafts = 0

    def propose_now(self, step_in_flight: bool) -> bool:
        """Whether to look for drafts this step (draining the step in flight to do so)."""
        if step_in_flight and self._steps_to_probe > 0 and not self.every_step:
            self._steps_to_probe -= 1
            return False
        return True

    def record(self, found_drafts: bool) -> None:
        """A proposal found drafts for some running request, or for none."""
        if found_drafts:
            self._proposals_without_drafts = 0
        else:
            self._proposals_without_drafts += 1
        if self._proposals_without_drafts >= _PROPOSALS_BEFORE_OVERLAP:
            self._steps_to_probe = _DRAFT_PROBE_INTERVAL
