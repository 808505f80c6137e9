"""Replayed allocation timelines: align the probes' allocation events over shapes (align), fit each
event's bytes and presence (events), and read a probe window's peak and kept bytes at any shape
(windows). See docs/MEMORY_MODEL.md."""
