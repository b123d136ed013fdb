"""HF safetensors export, verification and loading for recovery."""
