"""Tests of checkpoint directories on disk: format, checksums, the atomic switch, the safe
unpickler, the direct reader, resharding, conversion, interchange with FSDP2."""
