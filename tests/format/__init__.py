"""certckpt.format: the file, its fingerprints, signatures, reads and writes."""
