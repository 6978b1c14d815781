"""``sglang-simm demo``: HiCache's L3 write-back and restore, replayed on a CPU."""
