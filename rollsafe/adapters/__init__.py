"""The outside world: engine clients (SGLang, vLLM), the embedded reference engine, launchers, Ray actors."""
