"""Engine adapters: `kvtier.integrations.transformers` (Hugging Face causal LMs) and
`kvtier.integrations.vllm` (vLLM's offloading connector). Each imports its engine lazily."""
