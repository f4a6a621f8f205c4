"""The part of a scripted test environment that is the same everywhere: turns and
observations as space-separated token ids, and a fixed prompt list. Subclasses set the
rest of the environment protocol (rl.envs.base): name, reward_names, reset, and the
`PROMPTS` token lists."""
from __future__ import annotations

from rl.tasks.base import Prompt


class IdTextEnv:
    """Turn text = the turn's token ids joined by spaces; an observation's text parses back
    to ids the same way. Prompts: `PROMPTS` (lists of token ids), index = position."""

    PROMPTS: tuple[tuple[int, ...], ...] = ()
    max_turns = 3
    max_turn_tokens = 9
    max_prompt_len = 8
    max_episode_tokens = 64

    def decode_turn(self, ids):
        return " ".join(str(int(t)) for t in ids)

    def encode_observation(self, text):
        return [int(t) for t in text.split()]

    def prompts(self) -> list[Prompt]:
        return [Prompt(ids=tuple(p), answer=None, index=i) for i, p in enumerate(self.PROMPTS)]

    def train_prompts(self, start, count):
        return self.prompts()[start:start + count]

    def eval_prompts(self, count):
        return self.prompts()[:count]
