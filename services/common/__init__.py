"""Shared pieces of every service: bus, config, runtime, process control, SGLang client."""
