"""Serving-engine integrations of kvcomp.

kvcomp.integrations.vllm: a vLLM v1 KV connector (KvcompConnector) that stores the KV cache of
prompts in kvcompd per chunk of vLLM blocks, keyed by vLLM's chained block hashes, and loads it
back into vLLM's paged blocks (docs/integrations.md, "vLLM"). The transformers integration lives
in kvcomp.hf.
"""
