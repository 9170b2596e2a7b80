"""python -m services.buffer --nats-url URL --run-id ID: run the buffer service alone."""

from services.common.entry import service_main

if __name__ == "__main__":
    service_main("buffer")
