"""A toy environment a tiny random model can learn on a CPU in minutes.

The agent is asked to write; the reward counts the target characters it wrote, up to a budget: 1.0 for
`budget` of them or more. A random model scores a little above zero with a spread inside every GRPO group,
which is all the gradient needs. A share of the reply was won within four steps by a two-token reply (one
token rich in the target, then the end), leaving every group's rewards equal and nothing more to learn; a
count keeps paying for every further target character, so the policy goes on learning to fill its replies
with them. Rewards are computed for a whole group at once, as a reward model or a test harness would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMPTS = (
    "Write a short line.",
    "Say something.",
    "Describe the weather.",
    "Name a few things.",
    "Tell me a story.",
    "Continue the text.",
    "Answer in one line.",
    "Write some code.",
)


@dataclass(frozen=True)
class TargetCharactersTask:
    target: str = "e"
    """The characters the reward counts."""
    budget: int = 32
    """Target characters that earn the full reward."""
    turns: int = 1
    """Model calls per episode: after each reply but the last the environment asks for more."""
    prompts: tuple[str, ...] = field(default=PROMPTS)
    pass_threshold: float = 0.5
    """An episode passes (for pass@k) when its reward reaches this."""

    def prompt(self, index: int) -> str:
        return self.prompts[index % len(self.prompts)]

    def task_id(self, index: int) -> str:
        return f"prompt-{index % len(self.prompts)}"

    def follow_up(self, reply: str) -> str:
        """What the environment says after a reply that is not the last."""
        return "More."

    def score(self, episodes: list[list[str]]) -> list[float]:
        """Rewards of a batch of episodes, each the list of the agent's replies."""
        return [self._reward("".join(replies)) for replies in episodes]

    def _reward(self, text: str) -> float:
        return round(min(1.0, sum(ch in self.target for ch in text) / self.budget), 6)
