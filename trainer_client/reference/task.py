"""What the reference rollout workers need of an environment."""

from __future__ import annotations

from typing import Protocol


class Task(Protocol):
    """An environment the reference runner plays: prompts, follow-ups between turns, rewards per group."""

    @property
    def turns(self) -> int:
        """Model calls per episode."""
        ...

    @property
    def pass_threshold(self) -> float:
        """An episode passes (for pass@k) when its reward reaches this."""
        ...

    def prompt(self, index: int) -> str: ...

    def task_id(self, index: int) -> str:
        """Which task the prompt of `index` is: rollouts of one task form a GRPO group."""
        ...

    def follow_up(self, reply: str) -> str:
        """What the environment says after a reply that is not the last."""
        ...

    def score(self, episodes: list[list[str]]) -> list[float]:
        """Rewards of a group's episodes, each the list of the agent's replies."""
        ...
