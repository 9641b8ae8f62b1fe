"""kvtier.connectors: thin adapters that plug the store into serving engines (vLLM, SGLang)."""
