"""python -m services.eval --nats-url URL --run-id ID: run the eval service alone."""

from services.common.entry import service_main

if __name__ == "__main__":
    service_main("eval")
