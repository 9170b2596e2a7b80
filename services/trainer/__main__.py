"""python -m services.trainer --nats-url URL --run-id ID: run the trainer service alone."""

from services.common.entry import service_main

if __name__ == "__main__":
    service_main("trainer")
