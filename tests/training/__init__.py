"""Training in parity with a single-process reference: sharding strategies, composition
with what real training does, mixed precision, offload, no_sync, clipping, compile,
Hugging Face models."""
