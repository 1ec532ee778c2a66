"""Rollout workers: unmodified `openai` SDK agents playing a toy environment through the gateway.

The runner keeps a bounded number of GRPO groups in flight and starts the next group only when one ends, so a
long run never creates its tasks up front. Each group's rewards are computed in one batch, then every rollout
is finished with its reward. A model call that fails (a backend restarting, say) is retried: the gateway has
recorded the failed call as an error turn, and the trainer masks such rollouts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import httpx
import openai

from trainer_client.reference.task import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    group_size: int = 8
    groups_in_flight: int = 2
    max_tokens: int = 16
    min_tokens: int = 0
    """vLLM's `min_tokens`: replies at least this long (no end-of-turn before)."""
    temperature: float = 1.0
    model: str = "tiny"
    retry_for: float = 300.0
    """Seconds an agent keeps retrying a failed model call before its rollout is finished as failed."""
    seed: int | None = 0
    """Base of the per-call sampling seeds (derived from the tags, group number, member and turn) that make a
    run repeatable; None samples unseeded."""


@dataclass
class RunnerStats:
    groups: int = 0
    rollouts: int = 0
    failed_rollouts: int = 0
    calls: int = 0
    """Model calls answered."""
    retried_calls: int = 0
    """Model calls that failed and were made again."""


class RolloutRunner:
    def __init__(
        self,
        gateway_url: str,
        task: Task,
        config: RunnerConfig | None = None,
        *,
        name: str | None = None,
        control_token: str | None = None,
    ) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.task = task
        self.config = config or RunnerConfig()
        self.name = name or f"run-{uuid.uuid4().hex[:8]}"
        self.stats = RunnerStats()
        headers = {"authorization": f"Bearer {control_token}"} if control_token else None
        self._control = httpx.AsyncClient(base_url=self.gateway_url, timeout=60.0, headers=headers)
        self._next_group = 0

    async def run(
        self,
        *,
        groups: int | None = None,
        stop: Callable[[], bool] = lambda: False,
        tags: list[str] | None = None,
    ) -> RunnerStats:
        """Play `groups` groups (or until `stop()`), at most `groups_in_flight` at a time: each worker starts
        its next group when its last one has ended."""
        last = None if groups is None else self._next_group + groups

        async def worker() -> None:
            while not stop() and (last is None or self._next_group < last):
                index = self._next_group
                self._next_group += 1
                await self.play_group(index, tags)

        await asyncio.gather(*(worker() for _ in range(self.config.groups_in_flight)))
        return self.stats

    async def play_group(self, index: int, tags: list[str] | None = None) -> list[float]:
        """One GRPO group: `group_size` agents on the same prompt, rewarded together."""
        group_id = f"{self.name}-{index}"
        prompt = self.task.prompt(index)
        created = await asyncio.gather(
            *(self._create(group_id, f"{group_id}-{m}", index, tags) for m in range(self.config.group_size))
        )
        episodes = await asyncio.gather(
            *(
                self._play(rollout, prompt, self._seed(index, member, tags))
                for member, rollout in enumerate(created)
            )
        )
        played = [
            (rollout, replies)
            for rollout, replies in zip(created, episodes, strict=True)
            if replies is not None
        ]
        rewards = self.task.score([replies for _, replies in played])
        await asyncio.gather(
            *(
                self._finish(rollout["rollout_id"], r)
                for (rollout, _), r in zip(played, rewards, strict=False)
            )
        )
        self.stats.groups += 1
        self.stats.rollouts += len(created)
        return rewards

    async def _create(
        self, group_id: str, rollout_id: str, index: int, tags: list[str] | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "rollout_id": rollout_id,
            "group_id": group_id,
            "group_size": self.config.group_size,
            "task_id": self.task.task_id(index),
        }
        if tags:
            body["tags"] = tags
        response = await self._control.post("/rollouts", json=body)
        response.raise_for_status()
        return cast(dict[str, Any], response.json())

    def _seed(self, index: int, member: int, tags: list[str] | None) -> int | None:
        if self.config.seed is None:
            return None
        key = f"{self.config.seed}/{','.join(tags or ())}/{index}/{member}".encode()
        return zlib.crc32(key) * 64  # room for the turn number below it

    async def _play(self, rollout: dict[str, Any], prompt: str, seed: int | None) -> list[str] | None:
        """The agent's replies, or None when a call kept failing (the rollout is then finished as failed)."""
        agent = openai.AsyncOpenAI(
            # With --rollout-keys the agent holds its rollout's own key, nothing more.
            base_url=rollout["base_url"],
            api_key=rollout.get("api_key") or "unused",
            max_retries=0,
            timeout=120.0,
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        replies: list[str] = []
        try:
            for turn in range(self.task.turns):
                reply = await self._call(agent, messages, None if seed is None else seed + turn)
                if reply is None:
                    await self._finish(rollout["rollout_id"], None)
                    return None
                replies.append(reply)
                messages.append({"role": "assistant", "content": reply})
                if turn < self.task.turns - 1:
                    messages.append({"role": "user", "content": self.task.follow_up(reply)})
        finally:
            await agent.close()
        return replies

    async def _call(
        self, agent: openai.AsyncOpenAI, messages: list[dict[str, Any]], seed: int | None
    ) -> str | None:
        deadline = time.monotonic() + self.config.retry_for
        delay = 0.5
        while True:
            try:
                completion = await agent.chat.completions.create(
                    model=self.config.model,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=self.config.max_tokens,
                    temperature=self.config.temperature,
                    seed=seed,
                    extra_body={"min_tokens": self.config.min_tokens} if self.config.min_tokens else None,
                )
                self.stats.calls += 1
                return completion.choices[0].message.content or ""
            except (openai.APIConnectionError, openai.InternalServerError, openai.APITimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    log.warning("giving up on a model call: %s", exc)
                    return None
                self.stats.retried_calls += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _finish(self, rollout_id: str, reward: float | None) -> None:
        body: dict[str, Any] = (
            {"status": "completed", "reward": reward} if reward is not None else {"status": "failed"}
        )
        if reward is None:
            self.stats.failed_rollouts += 1
        response = await self._control.post(f"/rollouts/{rollout_id}/finish", json=body)
        response.raise_for_status()

    async def close(self) -> None:
        await self._control.aclose()
