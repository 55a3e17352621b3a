"""Training in parity with a single-process reference: sharding strategies, composition\nwith what real training does, mixed precision, offload, no_sync, clipping, compile,\nHugging Face models."""
