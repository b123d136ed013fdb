"""The rollout gateway: the fleet serving OpenAI and SGLang-native HTTP from the trainer's
process, so RL frameworks point their rollout URL at it (issue #35; docs/gateway.md)."""
