"""The LLM judge reward (`fn: judge`): the reward itself (`reward`), its options (`options`),
the HTTP client with retries and a concurrency budget (`client`), the score parser
(`parse`), the on-disk cache (`cache`) and per-step statistics (`stats`)."""

from mogrpo.rewards.judge.reward import JudgeReward

__all__ = ["JudgeReward"]
