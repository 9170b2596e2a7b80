"""python -m services.weightsync --nats-url URL --run-id ID: run the weight-sync service alone."""

from services.common.entry import service_main

if __name__ == "__main__":
    service_main("weight-sync")
