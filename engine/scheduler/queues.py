"""The sequences a scheduler holds, by state: waiting (new or preempted), running, each request's samples, and the
ids finished since the last step. Status changes go through here, so the lists and the statuses agree."""
from __future__ import annotations

from engine.core.sequence import FinishReason, Sequence, SequenceStatus


class SequenceQueues:
    def __init__(self) -> None:
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.by_request: dict[str, list[Sequence]] = {}
        self._running_by_id: dict[int, Sequence] = {}
        self._finished: list[int] = []

    def add(self, seqs: list[Sequence]) -> None:
        """A request's new sequences, waiting."""
        self.by_request.setdefault(seqs[0].request_id, []).extend(seqs)
        self.waiting.extend(seqs)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that starts running without waiting (its prompt's KV was written by another actor)."""
        self.by_request.setdefault(seq.request_id, []).append(seq)
        self._run(seq)

    def start(self, seq: Sequence) -> None:
        """A waiting sequence admitted."""
        self.waiting.remove(seq)
        self._run(seq)

    def _run(self, seq: Sequence) -> None:
        self.running.append(seq)
        self._running_by_id[seq.seq_id] = seq
        seq.status = SequenceStatus.RUNNING

    def set_waiting(self, seq: Sequence) -> None:
        """A running sequence preempted: back to the waiting queue."""
        self.running.remove(seq)
        del self._running_by_id[seq.seq_id]
        self.waiting.append(seq)
        seq.status = SequenceStatus.WAITING

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Out of its queue, finished; the request is forgotten once all its samples are."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            del self._running_by_id[seq.seq_id]
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self._finished.append(seq.seq_id)
        siblings = self.by_request.get(seq.request_id, [])
        if all(s.is_finished for s in siblings):
            self.by_request.pop(seq.request_id, None)

    def live(self, seq_id: int) -> Sequence | None:
        """The running sequence of this id, or None."""
        seq = self._running_by_id.get(seq_id)
        return seq if seq is not None and seq.status is SequenceStatus.RUNNING else None

    @property
    def finished_since_step(self) -> tuple[int, ...]:
        return tuple(self._finished)

    def take_finished(self) -> tuple[int, ...]:
        """The ids finished since the last call, for the step being built."""
        finished, self._finished = tuple(self._finished), []
        return finished
