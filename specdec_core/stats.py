"""Per-request speculation statistics, and the timing of one engine step.

Definitions follow vLLM's spec-decode metrics: a *verify step* is one target pass over a
request's K draft tokens; it emits the accepted tokens plus one recovered or bonus token, so
mean acceptance length = (accepted + verify steps) / verify steps, which counts the bonus token
and lies in [1, K+1]. Acceptance rate = accepted / proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens the target kept
    verify_steps: int = 0  # target passes that verified at least one draft token
    plain_steps: int = 0  # target passes without draft tokens
    proposed_per_position: list[int] = field(default_factory=list)  # [K] how often position i was judged
    accepted_per_position: list[int] = field(default_factory=list)  # [K] how often position i was accepted
    proposal_lengths: list[int] = field(default_factory=list)  # [K+1] steps by tokens proposed (0 = plain)
    # An adaptive row's decode steps at K=0, by what set K to 0 (``Scheduler._count_plain_causes``): "priced"
    # (its cost model: speculation does not pay), "batch" (the step's batch as a whole ran fastest plain,
    # ``AdaptiveK.batch_ks``), "reference" (the regret guard's measured plain step), "stopped" (its regret
    # guard tripped at K=1), "draft" (its draft failed and is retried later)
    plain_by_cause: dict[str, int] = field(default_factory=dict)
    prefill_s: float = 0.0  # target prefill, including queueing in its step
    decode_s: float = 0.0  # sum of the wall times of the steps this request took part in
    prefill_wait_s: float = 0.0  # of those steps, the other requests' prefills it waited for (not in decode_s)
    decode_steps: int = 0  # decode steps it took part in (its prefill's is not one)
    decode_batch_rows: int = 0  # the decode batch of each of those steps, summed
    decode_sampled_rows: int = 0  # of those rows, the ones that sample (temperature > 0), summed
    first_token_s: float = 0.0  # from arrival to the first emitted token
    latency_s: float = 0.0  # from arrival to finish

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 1.0

    @property
    def plain_decode_steps(self) -> int:
        """Decode steps without draft tokens: ``plain_steps`` less the prefill's pass, which counts as one."""
        return max(0, self.plain_steps - 1)

    @property
    def mean_decode_batch(self) -> float:
        """The batch it decoded in, on average over its decode steps (0.0 without any): requests join and
        leave a running batch, so the batch at its arrival says little of the steps it ran."""
        return self.decode_batch_rows / self.decode_steps if self.decode_steps else 0.0

    @property
    def sampled_share(self) -> float:
        """The share of sampled rows in the batches it decoded in (0.0 without a decode step): a step of
        greedy and sampled rows costs in between the two paths (``CostView.model_for_batch``)."""
        return self.decode_sampled_rows / self.decode_batch_rows if self.decode_batch_rows else 0.0

    def record_verify(self, num_proposed: int, num_accepted: int) -> None:
        """One verify step: positions 0..num_accepted were judged (the first rejection ends the step)."""
        while len(self.proposal_lengths) <= num_proposed:
            self.proposal_lengths.append(0)
        self.proposal_lengths[num_proposed] += 1
        if num_proposed == 0:
            self.plain_steps += 1
            return
        self.verify_steps += 1
        self.proposed += num_proposed
        self.accepted += num_accepted
        while len(self.proposed_per_position) < num_proposed:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        for pos in range(min(num_accepted + 1, num_proposed)):
            self.proposed_per_position[pos] += 1
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "accepted_per_position": list(self.accepted_per_position),
            "proposed_per_position": list(self.proposed_per_position),
            "proposal_lengths": list(self.proposal_lengths),
            "plain_by_cause": dict(self.plain_by_cause),
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "prefill_wait_s": self.prefill_wait_s,
            "first_token_s": self.first_token_s,
            "latency_s": self.latency_s,
        }


@dataclass
class StepTiming:
    """One engine step's phases (``Engine.last_step``)."""

    batch: int = 0  # running requests in the decode pass
    speculative_rows: int = 0
    k: int = 0  # the step's widest proposal
    draft_tokens: int = 0  # proposed over all rows: the verify is batch + draft_tokens tokens (ragged)
    emitted: int = 0  # tokens the decode rows emitted
    ks: tuple[int, ...] = ()  # per decode row: the tokens it proposed
    context_len: int = 0  # the decode rows' mean context (what the step is priced at: ``step_context``)
    planned_speedup: float = 0.0  # a budgeted plan's expected tokens per second over a plain step's (0: none)
    prefill_rows: int = 0
    propose_s: float = 0.0
    # The decode rows' verify, and the prefill rows' share of that forward (``Scheduler.commit`` splits
    # what an executor times as one: ``decode_clock``)
    verify_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0
