"""The rollout gateway: the fleet served over HTTP (OpenAI and SGLang-native), issue #35."""
