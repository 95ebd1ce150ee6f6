"""Sequence slots of the contiguous KV layout: which cache line (NxD's `seq_id`) holds
each running request.

A decode batch of the contiguous layout runs in the first batch bucket above its largest
seq_id, not its row count (NxDI fills a partial batch with the missing seq_ids of
range(bucket): `core.inputs.token_generation_inputs`). vLLM's block ids would make poor
slots: it reuses a freed block first (its free queue is LIFO for uncached blocks), so a
lone request after a busy period keeps landing on whatever high block freed last and
decodes in the largest batch bucket. Each new request therefore takes the lowest free
slot, and the running requests' largest seq_id stays below their count as far as the
departures allow.
"""

from __future__ import annotations

import heapq


class SeqSlots:
    """Lowest-free slot allocation over [0, count) for request ids."""

    def __init__(self, count: int):
        self.count = count
        self._free = list(range(count))
        self._held: dict[str, int] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    def __getitem__(self, req_id: str) -> int:
        return self._held[req_id]

    def assign(self, req_id: str) -> int:
        """The request's slot: the lowest free one, taken once (again after release)."""
        slot = self._held.get(req_id)
        if slot is not None:
            return slot
        if not self._free:
            raise RuntimeError(
                f"no free sequence slot for request {req_id}: all {self.count} are held "
                f"({sorted(self._held.values())}); vLLM ran more than max_num_seqs requests "
                f"at once, please report this with the engine log"
            )
        slot = heapq.heappop(self._free)
        self._held[req_id] = slot
        return slot

    def release(self, req_id: str) -> None:
        """The request left (finished, or preempted: it is prefilled again into a new
        slot); nothing if it held none."""
        slot = self._held.pop(req_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)
