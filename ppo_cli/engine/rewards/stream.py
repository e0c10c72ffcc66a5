"""Requests to reward servers and judges sent while the rest of the batch is still being sampled.

generate() hands over each row as soon as its stop token is sampled (``finished``); its response is
decoded and queued for every remote component (http, judge), and a request goes out as soon as a
component's ``batch_size`` rows are queued, on an event loop in a thread of its own, so a server's
latency overlaps the decoding of the longer responses. The rows still queued, and those that never
stopped, are sent when generation ends (``ended``), before the rollout's forwards; ``results``
collects them all after.

Each completion's reward is what scoring after sampling gives: the text sent must be the text the
rollout decodes from the finished batch, and a row whose text differs is sent again with that text
(counted in ``resent``). A server sees the batches in finishing order, not in row order. Every
component keeps its max_concurrency across all its batches (one semaphore), and every request its
timeout; the batches share one httpx client (opening one costs tens of milliseconds); ``close``
cancels what is still in flight (generation failed) and never waits past a few seconds.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

CLOSE_WAIT_S = 5.0  # at most this long for cancelled requests to wind down


@dataclass
class _Component:
    scorer: object  # a RemoteScorer (engine/rewards/remote.py)
    limit: asyncio.Semaphore  # its max_concurrency, across all its batches
    queued: list[int] = field(default_factory=list)  # finished rows not yet sent
    sent: list[tuple[list[int], list[str], Future]] = field(default_factory=list)  # rows, their texts, the request


class RewardStream:
    """The remote components ``scorers`` (index in the reward stack -> scorer) of one batch of
    ``prompts`` with their ``columns``; ``decode`` turns a row's response ids into its text."""

    def __init__(self, scorers: dict[int, object], prompts: list, columns: dict[str, list],
                 decode: Callable[[list[int]], str]):
        self.prompts, self.columns, self.decode = prompts, columns, decode
        self.parts = {index: _Component(scorer, asyncio.Semaphore(scorer.policy.max_concurrency))
                      for index, scorer in scorers.items()}
        self.resent = 0  # rows sent again because their text changed (0 when the overlap is exact)
        self.sent_while_sampling = 0  # requests sent before generation ended
        self._texts: dict[int, str] = {}  # row -> its decoded response, as sent
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ppo-reward-stream", daemon=True)
        self._thread.start()
        self._client = asyncio.run_coroutine_threadsafe(self._open_client(), self._loop)

    @staticmethod
    async def _open_client():
        from ppo_cli.engine.rewards.remote import new_client

        return new_client()

    @property
    def indices(self) -> list[int]:
        return list(self.parts)

    def finished(self, rows: list[int], response_ids: list[list[int]]) -> None:
        """Rows whose stop token was just sampled, with their response ids (stop token included)."""
        self._texts.update((row, self.decode(ids)) for row, ids in zip(rows, response_ids))
        for part in self.parts.values():
            part.queued += rows
            size = part.scorer.batch_size
            while len(part.queued) >= size:
                batch, part.queued = part.queued[:size], part.queued[size:]
                self._send(part, batch, [self._texts[row] for row in batch])
                self.sent_while_sampling += 1

    def _send(self, part: _Component, rows: list[int], texts: list[str]) -> None:
        columns = {name: [values[row] for row in rows] for name, values in self.columns.items()}
        prompts = [self.prompts[row] for row in rows]

        async def work():
            client = await asyncio.wrap_future(self._client)
            return await part.scorer.ascore(prompts, texts, columns, part.limit, client)

        part.sent.append((rows, texts, asyncio.run_coroutine_threadsafe(work(), self._loop)))

    def ended(self, responses: list[str]) -> None:
        """Sampling is over and ``responses`` is the batch as decoded from it: the rows not sent yet,
        or sent with another text, are sent now."""
        for part in self.parts.values():
            good = {row for rows, texts, _ in part.sent for row, text in zip(rows, texts) if text == responses[row]}
            self.resent += sum(1 for rows, _, _ in part.sent for row in rows if row not in good)
            rest = [row for row in range(len(responses)) if row not in good]
            for start in range(0, len(rest), part.scorer.batch_size):
                batch = rest[start:start + part.scorer.batch_size]
                self._send(part, batch, [responses[row] for row in batch])

    def results(self, responses: list[str]) -> list:
        """Each component's (B,) values for ``responses`` (given to ``ended`` before), or the exception it raised."""
        try:
            return [self._collect(part, responses) for part in self.parts.values()]
        finally:
            self.close()

    @staticmethod
    def _collect(part: _Component, responses: list[str]):
        values: list = [None] * len(responses)
        try:
            for rows, texts, request in part.sent:  # bounded: every request has a timeout
                for row, text, value in zip(rows, texts, request.result()):
                    if text == responses[row]:
                        values[row] = value
        except Exception as err:
            return err
        return values

    def close(self) -> None:
        """Cancel the requests still in flight and stop the thread (idempotent)."""
        if self._loop.is_closed():
            return

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            client = await asyncio.wrap_future(self._client)
            await client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=CLOSE_WAIT_S)
        except Exception:  # noqa: BLE001 - closing must not mask what made the caller close
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self._loop.close()
