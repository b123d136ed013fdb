"""The outside world: engine clients (SGLang, vLLM), the reference engine, launchers, Ray actors."""
