"""Operator tools: CLI, doctor, demos, benchmarks and the CPU harness; the backend core never imports them."""
