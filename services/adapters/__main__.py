"""python -m services.adapters --nats-url URL --run-id ID: run the multi-LoRA adapter registry alone."""

from services.common.entry import service_main

if __name__ == "__main__":
    service_main("adapters")
