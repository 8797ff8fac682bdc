"""The verify-length choice: how many draft positions each request verifies this step.

Every request has one query row; all draft positions of the batch are ranked by survival
probability (ties: request order, then position), and the total rows T is the one that
maximises expected tokens / estimated step time; the T - base extra rows go to the
top-ranked positions (spec/deepinfer.md §1.6, DeepInfer's MTPVarlen).

That choice follows the batch and the measured step times, so in batch-invariant mode a
request's length comes from its own survival estimates and a fixed cost model instead
(`plan_own_verify_length`), as DeepInfer turns MTP_VARLEN off for determinism.
"""

from deepwell.engine.speculative.step_time import StepTimeCurve

# Batch-invariant mode's fixed cost model: a verify row costs this fraction of a decode
# step. There every linear computes whole 64-row tiles (layers/batch_invariant.py), so a
# few more rows cost little; a position pays while its survival beats a tenth of the rate.
INVARIANT_ROW_COST = 0.1


def plan_verify_lengths(
    survival: list[list[float]],
    num_decodes: int,
    base_rows: int,
    max_extra: int,
    curve: StepTimeCurve,
) -> list[int]:
    """Draft positions to verify per request.

    survival: per drafting request, non-increasing survival of its positions;
    num_decodes: requests that produce a token this step (each yields >= 1 token);
    base_rows: query rows of the step before any draft position;
    max_extra: rows the step's token budget leaves for draft positions.
    """
    ranked = sorted(
        (
            (-p, request, position)
            for request, probs in enumerate(survival)
            for position, p in enumerate(probs)
        )
    )
    best_extra, best_rate = 0, num_decodes / curve.estimate(base_rows)
    expected = float(num_decodes)
    for extra, (neg_p, _, _) in enumerate(ranked[:max_extra], start=1):
        expected -= neg_p
        rate = expected / curve.estimate(base_rows + extra)
        if rate > best_rate:
            best_extra, best_rate = extra, rate
    lengths = [0] * len(survival)
    for _, request, _ in ranked[:best_extra]:
        lengths[request] += 1
    return lengths


def plan_own_verify_length(survival: list[float], row_cost: float = INVARIANT_ROW_COST) -> int:
    """Draft positions one request verifies, from its own non-increasing survival alone:
    the length maximising expected tokens (1 + the survivals) per unit of a fixed cost
    (1 + row_cost per position). Nothing else in the batch enters, nor any measured time."""
    best_length, best_rate = 0, 1.0
    expected = 1.0
    for length, p in enumerate(survival, start=1):
        expected += p
        rate = expected / (1.0 + row_cost * length)
        if rate > best_rate:
            best_length, best_rate = length, rate
    return best_length
