"""python -m services.rollout --nats-url URL --run-id ID: run the rollout service alone."""

from services.common.entry import service_main

if __name__ == "__main__":
    service_main("rollout")
